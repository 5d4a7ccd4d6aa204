"""One fleet row per engine: what the table shows, built off the UI thread from what the engine sent.

An event engine's row reads the same `DashboardModel` its full dashboard folds (so the two agree) and
`StepStats`, the few things the table needs beyond it: preemptions since the fleet joined, inter-token
gaps, and each recent step's duration and longest prefill chunk (what the pace check reads). A scraped
engine's row reads its `EngineView` (the last interval): "what binds admission" needs events there and
is "—".
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from batchtop.telemetry.events import (
    PrefillChunk,
    RequestPreempted,
    RequestRetired,
    RequestRetracted,
    StepFinished,
    StepPlanned,
)
from batchtop.telemetry.run_stats import percentile

LATENCY_WINDOW_S = 10.0          # TTFT / ITL p50 over the samples of the last 10 s (as the dashboard's plots)
MAX_SAMPLES = 2048
MAX_STEPS = 256                  # recent steps kept per engine for the pace check
MAX_TRACKED = 4096               # requests whose last token time is kept for the ITL
NO_EVENTS = "—"


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One finished step of one engine: when it was planned and finished (the engine's clock), and its
    longest prefill chunk (request id, tokens; "" and 0 when it had none)."""
    step: int
    start_t: float
    end_t: float
    chunk_request_id: str = ""
    chunk_tokens: int = 0

    @property
    def duration_s(self) -> float:
        return self.end_t - self.start_t


class StepStats:
    """Folded from the same events as the dashboard's model, on the engine's poll thread."""

    def __init__(self) -> None:
        self.num_preemptions = 0
        self.itl: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)     # (t, seconds)
        self.steps: deque[StepRecord] = deque(maxlen=MAX_STEPS)
        self._last_token_t: dict[str, float] = {}
        self._planned: tuple[int, float] | None = None
        self._chunk: tuple[str, int] = ("", 0)

    def feed(self, events) -> None:
        for e in events:
            kind = type(e)
            if kind is StepPlanned:
                self._planned, self._chunk = (e.step, e.t), ("", 0)
            elif kind is PrefillChunk:
                if e.num_tokens > self._chunk[1]:
                    self._chunk = (e.request_id, e.num_tokens)
            elif kind is StepFinished:
                self._finished(e)
            elif kind is RequestPreempted or kind is RequestRetracted:
                self.num_preemptions += 1
            elif kind is RequestRetired:
                self._last_token_t.pop(e.request_id, None)

    def _finished(self, e: StepFinished) -> None:
        last = self._last_token_t
        for request_id in e.sampled_request_ids:
            before = last.get(request_id)
            if before is not None:
                self.itl.append((e.t, e.t - before))
            last[request_id] = e.t
        while len(last) > MAX_TRACKED:
            last.pop(next(iter(last)))
        if self._planned is not None and self._planned[0] == e.step:
            self.steps.append(StepRecord(e.step, self._planned[1], e.t, *self._chunk))
        self._planned = None


@dataclass(frozen=True)
class FleetRow:
    """One engine as the fleet table shows it; None where the engine does not tell."""
    name: str
    url: str
    kind: str = "?"                      # batchtop serve | batchtop-in-vLLM | vLLM | SGLang
    mode: str = ""                       # live (event stream) | scraped (/metrics)
    state: str = "connecting"            # live | paused | down | connecting
    reason: str = ""                     # why it is down, or the last command's answer
    data_at: float | None = None         # when its newest data arrived (this process's monotonic clock)
    newest_t: float | None = None        # the newest event's own time (the engine's clock)
    running: float | None = None
    waiting: float | None = None
    kv_pct: float | None = None
    binds: str = NO_EVENTS
    tok_s: float | None = None
    steps_s: float | None = None
    preemptions: float | None = None
    ttft_p50: float | None = None
    itl_p50: float | None = None
    knobs: dict = field(default_factory=dict)
    rank: int | None = None

    def age_s(self, now: float) -> float | None:
        return None if self.data_at is None else max(0.0, now - self.data_at)


def p50(samples, now: float | None) -> float | None:
    """The median of the (t, value) samples of the last LATENCY_WINDOW_S before `now` (all when None)."""
    xs = sorted(v for t, v in samples if now is None or now - LATENCY_WINDOW_S < t <= now)
    return percentile(xs, 50) if xs else None


def binds_text(admission) -> str:
    """What holds the head of the queue back, in a few words ("" while nobody waits)."""
    if admission is None:
        return ""
    reason = admission.reason
    if reason == "budget":
        return f"budget {admission.tokens_left}/{admission.tokens_needed} tok"
    if reason == "max_num_seqs":
        return f"max_num_seqs {admission.limit}"
    if reason == "kv":
        return f"kv {admission.blocks_free}/{admission.blocks_needed} blk"
    if reason in ("static_batch", "dynamic_batch"):
        return f"{reason.replace('_', ' ')} B={admission.limit}"
    return reason


def event_row(base: FleetRow, model, stats: StepStats, now: float | None) -> FleetRow:
    """The row of an event engine from its dashboard model (`now`: the engine's clock, estimated)."""
    rates = model.rates.rates(now)
    return FleetRow(
        name=base.name, url=base.url, kind=base.kind, mode="live", state=base.state, reason=base.reason,
        data_at=base.data_at, newest_t=model.last_t, rank=base.rank, knobs=dict(model.knobs),
        running=model.num_running, waiting=model.num_waiting, kv_pct=model.kv_pct,
        binds=binds_text(model.admission) if model.num_waiting else "",
        tok_s=rates.output_tok_per_s, steps_s=rates.steps_per_s, preemptions=stats.num_preemptions,
        ttft_p50=p50(model.ttft_samples, now), itl_p50=p50(stats.itl, now))


def scraped_row(base: FleetRow, view) -> FleetRow:
    """The row of one engine behind a /metrics scrape (`view`: its EngineView)."""
    latest = view.latest
    last = view.intervals[-1] if view.intervals else None
    latency = last.latency if last is not None else {}
    return FleetRow(
        name=base.name, url=base.url, kind=base.kind, mode="scraped", state=base.state, reason=base.reason,
        data_at=base.data_at, rank=base.rank,
        running=latest.running, waiting=latest.waiting,
        kv_pct=None if latest.kv_usage is None else 100 * latest.kv_usage, binds=NO_EVENTS,
        tok_s=last.gen_tok_s if last else None, steps_s=last.steps_per_s if last else None,
        preemptions=latest.counters.get("preemptions"),
        ttft_p50=latency.get("ttft", (None, None))[0], itl_p50=latency.get("itl", (None, None))[0])
