"""What the always-on flight recorder costs: per event at its sink, and per step on a whole engine.

    python -m batchtop.engine.bench.flight [--rounds 7] [--repeat 15] [--no-write]

Per event: telemetry.bench's `measure_flight` (the flight recorder's sinks beside the ones it
wraps, interleaved round by round). Per step: two engines on one loaded tiny model, one without
the flight recorder (`flight_recorder_steps=0` and no sink, so no event is even built) and one
with it (the default), each running the same 32 requests of 60 prompt and 60 output tokens,
alternated `rounds` times; the best of each in thread CPU time per step. Writes its section of
docs/reliability.md (unless --no-write).
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from batchtop.engine.core.config import EngineConfig
from batchtop.engine.core.engine import Engine
from batchtop.engine.core.sampling import SamplingParams
from batchtop.engine.model.loading import load_model
from batchtop.telemetry.bench import measure_flight

from .figures import RELIABILITY, commit, cpu_name, publish

SECTION = "## Flight recorder: cost"
NUM_ROWS, NUM_TOKENS = 32, 60


def step_cpu_us(loaded, flight: bool, num_rows: int = NUM_ROWS, num_tokens: int = NUM_TOKENS) -> float:
    """Thread CPU time per step, in µs, of one engine running `num_rows` requests to their end."""
    off = {} if flight else {"flight_recorder_steps": 0}
    engine = Engine(EngineConfig(model=loaded.name, max_num_seqs=num_rows, max_num_batched_tokens=4096,
                                 num_threads=1, **off), loaded=loaded)
    params = SamplingParams(max_tokens=num_tokens, ignore_eos=True)
    for i in range(num_rows):
        engine.add_request([1 + (i * 7 + j) % 500 for j in range(num_tokens)], params)
    start = time.thread_time_ns()
    while engine.has_unfinished():
        engine.step()
    return (time.thread_time_ns() - start) / 1e3 / engine.step_count


def measure_engine(rounds: int) -> dict[str, float]:
    """Best thread CPU µs per step of each engine, the two alternated round by round."""
    loaded = load_model("tiny")
    threads = torch.get_num_threads()
    best = {"off": float("inf"), "on": float("inf")}
    try:
        for _ in range(rounds):
            for mode in best:
                best[mode] = min(best[mode], step_cpu_us(loaded, flight=mode == "on"))
    finally:
        torch.set_num_threads(threads)
    return best


def section(per_event: list[tuple[str, float]], per_step: dict[str, float], args, at: str) -> str:
    command = f"python -m batchtop.engine.bench.flight --rounds {args.rounds} --repeat {args.repeat}"
    off, on = per_step["off"], per_step["on"]
    lines = [SECTION, "",
             f"`{command}` (written by it), commit {at}, {time.strftime('%Y-%m-%d')}, {cpu_name()}, "
             f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end.", "",
             f"Per event at the sink (best of {args.repeat} interleaved rounds, thread CPU time):", "",
             "| sink | ns per event |", "|---|---:|",
             *[f"| {name} | {ns:.0f} |" for name, ns in per_event], "",
             f"Per step on the engine: {NUM_ROWS} requests of the tiny model, {NUM_TOKENS} prompt and "
             f"{NUM_TOKENS} output tokens each, the two engines alternated {args.rounds} times, best of "
             "each in thread CPU time per step:", "",
             "| engine | µs per step |", "|---|---:|",
             f"| without the flight recorder (`flight_recorder_steps=0`, no sink: no event built) "
             f"| {off:.0f} |",
             f"| with it (the default) | {on:.0f} |",
             f"| with / without | {on / off:.3f} |", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchtop.engine.bench.flight",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="engine runs of each kind, alternated")
    parser.add_argument("--repeat", type=int, default=15, help="rounds of the per-event sinks")
    parser.add_argument("--no-write", action="store_true", help="print; leave docs/reliability.md")
    args = parser.parse_args(argv)
    at = commit()                               # the code the figures come from: HEAD as the run starts
    per_event = measure_flight(repeat=args.repeat)
    per_step = measure_engine(args.rounds)
    text = section(per_event, per_step, args, at)
    return publish(SECTION, text, write=not args.no_write, doc=RELIABILITY)


if __name__ == "__main__":
    raise SystemExit(main())
