"""How far a what-if's predictions move with the step time: each point of a finished check (whatif_check
with --out, whatif_serve, whatif_vllm) predicted again from the same recordings with every fitted
forward time scaled (0.9x to 1.2x, as `batchtop whatif --step-time` does), beside the measured runs and
how much slower or faster their steps ran than the recording's at the row counts the recording ran, and
than the law past them. Writes its section of docs/whatif.md.

    .venv/bin/python -m batchtop.engine.bench.whatif_sensitivity CHECK.json --write

CHECK.json: the check's `--json`; its `--out` folder must still hold the round recordings and the real
runs beside them (round1-max_num_seqs=8.jsonl, ...). A vLLM check's recordings are replayed and priced
through vLLM's scheduler in the harness (engine/whatif/vllm_replay.py), as `batchtop whatif` does.

A real run's step ratio: its decode-only steps' forward time against the recording's at the same row
count, each over the recording's law at the step's shape (so context and rows are the law's to carry),
on row counts the recording ran (so the ratio is the machine's, not the law's extrapolation). Past the
recorded rows, the ratio is the law's own error where a what-if extrapolates it (decode-only steps wider
than any the recording ran, over the law), and each point is predicted again with the forward time at
that ratio: what is left of the point's error then is not the step time's. A step's shape is what its
identity replay computed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
from datetime import date
from pathlib import Path

from batchtop.engine.whatif.grid import predict, prepare, run_label
from batchtop.engine.whatif.recording import Recording, read_recording
from batchtop.engine.whatif.replay import Identity, replay_identity
from batchtop.engine.whatif.steptime import StepTimeModel
from batchtop.engine.whatif.virtual import StepShape
from batchtop.engine.whatif.vllm_replay import (
    HarnessProcess,
    fit_through_harness,
    identity_through_harness,
    predict_through_harness,
    recorded_steps,
)
from batchtop.telemetry import events as ev

from . import whatif_vllm
from .figures import commit, cpu_name, publish
from .whatif_check import DOC, point_name
from .whatif_speed import median_range

CHECK_PREFIX = "## Predicted against measured: "           # the checks' sections
CHECKED = CHECK_PREFIX + "batchtop serve"                   # whatif_serve's
SCALES = (0.9, 1.0, 1.05, 1.1, 1.2)
MIN_RECORDED_STEPS = 20        # a row count the recording ran fewer times is not compared


Steps = list[tuple[StepShape, ev.StepFinished]]      # each recorded step's shape beside its timings


class BatchtopPricing:
    """A recording of batchtop's engine: its identity replay and its what-ifs in this process."""

    def fit(self, rec: Recording) -> tuple[StepTimeModel, Steps]:
        identity, model = prepare(rec)
        return model, batchtop_steps(rec, identity)

    def steps(self, rec: Recording) -> Steps:
        return batchtop_steps(rec, replay_identity(rec))

    def predict(self, rec: Recording, model: StepTimeModel, changed: dict, factor: float, seed: int) -> dict:
        """One what-if at `changed` with the forward at `factor` times the fit's (`whatif --step-time`),
        the law's per-step draw seeded with `seed`; the run's row."""
        return predict(rec, dataclasses.replace(model, seed=seed), changed, step_scale=factor).row()


class VllmPricing:
    """A recording made inside vLLM: the same through vLLM's scheduler in the harness."""

    def __init__(self, harness: HarnessProcess):
        self.harness = harness

    def fit(self, rec: Recording) -> tuple[StepTimeModel, Steps]:
        _, shapes = identity_through_harness(rec, self.harness)
        return fit_through_harness(rec, shapes), recorded_steps(rec, shapes)

    def steps(self, rec: Recording) -> Steps:
        return recorded_steps(rec, identity_through_harness(rec, self.harness)[1])

    def predict(self, rec: Recording, model: StepTimeModel, changed: dict, factor: float, seed: int) -> dict:
        return predict_through_harness(rec, dataclasses.replace(model, seed=seed), self.harness, changed,
                                       step_scale=factor).row()


def batchtop_steps(rec: Recording, identity: Identity) -> Steps:
    finished = {e.step: e for e in rec.steps}
    planned = [e.step for e in identity.events if isinstance(e, ev.StepPlanned)]
    return [(shape, finished[step]) for step, shape in zip(planned, identity.engine.shapes)
            if step in finished]


def decode_ratios(steps: Steps, model: StepTimeModel) -> dict[int, list[float]]:
    """Each decode-only step's forward time over the law's at its shape, by its row count."""
    ratios: dict[int, list[float]] = {}
    for shape, done in steps:
        if shape.prefill_tokens:
            continue
        law = model.forward.predict(shape)
        if law > 0:
            ratios.setdefault(shape.num_rows, []).append(done.forward_s / law)
    return ratios


def beyond_ratio(ratios: dict[int, list[float]], widest: int) -> float | None:
    """The law's error where a what-if extrapolates it: the median of `decode_ratios` over the steps
    wider than any the law's recording ran (`widest` rows; None: none)."""
    wider = [r for rows, values in ratios.items() if rows > widest for r in values]
    return statistics.median(wider) if wider else None


def step_ratio(real: dict[int, list[float]], recorded: dict[int, list[float]]) -> float | None:
    """How much longer the real run's decode steps took than the recording's at the same row count and
    context (each over the law at its shape): per row count the ratio of the medians, weighted by the
    real run's steps; row counts the recording ran fewer than MIN_RECORDED_STEPS times left out."""
    common = [rows for rows in real if len(recorded.get(rows, ())) >= MIN_RECORDED_STEPS]
    weight = sum(len(real[rows]) for rows in common)
    if not weight:
        return None
    return sum(len(real[rows]) * statistics.median(real[rows]) / statistics.median(recorded[rows])
               for rows in common) / weight


def analyse(saved: dict, scales: tuple[float, ...], seeds: int) -> dict:
    """Per point: the predictions at each scale (every round and seed), the measured runs' rows, and each
    real run's step ratio against its round's recording."""
    vllm = read_recording(saved["rounds"][0]["path"]).setup.vllm
    if vllm is None:
        return analyse_with(BatchtopPricing(), saved, scales, seeds)
    with HarnessProcess(vllm["version"]) as harness:
        return analyse_with(VllmPricing(harness), saved, scales, seeds)


def analyse_with(pricing, saved: dict, scales: tuple[float, ...], seeds: int) -> dict:
    points = [{"knobs": p["knobs"], "measured": p["measured"], "scaled": {f: [] for f in scales},
               "step_ratio": [], "beyond_ratio": [], "at_beyond_ratio": []} for p in saved["points"]]
    for i, summary in enumerate(saved["rounds"], 1):
        path = Path(summary["path"])
        rec = read_recording(str(path))
        model, steps = pricing.fit(rec)
        own = decode_ratios(steps, model)
        for point in points:
            for factor in scales:
                point["scaled"][factor] += [pricing.predict(rec, model, point["knobs"], factor, seed)
                                            for seed in range(seeds)]
            real_path = path.with_name(f"round{i}-{point_name(point['knobs'])}.jsonl")
            if not real_path.exists():
                continue
            real = decode_ratios(pricing.steps(read_recording(str(real_path))), model)
            ratio = step_ratio(real, own)
            if ratio is not None:
                point["step_ratio"].append(ratio)
            beyond = beyond_ratio(real, model.seen["num_rows"])
            if beyond is not None:            # the point predicted again with the law off by as much
                point["beyond_ratio"].append(beyond)
                point["at_beyond_ratio"] += [pricing.predict(rec, model, point["knobs"], beyond, seed)
                                             for seed in range(seeds)]
    return {"points": points, "scales": scales, "seeds": seeds}


def median_and_range(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    median, low, high = median_range(values)
    return f"{format(median, fmt)} ({format(low, fmt)}-{format(high, fmt)})"


def report(args, saved: dict, result: dict) -> str:
    scales = result["scales"]
    lines = [section(saved), "",
             f"{date.today().isoformat()}, commit {commit()}, {cpu_name()}. Command: `.venv/bin/python -m "
             f"batchtop.engine.bench.whatif_sensitivity CHECK.json --seeds {args.seeds} --write`, "
             f"CHECK.json the `--json` of the check run at commit {saved.get('commit', '?')} (the section "
             f"\"{check_section(saved).removeprefix('## ')}\"; {len(saved['rounds'])} recordings). "
             "Each point predicted again from each round's recording with the fitted "
             f"forward time of every step scaled, {args.seeds} seeds each (the law's per-step draw); "
             "median (range) over rounds and seeds. Real step ratio: each real run's decode steps against "
             "its round's recording's at the same row count (those the recording ran at least "
             f"{MIN_RECORDED_STEPS} times), both over the recording's law at each step's shape; median "
             "(range) over the rounds. Past the recorded rows: each real run's decode steps wider than "
             "any its round's recording ran, over the recording's law at each step's shape (the law's "
             "own error where the what-if extrapolates it); median (range) over the rounds; and the point "
             "predicted again with every forward time at that ratio (each round at its own run's).", "",
             "| knobs | metric | measured | real step ratio | "
             + " | ".join(f"predicted at {f:g}x" for f in scales)
             + " | past the recorded rows | predicted at that ratio |",
             "|---|---|---|---|" + "---|" * len(scales) + "---|---|"]
    for point in result["points"]:
        ratio = median_and_range(point["step_ratio"], ".2f")
        beyond = median_and_range(point["beyond_ratio"], ".2f")
        for metric, key, fmt, scale in (("preemptions", "preemptions", ".0f", 1),
                                        ("ITL p50 (ms)", "itl_p50_s", ".1f", 1e3),
                                        ("TTFT p50 (ms)", "ttft_p50_s", ".0f", 1e3),
                                        ("output tok/s", "output_tok_s", ".0f", 1)):
            measured = median_and_range([m[key] * scale for m in point["measured"]], fmt)
            predicted = [median_and_range([r[key] * scale for r in point["scaled"][f]], fmt) for f in scales]
            at_beyond = median_and_range([r[key] * scale for r in point["at_beyond_ratio"]], fmt)
            lines.append(f"| {run_label(point['knobs'])} | {metric} | {measured} | {ratio} | "
                         + " | ".join(predicted) + f" | {beyond} | {at_beyond} |")
    return "\n".join(lines)


def check_section(saved: dict) -> str:
    """The section the check wrote (a whatif_serve or whatif_vllm file that did not say it: from its
    command)."""
    if "section" in saved:
        return saved["section"]
    if "vllm.entrypoints" in saved["command"]:
        blocks = re.search(r"--num-gpu-blocks-override (\d+)", saved["command"])
        size = re.search(r"--block-size (\d+)", saved["command"])
        return whatif_vllm.section(argparse.Namespace(num_gpu_blocks=blocks and int(blocks.group(1)),
                                                      block_size=size and int(size.group(1))))
    pool = re.search(r"--num-kv-blocks (\d+)", saved["command"])
    return CHECKED + (f", a pool of {pool.group(1)} blocks" if pool else "")


def section(saved: dict) -> str:
    return "## Sensitivity to step time: " + check_section(saved).removeprefix(CHECK_PREFIX)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", help="a whatif_check, whatif_serve or whatif_vllm --json file (its "
                                      "recordings still in its --out)")
    parser.add_argument("--scales", default=",".join(f"{f:g}" for f in SCALES),
                        help="factors on the fitted forward time")
    parser.add_argument("--seeds", type=int, default=3, help="what-if runs per recording and factor")
    parser.add_argument("--write", action="store_true", help="write the section of docs/whatif.md")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    saved = json.loads(Path(args.check).read_text())
    scales = tuple(float(f) for f in args.scales.split(",") if f)
    return publish(section(saved), report(args, saved, analyse(saved, scales, args.seeds)),
                   write=args.write, doc=DOC)


if __name__ == "__main__":
    raise SystemExit(main())
