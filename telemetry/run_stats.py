"""Serving metrics derived from the event stream alone.

`Metrics` accumulates over a whole run (feed it any number of batches, then
ask for `summary()`); `rates.WindowedRates` answers "how fast over the last N
seconds" for a live dashboard. Definitions (also in docs/events.md):

- span: last event time - first event time fed.
- output tokens: one per request id in StepFinished.sampled_request_ids
  (= useful row-steps); prompt tokens: num_prompt_tokens of each request whose
  FirstToken was seen (its prompt was fully computed), known from its
  RequestArrived or, failing that, its RequestRetired. Throughput = tokens / span.
- TTFT: FirstToken.ttft_s. TPOT per request with >= 2 output tokens:
  (RequestRetired.t - FirstToken.t) / (num_output_tokens - 1).
  ITL: gaps between consecutive StepFinished.t in which the request sampled.
  E2E: RequestRetired.t - RequestArrived.arrival_t (its t less since_arrival_s).
- batch utilisation: sum len(sampled_request_ids) / sum StepFinished.num_rows.
- peak KV: the largest StepFinished.kv_blocks_used / kv_blocks_total.
- recompute tax: sum tokens_to_recompute (preempted + retracted)
  / sum StepFinished.num_tokens.
- percentiles: linear interpolation between closest ranks (numpy's default,
  Excel's PERCENTILE.INC): p of sorted x[0..n-1] sits at rank (n-1)*p/100.
"""
from __future__ import annotations

import math
from array import array
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

from .events import (
    Event,
    EventsDropped,
    FirstToken,
    RequestAdmitted,
    RequestArrived,
    RequestPreempted,
    RequestRetired,
    RequestRetracted,
    StepFinished,
)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile `q` (0..100) of an ascending, non-empty sequence."""
    if not sorted_values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be within 0..100, got {q}")
    rank = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = rank - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


@dataclass(frozen=True)
class Distribution:
    """count, mean and percentiles of one latency metric, in seconds (None when count == 0)."""
    count: int
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    min: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, values: Iterable[float]) -> Distribution:
        xs = sorted(values)
        if not xs:
            return cls(0)
        return cls(len(xs), math.fsum(xs) / len(xs), percentile(xs, 50), percentile(xs, 90),
                   percentile(xs, 99), xs[0], xs[-1])


@dataclass(slots=True)
class RequestRecord:
    """What the events said about one request (times are event `t`, None when unseen)."""
    request_id: str
    arrival_t: float | None = None
    admitted_t: float | None = None          # first admission
    first_token_t: float | None = None
    ttft_s: float | None = None
    finished_t: float | None = None
    reason: str | None = None
    num_prompt_tokens: int | None = None
    num_output_tokens: int | None = None     # from RequestRetired
    num_sampled: int = 0                     # tokens seen in sampled_request_ids
    num_preemptions: int = 0
    num_retractions: int = 0
    last_sample_t: float | None = None
    prompt_counted: bool = False             # its prompt tokens are in Metrics.num_prompt_tokens
    wait_s: dict[str, float] = field(default_factory=dict)   # queue time by reason, over all its waits

    @property
    def queue_s(self) -> float:
        return sum(self.wait_s.values())

    @property
    def tpot_s(self) -> float | None:
        n = self.num_output_tokens
        if n is None or n < 2 or self.finished_t is None or self.first_token_t is None:
            return None
        return (self.finished_t - self.first_token_t) / (n - 1)

    @property
    def e2e_s(self) -> float | None:
        if self.finished_t is None or self.arrival_t is None:
            return None
        return self.finished_t - self.arrival_t


@dataclass(frozen=True)
class MetricsSummary:
    span_s: float
    num_events: int
    num_events_dropped: int           # > 0: the stream was lossy, figures are lower bounds
    num_steps: int
    row_steps_total: int
    row_steps_useful: int
    batch_utilisation: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    throughput_in_tok_s: float | None
    throughput_out_tok_s: float | None
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    num_preemptions: int
    num_retractions: int
    tokens_recomputed: int
    tokens_computed: int
    recompute_tax: float | None
    num_arrived: int
    num_finished: int
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    wait_s_by_reason: dict[str, float] = field(default_factory=dict)   # request-seconds queued, by reason
    peak_kv: float | None = None      # the largest share of the KV pool in use at a step's end
    prefix_hit_share: float | None = None   # of the tokens admissions looked up (resumed ones too), cached

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> MetricsSummary:
        """The summary `to_dict` wrote (sent between processes)."""
        latencies = {name: Distribution(**data[name]) for name in ("ttft", "tpot", "itl", "e2e")}
        return cls(**{**data, **latencies})


class Metrics:
    """Run-long accumulator: `feed(events)` as often as you like, `summary()` any time.

    Memory: one RequestRecord per request and one float (8 bytes) per sampled
    token for the ITL distribution.
    """

    def __init__(self) -> None:
        self.requests: dict[str, RequestRecord] = {}
        self.num_events = 0
        self.num_events_dropped = 0
        self.first_t: float | None = None
        self.last_t: float | None = None
        self.num_steps = 0
        self.row_steps_total = 0
        self.row_steps_useful = 0
        self.tokens_computed = 0
        self.tokens_recomputed = 0
        self.num_prompt_tokens = 0
        self.num_preemptions = 0
        self.num_retractions = 0
        self.finished_by_reason: Counter[str] = Counter()
        self.wait_s_by_reason: dict[str, float] = {}
        self.peak_kv: float | None = None
        self.tokens_looked_up = 0          # admissions' known tokens, where the engine caches prefixes
        self.tokens_cached = 0             # ... and those the prefix cache held
        self._ttft = array("d")
        self._tpot = array("d")
        self._itl = array("d")
        self._e2e = array("d")
        self._handlers = {
            StepFinished: self._on_step_finished,
            RequestArrived: self._on_arrived,
            RequestAdmitted: self._on_admitted,
            FirstToken: self._on_first_token,
            RequestRetired: self._on_retired,
            RequestPreempted: self._on_preempted,
            RequestRetracted: self._on_retracted,
            EventsDropped: self._on_dropped,
        }

    def feed(self, events: Iterable[Event]) -> None:
        handlers = self._handlers
        for event in events:
            self.num_events += 1
            t = event.t
            if self.first_t is None or t < self.first_t:
                self.first_t = t
            if self.last_t is None or t > self.last_t:
                self.last_t = t
            handler = handlers.get(type(event))
            if handler is not None:
                handler(event)

    def add(self, event: Event) -> None:
        self.feed((event,))

    def _record(self, request_id: str) -> RequestRecord:
        rec = self.requests.get(request_id)
        if rec is None:
            rec = self.requests[request_id] = RequestRecord(request_id)
        return rec

    def _on_step_finished(self, e: StepFinished) -> None:
        self.num_steps += 1
        self.row_steps_total += e.num_rows
        self.row_steps_useful += len(e.sampled_request_ids)
        self.tokens_computed += e.num_tokens
        if e.kv_blocks_total:
            share = e.kv_blocks_used / e.kv_blocks_total
            if self.peak_kv is None or share > self.peak_kv:
                self.peak_kv = share
        t = e.t
        for request_id in e.sampled_request_ids:
            rec = self._record(request_id)
            if rec.last_sample_t is not None:
                self._itl.append(t - rec.last_sample_t)
            rec.last_sample_t = t
            rec.num_sampled += 1

    def _on_arrived(self, e: RequestArrived) -> None:
        rec = self._record(e.request_id)
        rec.arrival_t = e.arrival_t
        rec.num_prompt_tokens = e.num_prompt_tokens

    def _on_admitted(self, e: RequestAdmitted) -> None:
        if e.miss_reason != "disabled":
            self.tokens_looked_up += e.num_known_tokens
            self.tokens_cached += e.num_cached_tokens
        rec = self._record(e.request_id)
        if rec.admitted_t is None:
            rec.admitted_t = e.t
        self._waited(rec, e)

    def _waited(self, rec: RequestRecord, e: RequestAdmitted | RequestRetired) -> None:
        for reason, seconds in zip(e.wait_reasons, e.wait_s):
            rec.wait_s[reason] = rec.wait_s.get(reason, 0.0) + seconds
            self.wait_s_by_reason[reason] = self.wait_s_by_reason.get(reason, 0.0) + seconds

    def _on_first_token(self, e: FirstToken) -> None:
        rec = self._record(e.request_id)
        if rec.first_token_t is not None:
            return                      # only the first one counts
        rec.first_token_t = e.t
        rec.ttft_s = e.ttft_s
        self._ttft.append(e.ttft_s)
        self._count_prompt(rec)

    def _count_prompt(self, rec: RequestRecord) -> None:
        if not rec.prompt_counted and rec.num_prompt_tokens is not None:
            self.num_prompt_tokens += rec.num_prompt_tokens
            rec.prompt_counted = True

    def _on_retired(self, e: RequestRetired) -> None:
        rec = self._record(e.request_id)
        rec.finished_t = e.t
        rec.reason = e.reason
        rec.num_output_tokens = e.num_output_tokens
        self._waited(rec, e)
        if rec.num_prompt_tokens is None:
            rec.num_prompt_tokens = e.num_prompt_tokens
        if rec.first_token_t is not None:
            self._count_prompt(rec)
        self.finished_by_reason[e.reason] += 1
        tpot = rec.tpot_s
        if tpot is not None:
            self._tpot.append(tpot)
        e2e = rec.e2e_s
        if e2e is not None:
            self._e2e.append(e2e)

    def _on_preempted(self, e: RequestPreempted) -> None:
        self.num_preemptions += 1
        self.tokens_recomputed += e.tokens_to_recompute
        self._record(e.request_id).num_preemptions += 1

    def _on_retracted(self, e: RequestRetracted) -> None:
        self.num_retractions += 1
        self.tokens_recomputed += e.tokens_to_recompute
        self._record(e.request_id).num_retractions += 1

    def _on_dropped(self, e: EventsDropped) -> None:
        self.num_events_dropped += e.count

    @property
    def span_s(self) -> float:
        if self.first_t is None or self.last_t is None:
            return 0.0
        return self.last_t - self.first_t

    def summary(self) -> MetricsSummary:
        span = self.span_s
        num_output = self.row_steps_useful
        return MetricsSummary(
            span_s=span,
            num_events=self.num_events,
            num_events_dropped=self.num_events_dropped,
            num_steps=self.num_steps,
            row_steps_total=self.row_steps_total,
            row_steps_useful=self.row_steps_useful,
            batch_utilisation=_ratio(self.row_steps_useful, self.row_steps_total),
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=num_output,
            throughput_in_tok_s=_ratio(self.num_prompt_tokens, span),
            throughput_out_tok_s=_ratio(num_output, span),
            ttft=Distribution.of(self._ttft),
            tpot=Distribution.of(self._tpot),
            itl=Distribution.of(self._itl),
            e2e=Distribution.of(self._e2e),
            num_preemptions=self.num_preemptions,
            num_retractions=self.num_retractions,
            tokens_recomputed=self.tokens_recomputed,
            tokens_computed=self.tokens_computed,
            recompute_tax=_ratio(self.tokens_recomputed, self.tokens_computed),
            num_arrived=sum(1 for r in self.requests.values() if r.arrival_t is not None),
            num_finished=sum(self.finished_by_reason.values()),
            finished_by_reason=dict(self.finished_by_reason),
            wait_s_by_reason=dict(self.wait_s_by_reason),
            peak_kv=self.peak_kv,
            prefix_hit_share=_ratio(self.tokens_cached, self.tokens_looked_up),
        )


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def summarize(events: Iterable[Event]) -> MetricsSummary:
    metrics = Metrics()
    metrics.feed(events)
    return metrics.summary()
