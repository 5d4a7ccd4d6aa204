"""Two recordings of one trace aligned request by request: where the schedules part, and per request
what changed in its time to first token and end to end.

Requests are matched by id when both runs have the same ids and prompt lengths, else by order of
arrival (prompt lengths must then agree pair by pair). A request's end-to-end time splits into
queue (arrival to first admission), prefill (first admission to first token), decode (first token
to retirement) and preempted (from each preemption to the readmission), prefill and decode net of
the preempted spans inside them. The split is done in integer nanoseconds, so the parts add up to
the whole exactly, in each run and in the differences.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from batchtop.telemetry import events as ev
from batchtop.telemetry.recorder import read_log

from .replay import signatures, steps_in_order

PARTS = ("queue", "prefill", "decode", "preempted")


def ns(t: float) -> int:
    return round(t * 1e9)


@dataclass
class Timeline:
    """One request's events in one run, in ns."""
    request_id: str
    num_prompt_tokens: int
    arrival: int
    admits: list[int] = field(default_factory=list)
    evictions: list[int] = field(default_factory=list)
    first_token: int | None = None
    finish: int | None = None
    reason: str | None = None

    def split(self) -> dict[str, int]:
        """queue, prefill, decode, preempted (ns) summing to e2e; also ttft and e2e. Needs `finish`."""
        finish = self.finish
        first_admit = self.admits[0] if self.admits else finish
        preempted_before = preempted_after = 0
        for evicted in self.evictions:
            back = next((t for t in self.admits if t >= evicted), finish)
            if self.first_token is None or evicted < self.first_token:
                preempted_before += back - evicted
            else:
                preempted_after += back - evicted
        first = self.first_token if self.first_token is not None else finish
        parts = {"queue": first_admit - self.arrival,
                 "prefill": first - first_admit - preempted_before,
                 "decode": finish - first - preempted_after,
                 "preempted": preempted_before + preempted_after}
        parts["e2e"] = finish - self.arrival
        parts["ttft"] = (self.first_token - self.arrival) if self.first_token is not None else None
        return parts


def timelines(events) -> dict[str, Timeline]:
    runs: dict[str, Timeline] = {}
    for e in events:
        kind = type(e)
        if kind is ev.RequestArrived:
            runs[e.request_id] = Timeline(e.request_id, e.num_prompt_tokens, ns(e.arrival_t))
            continue
        timeline = runs.get(getattr(e, "request_id", None))
        if timeline is None:
            continue
        if kind is ev.RequestAdmitted:
            timeline.admits.append(ns(e.t))
        elif kind in (ev.RequestPreempted, ev.RequestRetracted):
            timeline.evictions.append(ns(e.t))
        elif kind is ev.FirstToken and timeline.first_token is None:
            timeline.first_token = ns(e.t)
        elif kind is ev.RequestRetired:
            timeline.finish, timeline.reason = ns(e.t), e.reason
    return runs


def match(a: dict[str, Timeline], b: dict[str, Timeline], name_a: str = "A",
          name_b: str = "B") -> tuple[list[tuple[Timeline, Timeline]], str]:
    """The pairs (A's, B's) and how they were matched; ValueError when the traces differ."""
    if a.keys() == b.keys() and all(a[k].num_prompt_tokens == b[k].num_prompt_tokens for k in a):
        return [(a[k], b[k]) for k in a], "by id"
    if len(a) != len(b):
        raise ValueError(f"{name_a} and {name_b} are recordings of different traces: "
                         f"{len(a)} vs {len(b)} requests")
    by_arrival = (lambda runs: sorted(runs.values(), key=lambda t: t.arrival))
    pairs = list(zip(by_arrival(a), by_arrival(b)))
    for i, (x, y) in enumerate(pairs):
        if x.num_prompt_tokens != y.num_prompt_tokens:
            raise ValueError(f"{name_a} and {name_b} are recordings of different traces: arrival {i} has "
                             f"{x.num_prompt_tokens} prompt tokens in {name_a}, "
                             f"{y.num_prompt_tokens} in {name_b}")
    return pairs, "by arrival order and prompt length"


@dataclass
class RequestDelta:
    request_id: str                # A's id
    other_id: str                  # B's id
    delta: dict[str, int]          # B - A per part, ttft and e2e (ns)
    residual: int                  # delta e2e - sum of the parts' deltas: 0 by construction
    preempted: tuple[int, int]     # preemptions in A, in B
    reasons: tuple[str, str]


@dataclass
class Diff:
    matched_by: str
    deltas: list[RequestDelta]
    unfinished: int                # pairs left out: a request that never retired in one of the runs
    first_divergence: int | None   # the first step whose scheduled requests differ
    knob_changes: tuple[list, list]

    def summary(self) -> dict:
        e2e = [d.delta["e2e"] / 1e9 for d in self.deltas]
        ttft = [d.delta["ttft"] / 1e9 for d in self.deltas if d.delta["ttft"] is not None]
        parts = {p: sum(d.delta[p] for d in self.deltas) / 1e9 / max(len(self.deltas), 1) for p in PARTS}
        return {"matched_by": self.matched_by, "requests": len(self.deltas), "unfinished": self.unfinished,
                "gained": sum(x < 0 for x in e2e), "lost": sum(x > 0 for x in e2e),
                "unchanged": sum(x == 0 for x in e2e),
                "median_delta_ttft_s": statistics.median(ttft) if ttft else None,
                "median_delta_e2e_s": statistics.median(e2e) if e2e else None,
                "mean_delta_by_part_s": parts,
                "max_abs_residual_ns": max((abs(d.residual) for d in self.deltas), default=0),
                "first_divergent_step": self.first_divergence}


def diff_events(events_a, events_b, name_a: str = "A", name_b: str = "B") -> Diff:
    a, b = timelines(events_a), timelines(events_b)
    pairs, matched_by = match(a, b, name_a, name_b)
    deltas, unfinished = [], 0
    for x, y in pairs:
        if x.finish is None or y.finish is None:
            unfinished += 1
            continue
        sx, sy = x.split(), y.split()
        delta = {k: (sy[k] - sx[k]) if sx[k] is not None and sy[k] is not None else None for k in sx}
        residual = delta["e2e"] - sum(delta[p] for p in PARTS)
        deltas.append(RequestDelta(x.request_id, y.request_id, delta, residual,
                                   (len(x.evictions), len(y.evictions)), (x.reason, y.reason)))
    rename = {y.request_id: x.request_id for x, y in pairs}
    sig_a, sig_b = signatures(events_a), signatures(events_b, rename)
    first = next((step for step, alike in steps_in_order(sig_a, sig_b) if not alike), None)
    changes = tuple([(e.step, e.name, e.old, e.new, e.source) for e in events
                     if isinstance(e, ev.KnobChanged)] for events in (events_a, events_b))
    return Diff(matched_by, deltas, unfinished, first, changes)


def diff_files(path_a: str, path_b: str, engine_a: str | None = None,
               engine_b: str | None = None) -> tuple[Diff, dict, dict]:
    """Two logs (or one engine of each fleet recording) aligned; LogFormatError naming the engines when
    a fleet recording is given without its engine."""
    (header_a, events_a), (header_b, events_b) = read_log(path_a, engine_a), read_log(path_b, engine_b)
    return diff_events(events_a, events_b, run_name(path_a, engine_a), run_name(path_b, engine_b)), \
        header_a, header_b


def run_name(path: str, engine: str | None) -> str:
    """How a run is named in diff's messages: the path, and the engine of a fleet recording."""
    return path if engine is None else f"{path} (engine {engine})"


def format_diff(result: Diff, headers: tuple[dict, dict], names: tuple[str, str], top: int = 5) -> str:
    s = result.summary()
    lines = []
    for name, header, changes in zip(names, headers, result.knob_changes):
        knobs = header.get("knobs") or {}
        lines.append(f"{name}: " + ", ".join(f"{k}={v}" for k, v in knobs.items()))
        lines += [f"    step {step}: {k} {old} -> {new} ({source})" for step, k, old, new, source in changes]
    first = s["first_divergent_step"]
    lines.append(f"matched {s['requests']} requests {s['matched_by']}"
                 + (f" ({s['unfinished']} unfinished in a run, left out)" if s["unfinished"] else ""))
    lines.append("schedules identical" if first is None
                 else f"first step whose scheduled requests differ: {first}")
    lines.append(f"B vs A: {s['gained']} gained, {s['lost']} lost, {s['unchanged']} unchanged (end to end); "
                 f"median dTTFT {_s(s['median_delta_ttft_s'])}, median dE2E {_s(s['median_delta_e2e_s'])}")
    parts = s["mean_delta_by_part_s"]
    lines.append("mean dE2E by part: " + ", ".join(f"{p} {_s(parts[p])}" for p in PARTS)
                 + f"; residual {s['max_abs_residual_ns']} ns")
    ranked = sorted(result.deltas, key=lambda d: d.delta["e2e"])
    header = (f"{'request':>10} {'dTTFT':>9} {'dE2E':>9} " + " ".join(f"{'d' + p:>11}" for p in PARTS)
              + "  preempt")
    for title, chosen in (("gained most", ranked[:top]), ("lost most", ranked[::-1][:top])):
        chosen = [d for d in chosen if d.delta["e2e"] != 0]
        if not chosen:
            continue
        lines += [title, header]
        for d in chosen:
            lines.append(f"{d.request_id:>10} {_s(_sec(d.delta['ttft'])):>9} {_s(d.delta['e2e'] / 1e9):>9} "
                         + " ".join(f"{_s(d.delta[p] / 1e9):>11}" for p in PARTS)
                         + f"  {d.preempted[0]}->{d.preempted[1]}")
    return "\n".join(lines)


def _sec(value: int | None) -> float | None:
    return None if value is None else value / 1e9


def _s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:+.1f}ms" if abs(seconds) < 1 else f"{seconds:+.2f}s"
