"""A slow moment at a recording's end, where an overloaded trace runs its only narrow steps: offline.

The serve check's what-if at max_num_seqs=2, from recordings at 4, missed throughput by -17% and ITL p50
by +21% (docs/whatif.md): under a queue a recording at 4 rows runs fewer rows only as it drains, and
there the machine was slow. This reproduces it on a known law, with no machine in the figures: the
virtual engine records the check's trace at max_num_seqs=4, each step's forward time from a staircase
law (SmolLM2-135M's products on the AVX2 host, 1.5 times: a price per tile of 4 rows and per row, 8.2-
14.0 ms at 1-4 decode rows, 19.6 at 5) times a load that moves in 1 s segments (lognormal, sigma 0.12)
and per-step noise (sigma 0.08); with `--slow F`, the recording's last 0.6 s run F times slower. The
recording is fitted and predicted at 2, 4 and 8 rows as `batchtop whatif` does; the truth is the same
trace run by the virtual engine at 2, 4 and 8 on the same law and load, without the slow moment. Rates
are given against the recording's capacity (its output tok/s at the highest rate, in requests a second).

    python -m batchtop.engine.bench.whatif_slow_drain --rates 5,3.5,3,2.5 --seeds 5 --write
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import random
import statistics
from datetime import date

from batchtop.engine.core.config import SchedulerKnobs
from batchtop.engine.whatif.grid import predict, prepare, run_of
from batchtop.engine.whatif.recording import EngineSetup, Recording, TraceRequest, recording_from
from batchtop.engine.whatif.replay import run_whatif
from batchtop.engine.whatif.virtual import PhaseTimes, StepShape
from batchtop.telemetry.recorder import make_header

from .figures import commit, cpu_name, publish
from .whatif_check import DOC, make_trace

SECTION = "## A slow moment at the recording's end, offline"
SMOLLM2_MACS = (106_168_320, 28_311_552)     # weights.weight_macs of its config: per token, per head row
TILE_ROWS = 4
LAW_SCALE = 1.5
SEGMENT_S, SEGMENT_SIGMA, STEP_SIGMA = 1.0, 0.12, 0.08
SLOW_LAST_S = 0.6
ROWS = (2, 4, 8)
METRICS = (("output_tok_s", "tok/s"), ("itl_p50_s", "ITL p50"), ("ttft_p50_s", "TTFT p50"))
KNOBS = dataclasses.asdict(SchedulerKnobs(max_num_seqs=4, max_num_batched_tokens=2048))   # the rest: defaults


def staircase_law(seed: int, slow_after_s: float | None = None, slow: float = 1.0):
    """Step phases from the known law, the seed's load segments and noise; past `slow_after_s`, `slow`
    times slower."""
    rng = random.Random(seed)
    segments = [math.exp(rng.gauss(0, SEGMENT_SIGMA)) for _ in range(4000)]
    noise = random.Random(seed + 1)

    def law(shape: StepShape) -> PhaseTimes:
        tokens = shape.prefill_tokens + shape.decode_rows
        ms = (2.5 + 3.0 * math.ceil(tokens / TILE_ROWS) + 0.8 * math.ceil(shape.head_rows / TILE_ROWS)
              + 1.39 * tokens + 0.51 * shape.head_rows + 1e-3 * shape.context_tokens)
        load = segments[min(int(shape.start_s / SEGMENT_S), len(segments) - 1)]
        if slow_after_s is not None and shape.start_s > slow_after_s:
            load *= slow
        forward = LAW_SCALE * ms * 1e-3 * load * math.exp(noise.gauss(0, STEP_SIGMA))
        return PhaseTimes(3e-4, 1e-3 + 1e-4 * shape.num_rows, forward, 5e-4, 3e-4)
    return law


def loop_gap(num_arrived: int, num_retired: int) -> float:
    return 1.2e-3 + 5e-5 * num_arrived + 6e-4 * num_retired      # the serve check's recorded gap laws


def bare_trace(args, rate: float) -> Recording:
    items = make_trace(args.requests, rate, args.seed, args.prompt_mean, args.output_mean)
    requests = [TraceRequest(f"r{i}", item.arrival_s, item.prompt_tokens, item.output_tokens, 0,
                             item.output_tokens, "length", None) for i, item in enumerate(items)]
    setup = EngineSetup(4096, 16, "fcfs", "condense", 256, 2048, KNOBS, weight_macs=SMOLLM2_MACS,
                        product_tile_rows=TILE_ROWS)
    return Recording("<trace>", {}, [], 0.0, requests, setup)


def one_seed(bare: Recording, seed: int, slow: float) -> dict:
    """The recording's own figures and, per row count, (predicted, true) of each metric."""
    _, events = run_whatif(bare, KNOBS, staircase_law(seed), gap=loop_gap)
    if slow != 1.0:
        end = max(e.t for e in events)
        _, events = run_whatif(bare, KNOBS, staircase_law(seed, end - SLOW_LAST_S, slow), gap=loop_gap)
    rec = recording_from(make_header("synthetic", KNOBS, engine=bare.setup.to_dict()), events, "<recorded>")
    _, model = prepare(rec)
    out = {"recorded": run_of("recorded", {}, events).row(), "law": model.forward.name}
    for rows in ROWS:
        predicted = predict(rec, model, {"max_num_seqs": rows}).row()
        _, truth = run_whatif(bare, {**KNOBS, "max_num_seqs": rows}, staircase_law(seed), gap=loop_gap)
        out[rows] = (predicted, run_of("truth", {}, truth).row())
    return out


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):+.1%} ({min(values):+.1%}..{max(values):+.1%})"


def report(args, results: dict) -> str:
    tok_s = max(r["recorded"]["output_tok_s"] for runs in results.values() for r in runs)
    capacity = tok_s / args.output_mean           # requests a second, at the most loaded recording
    command = (f"python -m batchtop.engine.bench.whatif_slow_drain --rates {args.rates} --seeds {args.seeds} "
               f"--slow {args.slow:g}")
    trace = (f"{args.requests} Poisson requests, seed {args.seed}, prompts and outputs exponential, means "
             f"{args.prompt_mean} and {args.output_mean}")
    lines = [SECTION, "",
             f"{date.today().isoformat()}, commit {commit()}, {cpu_name()}; no timing of this machine enters "
             f"the figures (the virtual engine on a known law). Command: `{command}`. The check's trace "
             f"({trace}) at each rate, recorded at max_num_seqs=4 on the module's law, with and without its "
             f"last {SLOW_LAST_S:g} s {args.slow:g}x slower; the recording's capacity {capacity:.2f} "
             f"requests/s. Error = predicted / true - 1, the median over {args.seeds} seeds (range).", "",
             "| rate (x capacity) | last 0.6 s | recorded TTFT p50 | rows | " +
             " | ".join(f"{name} error" for _, name in METRICS) + " |",
             "|---|---|---|---|" + "---|" * len(METRICS)]
    for (rate, slow), runs in results.items():
        recorded = statistics.median(r["recorded"]["ttft_p50_s"] for r in runs)
        for rows in ROWS:
            errors = [spread([r[rows][0][key] / r[rows][1][key] - 1 for r in runs]) for key, _ in METRICS]
            lines.append(f"| {rate:g}/s ({rate / capacity:.2f}x) | {slow:g}x | {recorded:.2f} s | {rows} | "
                         + " | ".join(errors) + " |")
    laws = sorted({r["law"] for runs in results.values() for r in runs})
    lines += ["", f"Law fitted on every recording: {', '.join(laws)}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="5,3.5,3,2.5", help="Poisson arrivals per second, each a trace")
    parser.add_argument("--seeds", type=int, default=5, help="law seeds (load and noise) per rate")
    parser.add_argument("--slow", type=float, default=1.3, help="the recording's last 0.6 s this much slower")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--seed", type=int, default=25, help="the trace's seed")
    parser.add_argument("--prompt-mean", type=int, default=16)
    parser.add_argument("--output-mean", type=int, default=48)
    parser.add_argument("--write", action="store_true", help="write the section of docs/whatif.md")
    args = parser.parse_args(argv)
    results = {}
    for rate in (float(r) for r in args.rates.split(",")):
        bare = bare_trace(args, rate)
        for slow in (1.0, args.slow):
            results[rate, slow] = [one_seed(bare, seed, slow) for seed in range(args.seeds)]
    return publish(SECTION, report(args, results), write=args.write, doc=DOC)


if __name__ == "__main__":
    raise SystemExit(main())
