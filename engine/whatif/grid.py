"""`whatif`'s work: a recording's identity replay, its step-time fit, and the what-if runs of a knob grid,
each summarised as a row of the table (or JSON) and optionally written as a recording."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path

from batchtop.engine.core.knobs import knob
from batchtop.telemetry import events as ev
from batchtop.telemetry.recorder import make_header, write_log
from batchtop.telemetry.run_stats import MetricsSummary, summarize

from .recording import Recording
from .replay import Identity, fit_steps, replay_identity, run_whatif
from .steptime import StepTimeModel

MAX_STEP_SCALE = 100.0
NOTE_LENGTHS = ("requests keep their recorded output lengths: exact for greedy or ignore_eos runs "
                "(greedy output does not depend on the schedule); a sampled run's lengths would vary")


def parse_settings(settings: list[str], capacity: int) -> dict[str, list]:
    """`--set KNOB=V1,V2` flags as {knob: [values]}, each value checked by the knob table."""
    grid: dict[str, list] = {}
    for setting in settings:
        name, sep, values = setting.partition("=")
        if not sep or not values:
            raise ValueError(f"--set takes KNOB=V1,V2,..., got {setting!r}")
        spec = knob(name.strip())
        grid[spec.name] = [spec.parse(v.strip(), capacity) for v in values.split(",")]
    return grid


def points(grid: dict[str, list]) -> list[dict]:
    names = list(grid)
    return [dict(zip(names, combo)) for combo in itertools.product(*(grid[n] for n in names))]


@dataclass
class Run:
    label: str
    knobs: dict                  # the knobs changed from the recorded ones (empty: as recorded)
    summary: MetricsSummary
    events: list[ev.Event] | None = None         # None: a run summarised where it ran (vLLM's harness)
    extrapolation: str | None = None
    seconds: float = 0.0         # what the replay took to compute
    step_scale: float = 1.0      # the fitted forward times priced at this multiple (`--step-time`)

    def row(self) -> dict:
        s = self.summary
        return {"run": self.label, "knobs": self.knobs,
                "ttft_p50_s": s.ttft.p50, "ttft_p99_s": s.ttft.p99, "itl_p50_s": s.itl.p50,
                "itl_p99_s": s.itl.p99, "e2e_p50_s": s.e2e.p50, "e2e_p99_s": s.e2e.p99,
                "output_tok_s": s.throughput_out_tok_s, "preemptions": s.num_preemptions + s.num_retractions,
                "recomputed_tokens": s.tokens_recomputed, "wait_s_by_reason": s.wait_s_by_reason,
                "peak_kv": s.peak_kv, "prefix_hit": s.prefix_hit_share, "steps": s.num_steps,
                "span_s": s.span_s,
                "effective_batch": s.row_steps_useful / s.num_steps if s.num_steps else None,
                "batch_utilisation": s.batch_utilisation,
                "extrapolated": self.extrapolation, "compute_s": self.seconds, "step_scale": self.step_scale}


def run_of(label: str, knobs: dict, events: list[ev.Event], **extra) -> Run:
    return Run(label, knobs, summarize(events), events, **extra)


@dataclass
class WhatIf:
    recording: Recording
    identity: Identity
    model: StepTimeModel
    runs: list[Run]              # recorded, as recorded on fitted step times, then the grid

    def to_dict(self) -> dict:
        law = self.model.forward
        return {"recording": self.recording.path, "model": self.recording.model,
                "setup": self.recording.setup.to_dict(), "assumed": list(self.recording.setup.assumed),
                "in_flight_at_start": self.recording.num_in_flight,
                "knobs": self.recording.setup.knobs,
                "identity": {"steps": self.identity.num_steps, "matching": self.identity.num_matching,
                             "share": self.identity.match_share,
                             "first_mismatch": self.identity.first_mismatch},
                "fit": {"law": law.name, "forward": law.describe(), "heldout_mape": law.heldout_mape,
                        "gap": self.model.gap.describe(), "gap_s": self.model.gap_s,
                        "mean_slowdown": self.model.mean_slowdown},
                "note": NOTE_LENGTHS, "runs": [run.row() for run in self.runs]}


def prepare(rec: Recording) -> tuple[Identity, StepTimeModel]:
    identity = replay_identity(rec)
    return identity, fit_steps(rec, identity)


def predict(rec: Recording, model: StepTimeModel, changed: dict, label: str | None = None,
            step_scale: float = 1.0) -> Run:
    """One what-if: the recorded knobs with `changed` over them, on fitted step times (their forward
    times at `step_scale` times the fit's)."""
    knobs = {**rec.setup.knobs, **changed}
    steps = model.fresh(step_scale)
    started = time.perf_counter()
    _, events = run_whatif(rec, knobs, steps, held=frozenset(changed), gap=steps.gap)
    seconds = time.perf_counter() - started
    return run_of(label or run_label(changed, step_scale), changed, events,
                  extrapolation=steps.extrapolation(), seconds=seconds, step_scale=step_scale)


def run_label(changed: dict, step_scale: float = 1.0) -> str:
    """A what-if run's name: its knobs, and `@F` where its forward times are F times the fit's."""
    label = ", ".join(f"{k}={v}" for k, v in changed.items()) or "as recorded (fitted)"
    return label if step_scale == 1.0 else f"{label} @{step_scale:g}x"


def grid_runs(grid: dict[str, list], step_scales: tuple[float, ...]) -> list[tuple[dict, float]]:
    """The recorded knobs at every step-time scale but 1x (always run), then every point of the grid at
    every scale."""
    return ([({}, scale) for scale in step_scales if scale != 1.0]
            + [(changed, scale) for changed in points(grid) if changed for scale in step_scales])


def parse_step_scales(text: str | None) -> tuple[float, ...]:
    """`--step-time F1,F2`: factors on the fitted forward times, each in (0, 100]."""
    if text is None:
        return (1.0,)
    scales = []
    for item in text.split(","):
        try:
            scale = float(item)
        except ValueError:
            raise ValueError(f"--step-time takes factors such as 0.9,1.1, got {item.strip()!r}") from None
        if not 0.0 < scale <= MAX_STEP_SCALE:
            raise ValueError(f"--step-time {item.strip()}: a factor must be above 0 and at most "
                             f"{MAX_STEP_SCALE:g}")
        scales.append(scale)
    return tuple(dict.fromkeys(scales))              # each once, in the order given


def whatif(rec: Recording, grid: dict[str, list], step_scales: tuple[float, ...] = (1.0,)) -> WhatIf:
    identity, model = prepare(rec)
    runs = [run_of("recorded", {}, rec.events), predict(rec, model, {}, "as recorded (fitted)")]
    runs += [predict(rec, model, changed, step_scale=scale)
             for changed, scale in grid_runs(grid, step_scales)]
    return WhatIf(rec, identity, model, runs)


def write_runs(result: WhatIf, out: str) -> list[str]:
    """Each grid run as a recording: OUT itself for one run, else OUT with the knob values in its name."""
    grid = result.runs[2:]
    paths = []
    target = Path(out)
    for run in grid:
        values = [f"{k}={v}" for k, v in run.knobs.items()]
        values += [f"step_time={run.step_scale:g}"] if run.step_scale != 1.0 else []
        path = (target if len(grid) == 1
                else target.with_name(f"{target.stem}." + "-".join(values) + target.suffix))
        header = make_header(result.recording.model, {**result.recording.setup.knobs, **run.knobs},
                             engine=result.recording.setup.to_dict(),
                             device=result.recording.header.get("device"),
                             whatif={"recording": result.recording.path, "knobs": run.knobs,
                                     "step_scale": run.step_scale,
                                     "forward": result.model.forward.describe(),
                                     "heldout_mape": result.model.forward.heldout_mape})
        header["start_monotonic"] = 0.0
        paths.append(write_log(path, header, run.events))
    return paths


# -- the table ----------------------------------------------------------------------------------

COLUMNS = (("TTFT p50", "ttft_p50_s"), ("TTFT p99", "ttft_p99_s"), ("ITL p50", "itl_p50_s"),
           ("ITL p99", "itl_p99_s"), ("E2E p50", "e2e_p50_s"), ("E2E p99", "e2e_p99_s"))


def format_table(result: WhatIf) -> str:
    rec, identity, law = result.recording, result.identity, result.model.forward
    lines = [f"{rec.path}: {len(rec.requests)} requests over {rec.wall_s:.1f} s, {identity.num_steps} steps; "
             + ", ".join(f"{k}={v}" for k, v in rec.setup.knobs.items()),
             f"identity replay (recorded step times): {identity.num_matching} of {identity.num_steps} steps "
             f"scheduled as recorded ({identity.match_share:.1%})"
             + (f", first difference at step {identity.first_mismatch}" if identity.first_mismatch else ""),
             f"step time: {law.name} law, forward = {law.describe()}; held-out MAPE {law.heldout_mape:.1%}; "
             f"times a recorded slowdown (mean {result.model.mean_slowdown:.2f}x); "
             f"gap between steps = {result.model.gap.describe()}",
             NOTE_LENGTHS]
    if rec.setup.assumed:
        lines.append("not in the recording, engine defaults assumed: " + ", ".join(rec.setup.assumed))
    lines += rec.replay_words()
    scales = sorted({run.step_scale for run in result.runs} - {1.0})
    if scales:
        lines.append("@F: the run again with every fitted forward time at F times (" + ", ".join(
            f"{scale:g}x" for scale in scales) + "): how far its figures move with the machine's speed")
    lines += ["", format_rows(result.runs)]
    lines.append(f"(each prediction: held-out MAPE of the step-time fit {law.heldout_mape:.1%})")
    return "\n".join(lines)


def format_rows(runs: list[Run]) -> str:
    """The table's rows: latencies, throughput, preemptions, recomputed tokens, peak KV, the prefix
    cache's share of the tokens admissions looked up ("cached"; - where the engine caches none), waits."""
    lines = [f"{'run':<34}" + "".join(f"{c:>10}" for c, _ in COLUMNS)
             + f"{'out tok/s':>11}{'preempt':>9}{'recomp':>8}{'peak KV':>9}{'cached':>8}  waiting by reason"]
    for run in runs:
        row = run.row()
        waits = ", ".join(f"{k} {v:.1f}s" for k, v in sorted(row["wait_s_by_reason"].items(),
                                                            key=lambda kv: -kv[1]) if v >= 0.05)
        tok_s = row["output_tok_s"]
        lines.append(f"{run.label[:33]:<34}" + "".join(f"{_t(row[key]):>10}" for _, key in COLUMNS)
                     + f"{(f'{tok_s:.1f}' if tok_s else '-'):>11}{row['preemptions']:>9}"
                     + f"{row['recomputed_tokens']:>8}{_pct(row['peak_kv']):>9}{_pct(row['prefix_hit']):>8}"
                     + f"  {waits or '-'}")
        if run.extrapolation:
            lines.append(f"{'':<34}{run.extrapolation}")
    return "\n".join(lines)


def _t(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.1f}ms" if seconds < 1 else f"{seconds:.2f}s"


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"
