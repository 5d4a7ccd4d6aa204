"""What-if predictions against real runs: one fixed Poisson trace recorded at one max_num_seqs, predicted
at others (and at another token budget), then each of those run for real on the same trace, several
times, in this process (the embedded engine, EOS ignored so output lengths are fixed). Writes its
section of docs/whatif.md.

    python -m batchtop.engine.bench.whatif_check --requests 300 --repeats 3 --write

A first run of the trace is thrown away (the process's torch ops warming up for new shapes). Each
round records the trace afresh and runs every point once (alternating the order), so each
prediction is checked against runs made minutes after its recording; the real runs' own spread is
reported beside the error and a verdict given only where the error exceeds it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shlex
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
from batchtop.kernels import cpu
from batchtop.telemetry.recorder import make_header, write_log

from .figures import commit, cpu_name, publish

DOC = Path(__file__).resolve().parents[2] / "docs" / "whatif.md"
SECTION = "## Predicted against measured: batchtop's engine"
# metric, row key, target relative error (None: absolute, preemptions within +-10% or +-5)
METRICS = (("TTFT p50", "ttft_p50_s", 0.10), ("TTFT p99", "ttft_p99_s", 0.15),
           ("ITL p50", "itl_p50_s", 0.10), ("output tok/s", "output_tok_s", 0.05),
           ("preemptions", "preemptions", None))
# with shared prefixes: the prefix cache's share of the tokens admissions looked up (the issue sets no
# target for it; 5% here)
PREFIX_METRIC = ("prefix hit share", "prefix_hit", 0.05)


MAX_PROMPT = 256            # the trace's longest prompt


def make_trace(num_requests: int, rate: float, seed: int, prompt_mean: int = 48, output_mean: int = 24,
               max_prompt: int = MAX_PROMPT, max_output: int = 128) -> list[TraceItem]:
    rng = random.Random(seed)
    t, items = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        prompt_tokens = max(1, min(max_prompt, int(rng.expovariate(1 / prompt_mean))))
        output_tokens = max(1, min(max_output, int(rng.expovariate(1 / output_mean))))
        items.append(TraceItem(round(t, 4), output_tokens, prompt_tokens))
    return items


def trace_of(args) -> list[TraceItem]:
    trace = make_trace(args.requests, args.rate, args.seed, args.prompt_mean, args.output_mean,
                       max_output=args.max_output)
    num_prefixes = getattr(args, "shared_prefixes", 0)
    if not num_prefixes:
        return trace
    rng = random.Random(args.seed + 1)
    prefixes = [tuple(rng.randrange(100, 5000) for _ in range(args.prefix_tokens))
                for _ in range(num_prefixes)]
    return [dataclasses.replace(item, prefix_ids=rng.choice(prefixes)) for item in trace]


def trace_words(args) -> str:
    words = (f"{args.requests} Poisson requests at {args.rate:g}/s (seed {args.seed}), prompts and outputs "
             f"exponential (means {args.prompt_mean} and {args.output_mean} tokens, at most {MAX_PROMPT} and "
             f"{args.max_output})")
    if getattr(args, "shared_prefixes", 0):
        words += (f", each prompt after one of {args.shared_prefixes} shared prefixes of "
                  f"{args.prefix_tokens} tokens (chosen at random)")
    return words


def trace_flags(args) -> str:
    """The trace's flags where they are not the defaults, for a report's command line."""
    return "".join(f"--{name.replace('_', '-')} {value} " for name, value, default in (
        ("prompt_mean", args.prompt_mean, 48), ("output_mean", args.output_mean, 24),
        ("max_output", args.max_output, 128)) if value != default)


class LoadWatch:
    """The machine's 1-minute load average, read at every real run's start and end: a report says how
    busy the machine was instead of assuming."""

    def __init__(self):
        self.readings: list[float] = []

    def read(self) -> None:
        self.readings.append(os.getloadavg()[0])

    def words(self) -> str:
        if not self.readings:
            return "load average not read"
        return (f"load average {min(self.readings):.1f}-{max(self.readings):.1f} over the real runs "
                f"({os.cpu_count()} CPUs)")


def run_real(loaded, trace: list[TraceItem], model: str = "tiny", **config) -> tuple[dict, list]:
    """The trace through the embedded engine (`loaded`, the `model` named) at `config`: (header, events).
    No prefix caching, as in the published runs: the trace's prompts are random and share no block
    (a request recomputed after a preemption would hit its own blocks)."""
    events: list = []
    config = EngineConfig(model=model, flight_recorder_steps=0, **{"enable_prefix_caching": False, **config})
    engine = Engine(config, sink=events.append, loaded=loaded)
    header = make_header(model, engine.knobs(),
                         engine=engine_header(engine))
    loop = EngineLoop(engine, load=TraceLoad(list(trace))).start()
    while loop.running and not loop.served_load():
        time.sleep(0.05)
    loop.stop()
    if loop.error is not None:
        raise loop.error
    return header, events


def error(predicted, measured) -> float | None:
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def check_parser(description: str, rate: float) -> argparse.ArgumentParser:
    """The flags every predicted-against-measured check takes: the trace, the points, the rounds."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rate", type=float, default=rate, help="Poisson arrivals per second")
    parser.add_argument("--recorded", type=int, default=4, help="max_num_seqs of the recording")
    parser.add_argument("--values", default="2,8,16,32", help="max_num_seqs values predicted and run")
    parser.add_argument("--budget", type=int, default=64, help="a token budget predicted and run")
    parser.add_argument("--repeats", type=int, default=3, help="rounds: a recording, then each point once")
    parser.add_argument("--seed", type=int, default=25)
    parser.add_argument("--prompt-mean", type=int, default=48,
                        help=f"mean prompt tokens (at most {MAX_PROMPT})")
    parser.add_argument("--output-mean", type=int, default=24, help="mean output tokens")
    parser.add_argument("--max-output", type=int, default=128,
                        help="longest output (long ones fill a small pool: preemptions)")
    parser.add_argument("--label", help="words after the section's title, for a check beside the published "
                                        "one (another rate): its own section")
    return parser


def labelled(title: str, args) -> str:
    """The section's title with the check's --label after it."""
    return title + (f", {args.label}" if getattr(args, "label", None) else "")


def label_flag(args) -> str:
    """--label as the section's command line gives it."""
    return f"--label {shlex.quote(args.label)} " if getattr(args, "label", None) else ""


def main(argv: list[str] | None = None) -> int:
    parser = check_parser(__doc__.splitlines()[0], rate=8.0)
    parser.add_argument("--num-kv-blocks", type=int, help="the KV pool in blocks of 16 (small: preemptions)")
    parser.add_argument("--json", help="also write the raw points here")
    parser.add_argument("--out", metavar="DIR", help="also write each round's recording and each real run as "
                                                     "recordings here (for batchtop whatif / diff)")
    parser.add_argument("--write", action="store_true", help="write the section of docs/whatif.md")
    parser.add_argument("--shared-prefixes", type=int, default=0,
                        help="each prompt after one of N shared prefixes, prefix caching on (0: none, off)")
    parser.add_argument("--prefix-tokens", type=int, default=64, help="the shared prefixes' length")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    loaded = load_model("tiny")
    trace = trace_of(args)
    load = LoadWatch()
    base = {"max_num_seqs": args.recorded, "enable_prefix_caching": args.shared_prefixes > 0}
    if args.num_kv_blocks:
        base["num_kv_blocks"] = args.num_kv_blocks
    points = [{"max_num_seqs": v} for v in map(int, args.values.split(","))]
    points.append({"max_num_batched_tokens": args.budget})
    results = [{"knobs": changed, "predicted": [], "measured": [], "compute_s": []} for changed in points]
    rounds = []
    # a first run of the trace, thrown away: torch's ops warm up for the process's first shapes
    # (a first round recorded cold ran at two thirds of the later rounds' throughput)
    run_real(loaded, trace, **base)
    for r in range(args.repeats):
        # each round records afresh and runs every point once, in alternating order, so a prediction
        # and the runs it is checked against are minutes apart on a machine whose load drifts
        load.read()
        header, events = run_real(loaded, trace, **base)
        load.read()
        if out:
            write_log(out / f"round{r + 1}-recorded.jsonl", header, events)
        rec = recording_from(header, events, f"max_num_seqs={args.recorded}")
        identity = replay_identity(rec)
        model = fit_steps(rec, identity)
        rounds.append(round_summary(rec, identity, model))
        if out:
            rounds[-1]["path"] = str(out / f"round{r + 1}-recorded.jsonl")
        order = list(enumerate(points))
        for i, changed in order[::-1] if r % 2 else order:
            began = time.perf_counter()
            predicted = predict(rec, model, changed)
            results[i]["compute_s"].append(time.perf_counter() - began)
            results[i]["predicted"].append(predicted.row())
            load.read()
            header, events = run_real(loaded, trace, **{**base, **changed})
            results[i]["measured"].append(run_of("measured", changed, events).row())
            load.read()
            if out:
                write_log(out / f"round{r + 1}-{point_name(changed)}.jsonl", header, events)
            print(json.dumps({"round": r, "knobs": changed,
                              "predicted_tok_s": predicted.row()["output_tok_s"],
                              "measured_tok_s": results[i]["measured"][-1]["output_tok_s"]}), flush=True)
    text = report(args, rounds, results, time.time() - started, load)
    if args.json:
        Path(args.json).write_text(json.dumps({"section": section(args), "commit": commit(),
                                               "rounds": rounds, "points": results}, default=str))
    return publish(section(args), text, write=args.write, doc=DOC)


def section(args) -> str:
    """The section of the engine's path (its step cost in rows differs: docs/whatif.md), pool and
    prompts."""
    return labelled(SECTION + ("" if cpu.available() else ", torch ops")
                    + (f", a pool of {args.num_kv_blocks} blocks" if args.num_kv_blocks else "")
                    + (", shared prefixes" if getattr(args, "shared_prefixes", 0) else ""), args)


def point_name(knobs: dict) -> str:
    """A point's part of its real runs' file names (round1-max_num_seqs=8.jsonl)."""
    return "-".join(f"{k}={v}" for k, v in knobs.items())


def round_summary(rec, identity, model) -> dict:
    row = run_of("recorded", {}, rec.events).row()
    return {"steps": row["steps"], "wall_s": rec.wall_s, "matching": identity.num_matching,
            "identity_steps": identity.num_steps, "law": model.forward.name,
            "mape": model.forward.heldout_mape, "slowdown": model.mean_slowdown, "gap_s": model.gap_s,
            "gap": model.gap.describe(), "output_tok_s": row["output_tok_s"], "ttft_p50_s": row["ttft_p50_s"]}


def spread(values: list) -> float | None:
    """(max - min) / median of a point's runs."""
    if not values:
        return None
    median = statistics.median(values)
    return (max(values) - min(values)) / median if median else None


def verdict(err: float | None, measured_spread: float | None, target: float) -> str:
    """A verdict only where the error exceeds the real runs' own spread."""
    if err is None:
        return "-"
    if measured_spread is not None and abs(err) <= measured_spread:
        return "within spread"
    return "ok" if abs(err) <= target else "missed"


def report(args, rounds: list[dict], results: list[dict], seconds: float, load: LoadWatch) -> str:
    pool = f", a pool of {args.num_kv_blocks} blocks of 16 tokens" if args.num_kv_blocks else ""
    kernels_off = "" if cpu.available() else "BATCHTOP_CPU_KERNEL=0 "
    command = (f"`{kernels_off}python -m batchtop.engine.bench.whatif_check "
               f"--requests {args.requests} --rate {args.rate:g} --recorded {args.recorded} "
               f"--values {args.values} --budget {args.budget} "
               + (f"--num-kv-blocks {args.num_kv_blocks} " if args.num_kv_blocks else "")
               + (f"--shared-prefixes {args.shared_prefixes} --prefix-tokens {args.prefix_tokens} "
                  if args.shared_prefixes else "")
               + trace_flags(args) + f"--repeats {args.repeats} {label_flag(args)}--write`")
    lines = [section(args), "",
             f"{date.today().isoformat()}, commit {commit()}, {cpu_name()}, tiny model, {kernels_words()}, "
             f"{load.words()}. Command: {command} "
             f"({seconds / 60:.0f} min).", "",
             f"Trace: {trace_words(args)}, EOS ignored, "
             f"{'prefix caching on' if args.shared_prefixes else 'no prefix caching'}{pool}. "
             "One run of the trace thrown away first (the process warming up), then "
             f"{args.repeats} rounds, each: "
             f"the trace recorded at max_num_seqs={args.recorded}, every point predicted from that "
             "recording by `whatif` and then run once for real (the points in alternating order from "
             "round to round). The recordings:", "", *recordings_table(rounds), "",
             *comparison_table(results, METRICS + ((PREFIX_METRIC,) if args.shared_prefixes else ()))]
    speed = [s for p in results for s in p["compute_s"]]
    wall = [r["wall_s"] for r in rounds]
    lines += ["", f"What-if compute time per point: {min(speed):.2f}-{max(speed):.2f} s for {args.requests} "
                  f"requests, against {min(wall):.1f}-{max(wall):.1f} s recorded."]
    return "\n".join(lines)


def kernels_words() -> str:
    if cpu.available():
        return "the C++ CPU kernels"
    return f"torch ops (the C++ kernels off: {cpu.unavailable_reason()})"


def recordings_table(rounds: list[dict]) -> list[str]:
    """A line per round's recording (`round_summary`): its steps, identity replay and step-time fit."""
    lines = ["| round | steps | recorded | identity replay | law | held-out MAPE | mean slowdown | gap law "
             "| output tok/s | TTFT p50 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rounds, 1):
        lines.append(f"| {i} | {r['steps']} | {r['wall_s']:.1f} s | {r['matching']} of {r['identity_steps']} "
                     f"| {r['law']} | {r['mape']:.1%} | {r['slowdown']:.2f}x | {r['gap']} "
                     f"| {r['output_tok_s']:.1f} | {format_value(r['ttft_p50_s'], 'ttft_p50_s')} |")
    return lines


def comparison_table(results: list[dict], metrics=METRICS) -> list[str]:
    """Each point's predicted and measured rows (row keys of `metrics`, one dict a run) as the check's
    table: medians, spreads, the error and its verdict."""
    lines = ["Predicted and measured: the median over the rounds, spread the range (max - min) / "
             "median; error = (predicted - measured) / measured, medians. A verdict only where the "
             "error is larger than the measured runs' own spread (else: within spread). Targets: "
             "TTFT p50 10%, p99 15%, ITL p50 10%, throughput 5%, preemptions +-10% or +-5"
             + ("; prefix hit share 5% (set here: the issue sets none)" if PREFIX_METRIC in metrics else "")
             + ".", "",
             "| knobs | metric | predicted | its spread | measured | its spread | error | verdict "
             "| target |",
             "|---|---|---|---|---|---|---|---|---|"]
    for point in results:
        knobs = ", ".join(f"{k}={v}" for k, v in point["knobs"].items())
        for label, key, target in metrics:
            predicted = [p[key] for p in point["predicted"] if p.get(key) is not None]
            measured = [m[key] for m in point["measured"] if m.get(key) is not None]
            p_median = statistics.median(predicted) if predicted else None
            m_median = statistics.median(measured) if measured else None
            if target is None:
                if p_median is None or m_median is None:
                    continue
                diff = p_median - m_median
                allowed = max(5, 0.1 * m_median)
                width = max(measured) - min(measured)
                word = "within spread" if abs(diff) <= width and width else (
                    "ok" if abs(diff) <= allowed else "missed")
                lines.append(f"| {knobs} | {label} | {p_median:g} | {max(predicted) - min(predicted):g} | "
                             f"{m_median:g} | {width:g} | {diff:+.0f} | {word} | +-10% or +-5 |")
                continue
            err = error(p_median, m_median)
            m_spread = spread(measured)
            lines.append(f"| {knobs} | {label} | {format_value(p_median, key)} | "
                         f"{_fmt_share(spread(predicted))} | {format_value(m_median, key)} | "
                         f"{_fmt_share(m_spread)} | "
                         f"{'-' if err is None else f'{err:+.0%}'} | {verdict(err, m_spread, target)} | "
                         f"{target:.0%} |")
    return lines + ["", *caveat_lines(results)]


def caveat_lines(results: list[dict]) -> list[str]:
    """Each point's predictions the what-if marked "extrapolated" (steps beyond the recorded shapes, or at
    row counts the recording ran seldom or at few moments), with the first such round's words."""
    lines = []
    for point in results:
        flagged = [(k, row["extrapolated"]) for k, row in enumerate(point["predicted"], 1)
                   if row.get("extrapolated")]
        if flagged:
            knobs = ", ".join(f"{k}={v}" for k, v in point["knobs"].items())
            rounds = ", ".join(str(k) for k, _ in flagged)
            lines.append(f"- {knobs} (round {rounds} of {len(point['predicted'])}): round {flagged[0][0]}: "
                         f"{flagged[0][1]}")
    if not lines:
        return ["No prediction was marked extrapolated: every point ran within its recording's shapes, at "
                "row counts the recording ran often and at many moments."]
    return ["The what-if's own caveats, as it printed them beside each prediction:", "", *lines]


def format_value(value, key: str) -> str:
    if value is None:
        return "-"
    if key == "prefix_hit":
        return f"{value:.1%}"
    if key.endswith("_s") and key != "output_tok_s":
        return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def _fmt_share(value) -> str:
    return "-" if value is None else f"{value:.0%}"


if __name__ == "__main__":
    raise SystemExit(main())
