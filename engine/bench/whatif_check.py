"""What-if predictions against real runs: one fixed Poisson trace recorded at one max_num_seqs, predicted
at others (and at another token budget), then each of those run for real on the same trace, several
times, in this process (the embedded engine, EOS ignored so output lengths are fixed). Writes its
section of docs/whatif.md.

    python -m batchtop.engine.bench.whatif_check --requests 300 --repeats 3 --write
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from datetime import date
from pathlib import Path

from batchtop.engine.core.config import EngineConfig
from batchtop.engine.core.engine import Engine
from batchtop.engine.core.loop import EngineLoop
from batchtop.engine.model.loading import load_model
from batchtop.engine.whatif.grid import predict, run_of
from batchtop.engine.whatif.recording import engine_header, recording_from
from batchtop.engine.whatif.replay import fit_steps, replay_identity
from batchtop.engine.workload.arrivals import TraceItem, TraceLoad
from batchtop.telemetry.recorder import make_header

from .figures import commit, cpu_name, write_section

DOC = Path(__file__).resolve().parents[2] / "docs" / "whatif.md"
SECTION = "## Predicted against measured: batchtop's engine"
# metric, row key, target relative error (None: absolute, preemptions within +-10% or +-5)
METRICS = (("TTFT p50", "ttft_p50_s", 0.10), ("TTFT p99", "ttft_p99_s", 0.15),
           ("ITL p50", "itl_p50_s", 0.10), ("output tok/s", "output_tok_s", 0.05),
           ("preemptions", "preemptions", None))


def make_trace(num_requests: int, rate: float, seed: int) -> list[TraceItem]:
    rng = random.Random(seed)
    t, items = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        prompt_tokens = max(1, min(256, int(rng.expovariate(1 / 48))))
        items.append(TraceItem(round(t, 4), max(1, min(128, int(rng.expovariate(1 / 24)))), prompt_tokens))
    return items


def run_real(loaded, trace: list[TraceItem], **config) -> tuple[dict, list]:
    """The trace through the embedded engine at `config`: (header, events)."""
    events: list = []
    engine = Engine(EngineConfig(model="tiny", flight_recorder_steps=0, **config), sink=events.append,
                    loaded=loaded)
    header = make_header("tiny", engine.knobs(),
                         engine=engine_header(engine.config, engine.kv.num_blocks, engine.max_model_len))
    load = TraceLoad(list(trace))
    loop = EngineLoop(engine, load=load).start()
    while loop.running and not (load.exhausted and not loop.call(engine.has_unfinished)):
        time.sleep(0.05)
    loop.stop()
    if loop.error is not None:
        raise loop.error
    return header, events


def error(predicted, measured) -> float | None:
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals per second")
    parser.add_argument("--recorded", type=int, default=4, help="max_num_seqs of the recording")
    parser.add_argument("--values", default="2,8,16,32", help="max_num_seqs values predicted and run")
    parser.add_argument("--budget", type=int, default=64, help="a token budget predicted and run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=25)
    parser.add_argument("--json", help="also write the raw points here")
    parser.add_argument("--write", action="store_true", help="write the section of docs/whatif.md")
    args = parser.parse_args(argv)
    started = time.time()
    loaded = load_model("tiny")
    trace = make_trace(args.requests, args.rate, args.seed)
    base = {"max_num_seqs": args.recorded}
    header, events = run_real(loaded, trace, **base)
    rec = recording_from(header, events, f"max_num_seqs={args.recorded}")
    identity = replay_identity(rec)
    model = fit_steps(rec, identity)
    points = [{"max_num_seqs": v} for v in map(int, args.values.split(","))]
    points.append({"max_num_batched_tokens": args.budget})
    results = []
    for changed in points:
        began = time.perf_counter()
        predicted = predict(rec, model, changed)
        compute_s = time.perf_counter() - began
        measured = [run_of("measured", changed, run_real(loaded, trace, **{**base, **changed})[1]).row()
                    for _ in range(args.repeats)]
        results.append({"knobs": changed, "predicted": predicted.row(), "measured": measured,
                        "compute_s": compute_s, "extrapolation": predicted.extrapolation})
        print(json.dumps({"knobs": changed, "predicted_tok_s": predicted.row()["output_tok_s"],
                          "measured_tok_s": [m["output_tok_s"] for m in measured]}), flush=True)
    text = report(args, rec, identity, model, results, time.time() - started)
    if args.json:
        Path(args.json).write_text(json.dumps(results, default=str))
    print(text)
    if args.write:
        write_section(SECTION, text, DOC)
    return 0


def report(args, rec, identity, model, results, seconds: float) -> str:
    recorded = run_of("recorded", {}, rec.events).row()
    lines = [SECTION, "",
             f"{date.today().isoformat()}, commit {commit()}, {cpu_name()}, tiny model, torch ops "
             f"(`BATCHTOP_CPU_KERNEL=0`), a machine shared with other work. Command: "
             f"`python -m batchtop.engine.bench.whatif_check --requests {args.requests} --rate {args.rate:g} "
             f"--recorded {args.recorded} --values {args.values} --budget {args.budget} "
             f"--repeats {args.repeats} --write` ({seconds / 60:.0f} min).", "",
             f"Trace: {args.requests} Poisson requests at {args.rate:g}/s (seed {args.seed}), prompts and "
             f"outputs exponential (means 48 and 24 tokens), EOS ignored. Recorded at "
             f"max_num_seqs={args.recorded}: "
             f"{recorded['steps']} steps over {rec.wall_s:.1f} s; identity replay {identity.num_matching} of "
             f"{identity.num_steps} steps as recorded. Step-time fit: {model.forward.name} law, "
             f"held-out MAPE "
             f"{model.forward.heldout_mape:.1%}, times the recorded slowdown (mean "
             f"{model.mean_slowdown:.2f}x).", "",
             "Each point: predicted by `whatif` from the recording, then run for real "
             f"{args.repeats} times on the same trace; measured is the median, spread the range "
             "(max - min) / median; error = (predicted - median) / median. Targets: TTFT p50 10%, p99 15%, "
             "ITL p50 10%, throughput 5%, preemptions +-10% or +-5.", "",
             "| knobs | metric | predicted | measured (median) | spread | error | target |",
             "|---|---|---|---|---|---|---|"]
    for point in results:
        knobs = ", ".join(f"{k}={v}" for k, v in point["knobs"].items())
        for label, key, target in METRICS:
            values = [m[key] for m in point["measured"] if m[key] is not None]
            median = statistics.median(values) if values else None
            spread = (max(values) - min(values)) / median if values and median else None
            predicted = point["predicted"][key]
            if target is None:
                ok = median is not None and abs(predicted - median) <= max(5, 0.1 * median)
                err_text = f"{predicted - median:+.0f}" if median is not None else "-"
                target_text = "+-10% or +-5"
            else:
                err = error(predicted, median)
                ok = err is not None and abs(err) <= target
                err_text = f"{err:+.0%}" if err is not None else "-"
                target_text = f"{target:.0%}" + (" (spread wider)" if spread and spread > target else "")
            lines.append(f"| {knobs} | {label} | {_fmt(predicted, key)} | {_fmt(median, key)} | "
                         f"{_fmt_share(spread)} | {err_text} {'ok' if ok else 'missed'} | {target_text} |")
    speed = [p["compute_s"] for p in results]
    lines += ["", f"What-if compute time per point: {min(speed):.2f}-{max(speed):.2f} s for {args.requests} "
                  f"requests, against {rec.wall_s:.1f} s recorded."]
    return "\n".join(lines)


def _fmt(value, key: str) -> str:
    if value is None:
        return "-"
    if key.endswith("_s") and key != "output_tok_s":
        return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def _fmt_share(value) -> str:
    return "-" if value is None else f"{value:.0%}"


if __name__ == "__main__":
    raise SystemExit(main())
