"""One OpenMP team against two: the engine stepped on its own thread (EngineLoop), with the starting
thread's OpenMP workers given back (what EngineLoop.start does) and with them kept (the starting
thread runs one parallel torch op after the start, as any torch work there would).

    python -m batchtop.engine.bench.openmp_teams [--models tiny,smollm2] [--rows 1,2,4,8,16]
                                                 [--rounds 3] [--output 100] [--no-write]

Per row count: that many requests of 48 prompt and `--output` tokens at once, the two modes alternated
round by round; per mode the median step where every row decodes (StepFinished's phases summed) and
the process's voluntary context switches per step (getrusage: each sleep of an OpenMP worker is one).
The C++ kernels and torch ops (BATCHTOP_CPU_KERNEL=0) each run in a process of their own. Writes its
section of docs/benchmarks.md (unless --no-write).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from batchtop.engine.core.config import EngineConfig
from batchtop.engine.core.engine import Engine
from batchtop.engine.core.loop import EngineLoop
from batchtop.engine.core.sampling import SamplingParams
from batchtop.engine.model.loading import load_model
from batchtop.telemetry import events as ev

from .figures import commit, cpu_name, publish

SECTION = "## One OpenMP team: the engine's thread and the thread that started it"
MODES = ("one team", "two teams")
PROMPT_TOKENS = 48


def build(loaded, num_rows: int, events: list) -> Engine:
    return Engine(EngineConfig(model=loaded.name, max_num_seqs=num_rows, enable_prefix_caching=False,
                               flight_recorder_steps=0), sink=events.append, loaded=loaded)


def drive(engine: Engine, events: list, num_rows: int, output_tokens: int,
          second_team: bool = False) -> tuple[float, float]:
    """Start the engine's loop, run `num_rows` requests at once to their end: (median ms of a step with
    every row decoding, the process's voluntary context switches per step)."""
    loop = EngineLoop(engine).start()
    if second_team:
        torch.ones(1 << 22).sum()          # a parallel region on this thread: libgomp makes it a team
    before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    sampling = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
    for i in range(num_rows):
        loop.add_request([100 + (i * 31 + j) % 900 for j in range(PROMPT_TOKENS)], sampling)
    while loop.running and (loop.num_waiting or loop.call(engine.has_unfinished)):
        time.sleep(0.02)
    loop.stop()
    switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before
    steps = [e for e in events if isinstance(e, ev.StepFinished)]
    decoding = [e.step_s for e in steps if e.num_tokens == e.num_rows == num_rows]
    return statistics.median(decoding) * 1e3, switches / len(steps)


def run(loaded, num_rows: int, output_tokens: int, second_team: bool) -> tuple[float, float]:
    events: list = []
    return drive(build(loaded, num_rows, events), events, num_rows, output_tokens, second_team)


def measure(model: str, rows: list[int], rounds: int, output_tokens: int) -> dict:
    """{rows: {mode: [(ms, switches) per round]}}, the modes alternated round by round."""
    loaded = load_model(model)
    run(loaded, rows[0], 8, second_team=False)           # warm-up
    results = {n: {mode: [] for mode in MODES} for n in rows}
    for round_ in range(rounds):
        order = MODES if round_ % 2 == 0 else MODES[::-1]
        for n in rows:
            for mode in order:
                results[n][mode].append(run(loaded, n, output_tokens, second_team=mode == "two teams"))
    return results


def path_results(model: str, torch_ops: bool, args) -> dict:
    """`measure` in a process of its own: the kernels' switch is read when a model is loaded."""
    env = dict(os.environ, BATCHTOP_CPU_KERNEL="0" if torch_ops else "1")
    out = subprocess.run([sys.executable, "-m", "batchtop.engine.bench.openmp_teams", "--measure", model,
                          "--rows", args.rows, "--rounds", str(args.rounds), "--output", str(args.output)],
                         env=env, capture_output=True, text=True, check=True).stdout
    return {int(n): modes for n, modes in json.loads(out.splitlines()[-1]).items()}


def span(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}" if len(values) > 1 else f"{values[0]:.2f}"


def table(results: dict) -> list[str]:
    lines = ["| rows | one team: ms a step | two teams: ms a step | two / one (medians) "
             "| sleeps a step: one | two |", "|---:|---:|---:|---:|---:|---:|"]
    for n, modes in sorted(results.items()):
        one = [ms for ms, _ in modes["one team"]]
        two = [ms for ms, _ in modes["two teams"]]
        one_sleeps = statistics.median(s for _, s in modes["one team"])
        two_sleeps = statistics.median(s for _, s in modes["two teams"])
        ratio = statistics.median(two) / statistics.median(one)
        verdict = "" if min(two) > max(one) or max(two) < min(one) else " (ranges overlap)"
        lines.append(f"| {n} | {span(one)} | {span(two)} | {ratio:.2f}{verdict} | {one_sleeps:.1f} | "
                     f"{two_sleeps:.1f} |")
    return lines


def section(all_results: dict, args, at: str) -> str:
    command = (f"python -m batchtop.engine.bench.openmp_teams --models {args.models} --rows {args.rows} "
               f"--rounds {args.rounds} --output {args.output}")
    lines = [SECTION, "",
             f"`{command}` (written by it), commit {at}, {time.strftime('%Y-%m-%d')}, {cpu_name()}, "
             f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end.", "",
             "The engine steps on its own thread; the model is loaded (and the engine built) on another. "
             "torch's OpenMP runtime (libgomp) keeps a team of workers for each thread that ran a parallel "
             "region, and once the process holds more of them than it has CPUs its workers sleep between "
             "regions instead of spinning, so every region of a step pays a wake-up. The building thread "
             "(as Engine's construction ends) and the starting one (EngineLoop.start) give their workers "
             "back: "
             "`one team`, the engine as it runs; `two teams` is the same after one parallel torch op on the "
             "starting thread, what a process gets when the thread that loaded the model keeps its workers. "
             f"Each row count: that many requests of {PROMPT_TOKENS} prompt and {args.output} output tokens "
             f"at once, the modes alternated {args.rounds} times; a step's time is the median of the steps "
             "where every row decodes, as a range over the rounds; sleeps are the process's voluntary "
             "context switches per step.", ""]
    for (model, path), results in all_results.items():
        lines += [f"{model}, {path}:", "", *table(results), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchtop.engine.bench.openmp_teams",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=int, default=100, help="output tokens of each request")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    parser.add_argument("--measure", metavar="MODEL", help=argparse.SUPPRESS)   # one process's part
    args = parser.parse_args(argv)
    rows = [int(n) for n in args.rows.split(",")]
    if args.measure:
        print(json.dumps(measure(args.measure, rows, args.rounds, args.output)))
        return 0
    at = commit()
    all_results = {}
    for model in args.models.split(","):
        for path, torch_ops in (("C++ kernels", False), ("torch ops (BATCHTOP_CPU_KERNEL=0)", True)):
            all_results[(model, path)] = path_results(model, torch_ops, args)
            print(model, path, all_results[(model, path)], flush=True)
    return publish(SECTION, section(all_results, args, at), write=not args.no_write)


if __name__ == "__main__":
    raise SystemExit(main())
