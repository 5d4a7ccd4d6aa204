"""Postmortem exports of a recorded run: Chrome/Perfetto trace, per-request CSV, text summary.

Trace layout (open in ui.perfetto.dev or chrome://tracing):
- process 1 "batch": one thread per batch slot, named "slot N" (tid N + 1).
  A request's residency is an "X" slice named by its request id, from
  RequestAdmitted to RequestRetired / RequestPreempted / RequestRetracted; a
  RowMoved ends it on the old slot and opens a new one on the new slot.
  FirstToken is an instant on the slot.
- process 2 "engine": thread "steps" with one slice per step (children: the
  schedule/prepare/forward/sample/update phases) and instants for knob
  changes, pauses, refused commands and dropped events; counters
  kv_blocks_used, running_rows, waiting_rows, tokens_per_step (from
  StepFinished) and scheduled_tokens (prefill/recompute/decode, from StepPlanned).
Timestamps are microseconds since the header's start_monotonic (or the first event).
"""
from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from typing import Iterable

from .events import (
    WAIT_REASONS,
    CommandRefused,
    EnginePaused,
    EngineResumed,
    Event,
    EventsDropped,
    FirstToken,
    KnobChanged,
    RequestAdmitted,
    RequestPreempted,
    RequestRetired,
    RequestRetracted,
    RowMoved,
    StepFailed,
    StepFinished,
    StepPlanned,
)
from .run_stats import Distribution, Metrics, MetricsSummary

BATCH_PID = 1
ENGINE_PID = 2
STEPS_TID = 1
_PHASES = ("schedule", "prepare", "forward", "sample", "update")


def slot_tid(slot: int) -> int:
    """Thread id of batch slot `slot` in the trace (tid 0 is avoided: some viewers treat it specially)."""
    return slot + 1


@dataclass(slots=True)
class _OpenSlice:
    request_id: str
    start_t: float
    resumed: bool


class _TraceBuilder:
    def __init__(self, t0: float):
        self.t0 = t0
        self.out: list[dict] = []
        self.open: dict[int, _OpenSlice] = {}     # slot -> the request residing there
        self.slot_of: dict[str, int] = {}         # request -> its slot
        self.slots: set[int] = set()

    def us(self, t: float) -> float:
        return round((t - self.t0) * 1e6, 3)

    def begin(self, slot: int, request_id: str, t: float, resumed: bool) -> None:
        if slot in self.open:       # a missed end (dropped events): close the stale one here
            self.end(slot, t, "unknown")
        stale = self.slot_of.get(request_id)
        if stale is not None and stale != slot:
            self.end(stale, t, "unknown")
        self.open[slot] = _OpenSlice(request_id, t, resumed)
        self.slot_of[request_id] = slot
        self.slots.add(slot)

    def end(self, slot: int, t: float, how: str) -> None:
        s = self.open.pop(slot, None)
        if s is None:
            return
        if self.slot_of.get(s.request_id) == slot:
            del self.slot_of[s.request_id]
        self.slots.add(slot)
        start = self.us(s.start_t)
        self.out.append({
            "name": s.request_id, "cat": "request", "ph": "X", "pid": BATCH_PID,
            "tid": slot_tid(slot), "ts": start, "dur": max(self.us(t) - start, 0.0),
            "args": {"request_id": s.request_id, "slot": slot, "resumed": s.resumed, "end": how},
        })

    def end_request(self, request_id: str, slot: int, t: float, how: str) -> None:
        found = self.slot_of.get(request_id, slot)
        if found in self.open and self.open[found].request_id == request_id:
            self.end(found, t, how)

    def instant(self, name: str, t: float, pid: int, tid: int, args: dict, cat: str) -> None:
        self.out.append({"name": name, "cat": cat, "ph": "i", "s": "t", "pid": pid, "tid": tid,
                         "ts": self.us(t), "args": args})

    def counter(self, name: str, t: float, args: dict) -> None:
        self.out.append({"name": name, "ph": "C", "pid": ENGINE_PID, "ts": self.us(t), "args": args})

    def step(self, e: StepFinished) -> None:
        phases = (e.schedule_s, e.prepare_s, e.forward_s, e.sample_s, e.update_s)
        total = sum(phases)
        ts, dur = self.us(e.t - total), round(total * 1e6, 3)
        args = {"num_rows": e.num_rows, "num_tokens": e.num_tokens,
                "num_sampled": len(e.sampled_request_ids)}
        self.out.append({"name": f"step {e.step}", "cat": "step", "ph": "X", "pid": ENGINE_PID,
                         "tid": STEPS_TID, "ts": ts, "dur": dur, "args": args})
        # Children are placed from the parent's rounded start and clamped to its end, so
        # rounding never lets a phase stick out of its step (viewers reject bad nesting).
        offset = 0.0
        for name, phase_s in zip(_PHASES, phases):
            child_ts = round(ts + offset * 1e6, 3)
            child_dur = max(min(round(phase_s * 1e6, 3), round(ts + dur - child_ts, 3)), 0.0)
            self.out.append({"name": name, "cat": "phase", "ph": "X", "pid": ENGINE_PID,
                             "tid": STEPS_TID, "ts": child_ts, "dur": child_dur})
            offset += phase_s


def _metadata(pid: int, tid: int | None, name: str, value, sort_index: int | None = None) -> list[dict]:
    base = {"ph": "M", "pid": pid, "ts": 0}
    if tid is not None:
        base["tid"] = tid
    out = [{**base, "name": name, "args": {"name": value}}]
    if sort_index is not None:
        sort_name = "thread_sort_index" if tid is not None else "process_sort_index"
        out.append({**base, "name": sort_name, "args": {"sort_index": sort_index}})
    return out


def _trace_origin(header: dict | None, events: list[Event]) -> float:
    """The header's start_monotonic, or the earliest event time if that is earlier (or no header)."""
    candidates = [min(e.t for e in events)] if events else []
    start = (header or {}).get("start_monotonic")
    if isinstance(start, (int, float)):
        candidates.append(float(start))
    return min(candidates) if candidates else 0.0


def to_chrome_trace(header: dict | None, events: Iterable[Event]) -> dict:
    """A Chrome/Perfetto trace (JSON object form) of the run; `json.dump` it to a file."""
    events = list(events)
    b = _TraceBuilder(_trace_origin(header, events))
    last_t = events[-1].t if events else b.t0
    for e in events:
        last_t = max(last_t, e.t)
        kind = type(e)
        if kind is RequestAdmitted:
            b.begin(e.slot, e.request_id, e.t, e.resumed)
        elif kind is RowMoved:
            s = b.open.get(e.from_slot)
            resumed = s.resumed if s is not None else False
            b.end_request(e.request_id, e.from_slot, e.t, f"moved to slot {e.to_slot}")
            b.begin(e.to_slot, e.request_id, e.t, resumed)
        elif kind is RequestRetired:     # slot -1 (from the waiting queue) ends nothing open
            b.end_request(e.request_id, e.slot, e.t, f"retired:{e.reason}")
        elif kind is RequestPreempted:
            b.end_request(e.request_id, e.slot, e.t, "preempted")
        elif kind is RequestRetracted:
            b.end_request(e.request_id, e.slot, e.t, "retracted")
        elif kind is FirstToken:
            slot = b.slot_of.get(e.request_id)
            if slot is not None:
                b.instant("first token", e.t, BATCH_PID, slot_tid(slot),
                          {"request_id": e.request_id, "ttft_s": e.ttft_s}, "request")
        elif kind is StepFinished:
            b.step(e)
            b.counter("kv_blocks_used", e.t, {"used": e.kv_blocks_used})
            b.counter("running_rows", e.t, {"running": e.num_running})
            b.counter("waiting_rows", e.t, {"waiting": e.num_waiting})
            b.counter("tokens_per_step", e.t, {"tokens": e.num_tokens})
        elif kind is StepPlanned:
            b.counter("scheduled_tokens", e.t, {"prefill": e.prefill_tokens, "recompute": e.recompute_tokens,
                                                "decode": e.decode_tokens})
        elif kind in (KnobChanged, CommandRefused, EnginePaused, EngineResumed, EventsDropped, StepFailed):
            d = e.to_dict()
            name = d.pop("kind")
            if kind is KnobChanged:
                name = f"{e.name}: {e.old} -> {e.new}"
            b.instant(name, e.t, ENGINE_PID, STEPS_TID, d, "engine")
    for slot in list(b.open):
        b.end(slot, last_t, "open at end of log")

    model = (header or {}).get("model")
    meta = _metadata(BATCH_PID, None, "process_name", f"batch ({model})" if model else "batch", 1)
    meta += _metadata(ENGINE_PID, None, "process_name", "engine", 2)
    meta += _metadata(ENGINE_PID, STEPS_TID, "thread_name", "steps", 0)
    for slot in sorted(b.slots):
        meta += _metadata(BATCH_PID, slot_tid(slot), "thread_name", f"slot {slot}", slot_tid(slot))
    return {
        "traceEvents": meta + b.out,
        "displayTimeUnit": "ms",
        "otherData": {"header": dict(header or {})},
    }


CSV_COLUMNS = (
    "request_id", "arrival", "admitted", "first_token", "finished", "reason",
    "prompt_tokens", "output_tokens", "ttft", "tpot", "e2e", "preemptions", "retractions",
    "queue", *(f"wait_{reason}" for reason in WAIT_REASONS),
)


def to_csv(events: Iterable[Event], *, t0: float | None = None) -> str:
    """One row per request seen, in order of first appearance; empty cell = not seen.

    Times are seconds since `t0` (default: the first event's t; pass 0.0 for raw
    monotonic times). ttft/tpot/e2e are durations. output_tokens comes from
    RequestRetired, else the tokens sampled so far.
    """
    metrics = Metrics()
    metrics.feed(events)
    if t0 is None:
        t0 = metrics.first_t if metrics.first_t is not None else 0.0

    def at(t: float | None) -> str:
        return "" if t is None else f"{t - t0:.6f}"

    def dur(s: float | None) -> str:
        return "" if s is None else f"{s:.6f}"

    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for r in metrics.requests.values():
        out_tokens = r.num_output_tokens if r.num_output_tokens is not None else r.num_sampled
        writer.writerow([
            r.request_id, at(r.arrival_t), at(r.admitted_t), at(r.first_token_t), at(r.finished_t),
            r.reason or "", "" if r.num_prompt_tokens is None else r.num_prompt_tokens, out_tokens,
            dur(r.ttft_s), dur(r.tpot_s), dur(r.e2e_s), r.num_preemptions, r.num_retractions,
            dur(r.queue_s if r.wait_s else None), *(dur(r.wait_s.get(reason)) for reason in WAIT_REASONS),
        ])
    return buf.getvalue()


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:.2f}"


def _dist_line(name: str, d: Distribution) -> str:
    if d.count == 0:
        return f"{name:<6} n/a (no samples)"
    return (f"{name:<6} mean {_ms(d.mean)}  p50 {_ms(d.p50)}  p90 {_ms(d.p90)}  "
            f"p99 {_ms(d.p99)}  ms  (n={d.count})")


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def format_summary(s: MetricsSummary, header: dict | None = None) -> str:
    lines = []
    if header:
        lines.append(f"model {header.get('model')}  schema v{header.get('schema_version')}  "
                     f"started {header.get('start_time')}")
    if s.num_events_dropped:
        lines.append(f"WARNING: {s.num_events_dropped} events were dropped; figures are incomplete")
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(s.finished_by_reason.items())) or "none"
    lines += [
        f"span              {s.span_s:.3f} s   events {s.num_events}",
        f"steps             {s.num_steps}",
        f"row-steps         total {s.row_steps_total}  useful {s.row_steps_useful}",
        f"batch utilisation {_num(s.batch_utilisation, '.3f')}",
        f"throughput        in {_num(s.throughput_in_tok_s, '.1f')} tok/s ({s.num_prompt_tokens} prompt "
        f"tokens)  out {_num(s.throughput_out_tok_s, '.1f')} tok/s ({s.num_output_tokens} output tokens)",
        _dist_line("TTFT", s.ttft),
        _dist_line("TPOT", s.tpot),
        _dist_line("ITL", s.itl),
        _dist_line("E2E", s.e2e),
        f"preemptions       {s.num_preemptions}   retractions {s.num_retractions}",
        f"recompute tax     {_num(s.recompute_tax, '.3f')} ({s.tokens_recomputed} recomputed"
        f" / {s.tokens_computed} computed tokens)",
        f"requests          arrived {s.num_arrived}  finished {s.num_finished} ({reasons})",
        f"queue time        {wait_line(s.wait_s_by_reason)} (summed over requests)",
    ]
    return "\n".join(lines) + "\n"


def wait_line(wait_s: dict[str, float]) -> str:
    """"2.3 s: 1.8 s kv, 520 ms max_num_seqs" — a queue time split by reason, largest first
    (parts under half a millisecond left out)."""
    parts = ", ".join(f"{_duration(seconds)} {reason}" for reason, seconds in
                      sorted(wait_s.items(), key=lambda item: -item[1]) if seconds >= 0.0005)
    return f"{_duration(sum(wait_s.values()))}: {parts}" if parts else _duration(sum(wait_s.values()))


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def summary_text(header: dict | None, events: Iterable[Event]) -> str:
    """A plain-text postmortem summary of a run."""
    metrics = Metrics()
    metrics.feed(events)
    return format_summary(metrics.summary(), header)
