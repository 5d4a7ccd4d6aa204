"""A recording made inside vLLM, re-scheduled by vLLM's own scheduler: the harness of the vLLM that
recorded it (engine/vllm/harness.py), run by that vLLM environment's interpreter in a subprocess
(vLLM's pins differ from batchtop's), one vLLM import for the whole grid (`--serve`).

Every run is batchtop's class inside vLLM's `Scheduler` on the harness's virtual clock, so it gives
the events a live vLLM gives. The identity replay takes each recorded step's time (a table, the
k-th step the k-th recorded time): the same scheduler must then plan the recorded step at every
step (`signatures`). The step-time law is fitted as for batchtop's recordings (steptime.py), on the
shapes the identity replay computed, and handed to the harness as its coefficients with the recorded
slowdown: each predicted step's forward is drawn as in batchtop's what-if (telemetry/slowdown.py,
the same seed), the overheads and the mean gap between steps added. A predicted run sends back its
figures, summarised in the harness, and its events only when they are to be written (`--record`).
Prompts are made-up ids of the recorded lengths; where vLLM cached prefixes, they share the full blocks
the recorded prompts shared (RequestArrived's prompt_blocks, recording.PromptTokens), so vLLM's prefix
cache hits where it could have. The recording's own knob changes are not replayed (each run keeps its
knobs throughout).
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import tempfile
import time
from pathlib import Path

from batchtop.telemetry import events as ev
from batchtop.telemetry.events import event_from_dict
from batchtop.telemetry.run_stats import MetricsSummary

from .grid import Run, WhatIf, grid_runs, run_label, run_of
from .recording import VLLM_KNOBS, PromptTokens, Recording, TraceRequest
from .replay import Identity, identity_of, recorded_gaps, recorded_phases, without_gc
from .steptime import StepTimeModel, fit_model
from .virtual import StepShape

PROJECT_ROOT = Path(__file__).resolve().parents[2]
VLLM_ENVS = {"0.32": ".venv-vllm", "0.33": ".venv-vllm033"}   # what `make setup` builds
EARLY_S = 1e-9              # arrivals and aborts a hair early: the harness takes them at clock >= time
VLLM_MAX_NUM_SEQS = 1024    # the largest max_num_seqs a what-if may ask of a fresh vLLM scheduler
HARNESS_TOKEN_IDS = (10, 32_000)   # the harness's made-up ids: from FIRST_PROMPT_TOKEN, below VOCAB_SIZE
SHAPE_FIELDS = ("num_rows", "prefill_tokens", "decode_rows", "head_rows", "context_tokens",
                "prefill_attention")


def vllm_python(version: str) -> Path:
    """The interpreter of the environment of vLLM `version`; ValueError (one line) when not installed."""
    env = VLLM_ENVS.get(version)
    if env is None:
        raise ValueError(f"a recording made inside vLLM {version}: batchtop replays vLLM "
                         f"{' and '.join(VLLM_ENVS)} only (environments {', '.join(VLLM_ENVS.values())})")
    python = PROJECT_ROOT / env / "bin" / "python"
    if not python.exists():
        raise ValueError(f"a recording made inside vLLM {version}: its environment {env} is not installed "
                         f"here (make setup builds it)")
    return python


class HarnessProcess:
    """`python -m batchtop.engine.vllm.harness --serve` in a vLLM environment: a job in, a result out."""

    def __init__(self, version: str):
        self.version = version
        self._log = tempfile.TemporaryFile(mode="w+")
        self._process = subprocess.Popen(
            [str(vllm_python(version)), "-m", "batchtop.engine.vllm.harness", "--serve"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)

    def run(self, job: dict) -> dict:
        self._process.stdin.write(json.dumps(job) + "\n")
        self._process.stdin.flush()
        line = self._process.stdout.readline()
        if not line:
            self._log.seek(0)
            tail = self._log.read().strip().splitlines()[-1:] or ["no output"]
            raise ValueError(f"the vLLM {self.version} harness ended: {tail[0]}")
        result = json.loads(line)
        if "error" in result:
            raise ValueError(f"the vLLM {self.version} harness refused a run: {result['error']}")
        return result

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.stdin.close()
            self._process.wait(timeout=60)
        self._log.close()

    def __enter__(self) -> HarnessProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def prompt_tokens(rec: Recording) -> PromptTokens | None:
    """Where vLLM cached prefixes, the made-up prompts of a run (its trace's and its joined requests',
    from one instance): they share the blocks the recorded prompts shared."""
    if not rec.setup.enable_prefix_caching:
        return None
    return PromptTokens(rec.setup.block_size, *HARNESS_TOKEN_IDS, continued=rec.continued_blocks)


def harness_trace(rec: Recording, as_scheduled: bool = False,
                  tokens: PromptTokens | None = None) -> list[dict]:
    """The recording's requests as the harness's TraceRequest fields. A request arrives when vLLM's
    `Request` says (the API server took it before the scheduler saw it: RequestArrived's `arrival_t`, or
    in a recording that lacks it, its FirstToken's time less its TTFT), else, or `as_scheduled` (the
    identity replay, on the recording's own timeline), when the scheduler saw it (RequestArrived's `t`).
    With `tokens`, each prompt's token ids share the blocks the recorded prompt shared."""
    taken_in = {e.request_id: e.t - rec.t0 for e in rec.events if isinstance(e, ev.RequestArrived)}
    first_token_less_ttft = {e.request_id: e.t - e.ttft_s - rec.t0 for e in rec.events
                             if isinstance(e, ev.FirstToken)}
    trace = []
    for r in rec.requests:
        if as_scheduled:
            arrival_s = taken_in[r.request_id]
        else:
            arrival_s = min(first_token_less_ttft.get(r.request_id, r.arrival_s), r.arrival_s)
        trace.append(_harness_request(r, max(arrival_s - EARLY_S, 0.0), tokens))
    return trace


def harness_free_queue(rec: Recording, tokens: PromptTokens | None) -> dict:
    """The pool's free queue when the recording began (its joining snapshot's, where vLLM cached
    prefixes and the run starts from the requests then in flight): `free_blocks`, each cached block by
    name ("" an empty one), and `blocks`, each of those names a made-up prompt gives (with its
    ancestors) as its parent's name and its tokens, so the harness hashes them as vLLM does."""
    names = rec.start_free_blocks
    if tokens is None or names is None:
        return {}
    parents = rec.block_parents()
    blocks: dict[str, list] = {}
    for name in names:
        while name in parents and name not in blocks:
            blocks[name] = [parents[name], tokens.block(name)]
            name = parents[name]
    return {"free_blocks": list(names), "blocks": blocks}


def _harness_request(r: TraceRequest, arrival_s: float, tokens: PromptTokens | None) -> dict:
    row = {"request_id": r.request_id, "arrival_s": arrival_s, "num_prompt_tokens": r.num_prompt_tokens,
           "max_tokens": r.max_tokens, "output_len": r.num_output_tokens if r.stops else r.max_tokens,
           "priority": r.priority}
    if r.abort_after_s is not None:
        row["abort_s"] = r.arrival_s + r.abort_after_s - EARLY_S
    if tokens is not None and (r.prompt_blocks or r.request_id in tokens.continued):
        row["prompt_token_ids"] = tokens.prompt(r)
    if tokens is not None and r.request_id in tokens.continued:
        row["output_token_ids"] = tokens.outputs_named(r.request_id, r.num_prompt_tokens)
    return row


def harness_joined(rec: Recording, tokens: PromptTokens | None = None) -> list[dict]:
    """The requests in flight when the recording began, as its first snapshot had them (the harness's
    Joined): every run starts with them in vLLM's scheduler, and under async scheduling with the step
    then in flight."""
    return [{"request": _harness_request(item.request, item.request.arrival_s, tokens),
             "status": item.status, "slot": item.slot, "num_output_tokens": item.num_output_tokens,
             "num_computed_tokens": item.num_computed_tokens, "num_blocks": item.num_blocks,
             "num_preemptions": item.num_preemptions, "num_hit_blocks": item.num_hit_blocks,
             "num_in_flight_tokens": item.num_in_flight_tokens}
            for item in rec.in_flight]


def harness_limits(rec: Recording, changed: dict | None = None) -> dict:
    limits = {key: value for key, value in rec.setup.vllm.items() if key != "version"}
    return {**limits, **(changed or {})}


def recorded_table(rec: Recording) -> dict:
    """Each recorded step's time and start, in step order: the identity replay's k-th step lasts the
    k-th time and starts no earlier than the k-th start (the loop's own time between steps, and the
    idle waits, where they were)."""
    finished = sorted(rec.steps, key=lambda e: e.step)
    times = [recorded_phases(e).total_s for e in finished]
    return {"table_s": times, "starts_s": [e.t - rec.t0 - total for e, total in zip(finished, times)]}


def law_spec(model: StepTimeModel) -> dict:
    """The fitted model as the harness's step-time law: the forward law (at the model's forward_scale)
    times a factor drawn per step from the recorded slowdown (the same draw as batchtop's what-if),
    plus the overheads (their intercepts and per-row terms) and the mean gap."""
    law, scale = model.forward, model.forward_scale
    coef = dict.fromkeys(SHAPE_FIELDS, 0.0)
    for name, c in zip(law.names, law.coef[1:]):
        for feature in (("prefill_tokens", "decode_rows") if name == "num_tokens" else (name,)):
            coef[feature] = coef.get(feature, 0.0) + c * scale   # a derived feature (log_decode_rows) too
    overhead = {"intercept_s": model.gap_s + sum(a for a, _ in model.overhead.values()),
                "num_rows": sum(b for _, b in model.overhead.values())}
    return {"law": coef, "intercept_s": law.coef[0] * scale, "slowdown": model.slowdown.to_dict(),
            "seed": model.seed, "overhead": overhead}


def _job(rec: Recording, step_time, changed: dict | None = None, as_scheduled: bool = False,
         events: bool = True) -> dict:
    """A harness run of the recording's trace; of each step only its shape comes back (the replay reads
    nothing else of the steps, and no request records: the events carry what the table needs), and
    without `events` only the events' summary (the table's figures, computed in the harness)."""
    tokens = prompt_tokens(rec)
    return {"trace": harness_trace(rec, as_scheduled, tokens), "joined": harness_joined(rec, tokens),
            **harness_free_queue(rec, tokens),
            "limits": harness_limits(rec, changed),
            "scheduler": "batchtop", "events": events, "summary": not events, "step_time": step_time,
            "step_fields": list(SHAPE_FIELDS), "requests": False}


@without_gc
def _events(result: dict) -> list[ev.Event]:
    return [event_from_dict(e) for e in result["events"]]


def _shapes(result: dict) -> list[StepShape]:
    return [StepShape(*(step[name] for name in SHAPE_FIELDS)) for step in result["steps"]]


def identity_through_harness(rec: Recording, harness: HarnessProcess) -> tuple[Identity, list[StepShape]]:
    """The recording's trace through vLLM's scheduler on the recorded step times, compared step by step."""
    result = harness.run(_job(rec, recorded_table(rec), as_scheduled=True))
    return identity_of(rec, None, _events(result)), _shapes(result)


def recorded_steps(rec: Recording, shapes: list[StepShape]) -> list[tuple[StepShape, ev.StepFinished]]:
    """The identity replay's shapes (in step order) beside the recorded steps, in order."""
    return list(zip(shapes, sorted(rec.steps, key=lambda e: e.step)))


def fit_through_harness(rec: Recording, shapes: list[StepShape]) -> StepTimeModel:
    """steptime.py's fit on the identity replay's shapes, paired with the recorded steps in order, each
    shape starting where its recorded step started (the machine's load then)."""
    pairs = [(dataclasses.replace(shape, start_s=e.t - rec.t0 - recorded_phases(e).total_s), e)
             for shape, e in recorded_steps(rec, shapes)]
    return fit_model([s for s, _ in pairs], [e for _, e in pairs], recorded_gaps(rec),
                     rec.setup.weight_macs)


def predict_through_harness(rec: Recording, model: StepTimeModel, harness: HarnessProcess, changed: dict,
                            label: str | None = None, keep_events: bool = False,
                            step_scale: float = 1.0) -> Run:
    """One what-if through vLLM's scheduler (its forward times at `step_scale` times the fit's); its
    events come back only with `keep_events` (to write it as a recording): the table needs only their
    summary, which the harness computes."""
    counted = model.fresh(step_scale)
    started = time.perf_counter()
    result = harness.run(_job(rec, law_spec(counted), changed, events=keep_events))
    seconds = time.perf_counter() - started
    for shape in _shapes(result):
        counted.count(shape)
    label = label or run_label(changed, step_scale)
    extra = dict(extrapolation=counted.extrapolation(), seconds=seconds, step_scale=step_scale)
    if keep_events:
        return run_of(label, changed, _events(result), **extra)
    return Run(label, changed, MetricsSummary.from_dict(result["summary"]), **extra)


def check_grid(grid: dict[str, list]) -> None:
    unknown = [name for name in grid if name not in VLLM_KNOBS]
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not a knob of vLLM's scheduler; "
                         f"knobs: {', '.join(VLLM_KNOBS)}")


def whatif_vllm(rec: Recording, grid: dict[str, list], harness: HarnessProcess | None = None,
                keep_events: bool = False, step_scales: tuple[float, ...] = (1.0,)) -> WhatIf:
    """`whatif` for a recording made inside vLLM: the identity replay, the fit, the grid's runs at each
    step-time scale (with their events where `keep_events`: `--record`)."""
    check_grid(grid)
    if harness is None:
        with HarnessProcess(rec.setup.vllm["version"]) as own:
            return whatif_vllm(rec, grid, own, keep_events, step_scales)
    identity, shapes = identity_through_harness(rec, harness)
    model = fit_through_harness(rec, shapes)
    runs = [run_of("recorded", {}, rec.events),
            predict_through_harness(rec, model, harness, {}, "as recorded (fitted)", keep_events)]
    runs += [predict_through_harness(rec, model, harness, changed, keep_events=keep_events, step_scale=scale)
             for changed, scale in grid_runs(grid, step_scales)]
    return WhatIf(rec, identity, model, runs)
