"""The dashboard's view model: events folded into plain state that widgets render.

`DashboardModel.feed(events)` is the only writer; it runs on the UI thread once per
tick. Everything it keeps is bounded: live requests (MAX_LIVE_REQUESTS), retired ones
(MAX_RETIRED_REQUESTS), per-request timelines, the event log and the plot histories
(deques with maxlen). Widgets read it and never mutate it.

Slots come from RequestAdmitted / RowMoved / RequestRetired / RequestPreempted /
RequestRetracted; a slot's look during the last finished step comes from what its
request did in that step (PrefillChunk → prefill, sampled → decode). Marks such as
"just admitted" belong to the step they happened in and fade when a later step finishes.
KV blocks per request are exact (BlocksAllocated); an EngineSnapshot (asked for after a drop)
resets every live request to the engine's state. Waiting time by reason: exact splits from
RequestAdmitted, and for a request still waiting, a WaitClock driven by AdmissionBlocked.
"""
from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Mapping

from batchtop.telemetry.events import (
    AdmissionBlocked,
    BatchRebuilt,
    BlocksAllocated,
    BlocksCached,
    BlocksEvicted,
    CommandRefused,
    EnginePaused,
    EngineResumed,
    EngineSnapshot,
    Event,
    EventsDropped,
    FirstToken,
    KnobChanged,
    PaddingReleased,
    PrefillChunk,
    RequestAdmitted,
    RequestArrived,
    RequestPreempted,
    RequestRetired,
    RequestRetracted,
    RowMoved,
    StepFailed,
    StepFinished,
    StepPlanned,
)
from batchtop.telemetry.export import wait_line
from batchtop.telemetry.rates import WindowedRates
from batchtop.telemetry.run_stats import percentile
from batchtop.telemetry.wait_clock import NEXT_STEP, WaitClock

from .cache import CacheView

MAX_LIVE_REQUESTS = 4096        # waiting + running tracked one by one; the oldest never-admitted go first
MAX_RETIRED_REQUESTS = 256      # finished requests kept for the table and their timelines
MAX_TIMELINE = 48               # entries per request timeline
MAX_LOG_EVENTS = 2000           # the event log ring
MAX_SLOTS = 4096                # slot grid ceiling, whatever the events claim
HISTORY_BUCKET_S = 0.5          # one plot point per half second of event time
MAX_HISTORY = 1200              # 10 minutes of plot points
MAX_LATENCY_SAMPLES = 1024      # recent (t, TTFT / TPOT) samples behind the percentiles
LATENCY_WINDOW_S = 10.0         # a plot point's latency percentiles: samples of the last 10 s
MAX_KNOB_MARKS = 64
RATE_WINDOW_S = 5.0

# Slot kinds, in legend order: (glyph, style, short label, long label).
SLOT_KINDS: dict[str, tuple[str, str, str, str]] = {
    "decode": ("█", "green", "dec", "decode: one token this step"),
    "prefill": ("▓", "yellow", "pre", "prefill chunk this step"),
    "stalled": ("▒", "bright_black", "idle", "running, no tokens this step"),
    "admitted": ("+", "bold bright_green", "new", "just admitted"),
    "moved": ("↓", "bold magenta", "moved", "just moved by condense"),
    "padding": ("░", "blue", "pad", "padding: finished row of a static batch"),
    "graph": ("▫", "cyan", "graph",
              "graph padding: a row computed only to fill the replayed CUDA graph's size"),
    "retracted": ("×", "bold red", "out", "just preempted or retracted"),
    "hole": ("○", "red", "hole", "hole: free slot below a live row"),
    "free": ("·", "bright_black", "free", "free"),
}

LIVE_STATES = ("waiting", "running", "preempted")


@dataclass(slots=True)
class RequestView:
    """One request as the events told it; times are event `t` (engine monotonic seconds)."""
    request_id: str
    state: str = "waiting"               # waiting | running | preempted | <finish reason>
    slot: int = -1
    num_prompt_tokens: int | None = None
    max_tokens: int | None = None
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    arrival_t: float | None = None
    first_token_t: float | None = None
    finish_t: float | None = None
    ttft_s: float | None = None
    num_preemptions: int = 0
    num_blocks: int = 0
    num_cached_tokens: int = 0           # the prefix cache's tokens at its last admission
    miss_reason: str = ""                # why the rest of its full blocks missed ("" none missed)
    last_chunk_step: int = -1
    last_sample_step: int = -1
    wait_s: dict = field(default_factory=dict)   # finished waits by reason (exact, from RequestAdmitted)
    wait_mark: object = None                     # the model's WaitClock reading when it joined the queue
    timeline: deque = field(default_factory=lambda: deque(maxlen=MAX_TIMELINE))

    @property
    def finished(self) -> bool:
        return self.state not in LIVE_STATES

    def kv_blocks(self) -> int | None:
        """Blocks the request holds (None when not resident)."""
        return self.num_blocks if self.state == "running" else None

    def age_s(self, now: float) -> float | None:
        if self.arrival_t is None:
            return None
        end = self.finish_t if self.finish_t is not None else now
        return max(0.0, end - self.arrival_t)

    def note(self, step: int, t: float, text: str) -> None:
        self.timeline.append((step, t, text))


@dataclass(slots=True)
class HistoryPoint:
    """One plot sample: rates over its bucket, levels at its end, latency percentiles over the
    LATENCY_WINDOW_S before its end."""
    t: float
    out_tok_s: float
    in_tok_s: float
    running: int
    waiting: int
    kv_pct: float
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    hit_tok_pct: float | None = None     # prefix-cache hit rates over the admissions of the last 10 s
    hit_req_pct: float | None = None


@dataclass(slots=True)
class KnobMark:
    t: float
    step: int
    name: str
    old: object
    new: object
    source: str


@dataclass
class DashboardModel:
    knobs: dict = field(default_factory=dict)
    scenarios: Mapping[str, str] = field(default_factory=dict)   # the source's: name -> what to watch
    # header numbers
    step: int = 0                        # newest step number seen in any event
    finished_step: int = 0               # newest StepFinished
    num_running: int = 0
    num_waiting: int = 0
    kv_used: int = 0
    kv_cached: int = 0                   # free blocks holding a cached prefix (evictable)
    kv_total: int = 0
    budget_used: int = 0
    token_budget: int = 0
    num_padding_rows: int = 0
    num_graph_padding_rows: int = 0      # the newest step's CUDA-graph padding (one row per padded token)
    graph_padding_seen: bool = False     # any step was padded: the legend and header then show it
    paused: bool = False
    admission: AdmissionBlocked | None = None   # what stops admission now; None while nobody waits
    last_t: float | None = None
    num_dropped: int = 0
    message: str = ""                    # latest refusal or knob change, for the status line

    def __post_init__(self):
        self.live: dict[str, RequestView] = {}
        self.retired: OrderedDict[str, RequestView] = OrderedDict()
        self.slots: list[str | None] = []
        self.marks: dict[int, tuple[str, int]] = {}          # slot -> (kind, step)
        self.padding_slots: list[int] = []                     # static batch: finished rows still computed
        self.log: deque[Event] = deque(maxlen=MAX_LOG_EVENTS)
        self.history: deque[HistoryPoint] = deque(maxlen=MAX_HISTORY)
        self.knob_marks: deque[KnobMark] = deque(maxlen=MAX_KNOB_MARKS)
        self.ttft_samples: deque[tuple[float, float]] = deque(maxlen=MAX_LATENCY_SAMPLES)   # (t, seconds)
        self.tpot_samples: deque[tuple[float, float]] = deque(maxlen=MAX_LATENCY_SAMPLES)
        self.rates = WindowedRates(RATE_WINDOW_S)
        self.cache = CacheView()
        self.wait_clock = WaitClock()
        self._bucket_end: float | None = None
        self._bucket_out = 0
        self._bucket_in = 0
        self._handlers = {
            StepPlanned: self._on_planned, StepFinished: self._on_finished,
            RequestArrived: self._on_arrived, RequestAdmitted: self._on_admitted,
            PrefillChunk: self._on_chunk, FirstToken: self._on_first_token,
            RequestRetired: self._on_retired, RowMoved: self._on_moved,
            RequestPreempted: self._on_preempted, RequestRetracted: self._on_retracted,
            KnobChanged: self._on_knob, CommandRefused: self._on_refused,
            EnginePaused: self._on_paused, EngineResumed: self._on_resumed,
            EventsDropped: self._on_dropped, BatchRebuilt: None, StepFailed: self._on_step_failed,
            BlocksAllocated: self._on_blocks, PaddingReleased: self._on_padding_released,
            AdmissionBlocked: self._on_blocked, EngineSnapshot: self._on_snapshot,
            BlocksCached: self.cache.feed_cached, BlocksEvicted: self.cache.feed_evicted,
        }

    # -- folding ---------------------------------------------------------------------------

    def feed(self, events: list[Event]) -> None:
        """Fold a batch of events (oldest first). Replaying backwards means a fresh model."""
        handlers = self._handlers
        log = self.log
        for event in events:
            t = event.t
            if self._bucket_end is None:
                self._bucket_end = t + HISTORY_BUCKET_S
            elif t >= self._bucket_end:
                self._close_buckets(t)
            if event.step > self.step:
                self.step = event.step
            self.last_t = t
            handler = handlers.get(type(event))
            if handler is not None:
                handler(event)
            log.append(event)
        self.rates.feed(events)

    def advance(self, now: float) -> None:
        """Close the plot buckets that ended before `now` (an idle engine still draws a flat line)."""
        if self._bucket_end is not None and now >= self._bucket_end:
            self._close_buckets(now)

    def _close_buckets(self, t: float) -> None:
        """Emit one point per finished bucket up to `t`; a long gap emits zero-rate points."""
        while t >= self._bucket_end:
            hit_tok, hit_req = self.cache.hit_rates(self._bucket_end)
            self.history.append(HistoryPoint(
                self._bucket_end, self._bucket_out / HISTORY_BUCKET_S, self._bucket_in / HISTORY_BUCKET_S,
                self.num_running, self.num_waiting, self.kv_pct,
                *_p50_p99(self.ttft_samples, self._bucket_end),
                *_p50_p99(self.tpot_samples, self._bucket_end),
                _pct(hit_tok), _pct(hit_req)))
            self._bucket_out = self._bucket_in = 0
            self._bucket_end += HISTORY_BUCKET_S
            if t - self._bucket_end > HISTORY_BUCKET_S * MAX_HISTORY:
                # Skip whole empty buckets that would fall out of the history anyway.
                self._bucket_end = t - HISTORY_BUCKET_S * MAX_HISTORY

    def _request(self, request_id: str) -> RequestView:
        """The live view of `request_id`, created when events were lost or it was evicted."""
        req = self.live.get(request_id)
        if req is None:
            req = self.live[request_id] = RequestView(request_id)
            self._bound_live()
        return req

    def _bound_live(self) -> None:
        if len(self.live) <= MAX_LIVE_REQUESTS:
            return
        for request_id, req in self.live.items():
            if req.state == "waiting" and req.slot < 0:
                del self.live[request_id]
                return
        self.live.pop(next(iter(self.live)))

    def _on_planned(self, e: StepPlanned) -> None:
        self.num_running, self.num_waiting = e.num_running, e.num_waiting
        self.kv_used, self.kv_cached, self.kv_total = e.kv_blocks_used, e.kv_blocks_cached, e.kv_blocks_total
        self.budget_used = e.prefill_tokens + e.recompute_tokens + e.decode_tokens
        self.token_budget = e.token_budget
        self.num_padding_rows = e.num_padding_rows
        if not e.num_waiting:
            self._admission_open(e.t)

    def _admission_open(self, t: float) -> None:
        if self.admission is not None:
            self.admission = None
            self.wait_clock.set(t, NEXT_STEP)

    def _on_finished(self, e: StepFinished) -> None:
        self.finished_step = e.step
        self.num_graph_padding_rows = e.num_padded_tokens
        self.graph_padding_seen = self.graph_padding_seen or e.num_padded_tokens > 0
        self.num_running, self.num_waiting = e.num_running, e.num_waiting
        self.kv_used, self.kv_cached, self.kv_total = e.kv_blocks_used, e.kv_blocks_cached, e.kv_blocks_total
        step = e.step
        live = self.live
        for request_id in e.sampled_request_ids:
            req = live.get(request_id)
            if req is None:
                done = self.retired.get(request_id)
                if done is not None:                  # it sampled its last token and retired this step
                    if done.last_chunk_step != step and done.last_sample_step != step:
                        done.num_computed_tokens += 1     # that last step was a decode row
                        done.last_sample_step = step
                    continue
                req = self._request(request_id)
            if req.last_chunk_step != step:
                req.num_computed_tokens += 1          # a decode row computed its last token
            req.num_output_tokens += 1
            req.last_sample_step = step
        self._bucket_out += len(e.sampled_request_ids)

    def _on_arrived(self, e: RequestArrived) -> None:
        req = self._request(e.request_id)
        req.num_prompt_tokens, req.max_tokens, req.arrival_t = e.num_prompt_tokens, e.max_tokens, e.arrival_t
        req.wait_mark = self.wait_clock.mark(e.t)
        req.note(e.step, e.t, f"arrived: {e.num_prompt_tokens} prompt tokens, max {e.max_tokens}")

    def _on_admitted(self, e: RequestAdmitted) -> None:
        req = self._request(e.request_id)
        req.state, req.slot = "running", e.slot
        req.num_computed_tokens = e.num_computed_tokens
        req.num_cached_tokens, req.miss_reason = e.num_cached_tokens, e.miss_reason
        self.cache.feed_admitted(e)
        req.wait_mark = None
        for reason, seconds in zip(e.wait_reasons, e.wait_s):
            req.wait_s[reason] = req.wait_s.get(reason, 0.0) + seconds
        self._occupy(e.slot, e.request_id)
        self.marks[e.slot] = ("admitted", e.step)
        if e.slot in self.padding_slots:
            self.padding_slots.remove(e.slot)
        waited = f" after waiting {wait_line(dict(zip(e.wait_reasons, e.wait_s)))}" if e.wait_s else ""
        req.note(e.step, e.t, f"{'resumed' if e.resumed else 'admitted'} into slot {e.slot}{waited}")
        if e.num_known_tokens:
            req.note(e.step, e.t, cache_line(e))

    def _on_blocks(self, e: BlocksAllocated) -> None:
        self._request(e.request_id).num_blocks = e.num_blocks

    def _on_padding_released(self, e: PaddingReleased) -> None:
        if e.slot in self.padding_slots:
            self.padding_slots.remove(e.slot)

    def _on_blocked(self, e: AdmissionBlocked) -> None:
        self.admission = e
        self.wait_clock.set(e.t, e.reason)

    def _on_snapshot(self, e: EngineSnapshot) -> None:
        """The engine's state: live requests and slots start again from it."""
        live, self.live = self.live, {}
        self.slots, self.padding_slots = [], []
        mark = self.wait_clock.mark(e.t)
        for request_id, status, slot, prompt, output, computed, blocks, max_tokens in zip(
                e.request_ids, e.statuses, e.slots, e.num_prompt_tokens, e.num_output_tokens,
                e.num_computed_tokens, e.num_blocks, e.max_tokens):
            if status == "padding":
                self.padding_slots.append(slot)
                continue
            req = live.get(request_id) or self.retired.pop(request_id, None) or RequestView(request_id)
            self.live[request_id] = req
            req.state, req.slot, req.num_blocks = status, slot, blocks
            req.num_prompt_tokens, req.max_tokens = prompt, max_tokens
            req.num_computed_tokens, req.num_output_tokens = computed, output
            if status == "running":
                self._occupy(slot, request_id)
                req.wait_mark = None
            elif req.wait_mark is None:
                req.wait_mark = mark
        self.kv_used, self.kv_cached, self.kv_total = e.kv_blocks_used, e.kv_blocks_cached, e.kv_blocks_total
        self.message = f"state resynchronised from a snapshot ({e.cause}) at step {e.step}"

    def waited(self, req: RequestView, now: float) -> dict[str, float]:
        """Seconds `req` has waited in the queue by reason, its current wait included."""
        if req.wait_mark is None or req.finished:
            return req.wait_s
        reasons, seconds = self.wait_clock.split(req.wait_mark, max(now, req.wait_mark.t))
        out = dict(req.wait_s)
        for reason, s in zip(reasons, seconds):
            out[reason] = out.get(reason, 0.0) + s
        return out

    def _on_chunk(self, e: PrefillChunk) -> None:
        req = self._request(e.request_id)
        req.num_computed_tokens = e.num_computed_tokens
        req.last_chunk_step = e.step
        self._bucket_in += e.num_tokens
        req.note(e.step, e.t, f"chunk {e.num_tokens} tokens ({e.num_computed_tokens}/{e.num_known_tokens})")

    def _on_first_token(self, e: FirstToken) -> None:
        req = self._request(e.request_id)
        if req.first_token_t is None:
            req.first_token_t, req.ttft_s = e.t, e.ttft_s
            self.ttft_samples.append((e.t, e.ttft_s))
            req.note(e.step, e.t, f"first token, TTFT {e.ttft_s * 1000:.0f} ms")

    def _on_retired(self, e: RequestRetired) -> None:
        req = self.live.pop(e.request_id, None) or self.retired.pop(e.request_id, None) \
            or RequestView(e.request_id)
        req.state, req.finish_t = e.reason, e.t
        req.num_output_tokens = e.num_output_tokens
        req.num_blocks, req.wait_mark = e.num_blocks, None
        for reason, seconds in zip(e.wait_reasons, e.wait_s):
            req.wait_s[reason] = req.wait_s.get(reason, 0.0) + seconds
        if req.num_prompt_tokens is None:
            req.num_prompt_tokens = e.num_prompt_tokens
        if req.first_token_t is not None and e.num_output_tokens >= 2:
            self.tpot_samples.append((e.t, (e.t - req.first_token_t) / (e.num_output_tokens - 1)))
        if e.slot >= 0:
            self._vacate(e.slot, e.request_id)
            if e.num_blocks:           # a static batch keeps computing it until its longest row is done
                self.padding_slots.append(e.slot)
        req.slot = -1
        req.note(e.step, e.t, f"retired: {e.reason}, {e.num_output_tokens} output tokens")
        self._keep_retired(req)

    def _keep_retired(self, req: RequestView) -> None:
        self.retired[req.request_id] = req
        while len(self.retired) > MAX_RETIRED_REQUESTS:
            self.retired.popitem(last=False)

    def _on_moved(self, e: RowMoved) -> None:
        req = self._request(e.request_id)
        self._vacate(e.from_slot, e.request_id)
        self._occupy(e.to_slot, e.request_id)
        req.slot = e.to_slot
        self.marks[e.to_slot] = ("moved", e.step)
        req.note(e.step, e.t, f"moved slot {e.from_slot} → {e.to_slot} ({e.num_bytes} B)")

    def _evict(self, request_id: str, slot: int, state: str, step: int, t: float, text: str) -> RequestView:
        req = self._request(request_id)
        if slot >= 0:
            self._vacate(slot, request_id)
            self.marks[slot] = ("retracted", step)
        req.state, req.slot = state, -1
        req.num_computed_tokens = req.num_blocks = 0
        req.num_preemptions += 1
        req.wait_mark = self.wait_clock.mark(t)
        req.note(step, t, text)
        return req

    def _on_preempted(self, e: RequestPreempted) -> None:
        self._evict(e.request_id, e.slot, "preempted", e.step, e.t,
                    f"preempted from slot {e.slot}: {e.blocks_freed} blocks freed, "
                    f"{e.tokens_to_recompute} to recompute ({e.reason})")

    def _on_retracted(self, e: RequestRetracted) -> None:
        self._evict(e.request_id, e.slot, "preempted", e.step, e.t,
                    f"retracted from slot {e.slot}: {e.blocks_freed} blocks freed, "
                    f"new-token ratio {e.new_token_ratio:.2f}")

    def _on_knob(self, e: KnobChanged) -> None:
        self.knobs[e.name] = e.new
        self.knob_marks.append(KnobMark(e.t, e.step, e.name, e.old, e.new, e.source))
        if e.name == "scenario" and e.new in self.scenarios:
            self.message = f"scenario {e.new}: {self.scenarios[e.new]}"
        else:
            self.message = f"{e.name}: {e.old} → {e.new} ({e.source})"

    def _on_refused(self, e: CommandRefused) -> None:
        self.message = f"refused {e.command}: {e.message}"

    def _on_step_failed(self, e: StepFailed) -> None:
        self.message = f"step {e.step} failed: {e.error}"

    def _on_paused(self, e: EnginePaused) -> None:
        self.paused = True
        self.wait_clock.set(e.t, "paused")

    def _on_resumed(self, e: EngineResumed) -> None:
        self.paused = False
        self.admission = None
        self.wait_clock.set(e.t, NEXT_STEP)

    def _on_dropped(self, e: EventsDropped) -> None:
        self.num_dropped += e.count
        self.message = f"{e.count} events dropped: per-request state may be stale"

    # -- slots -------------------------------------------------------------------------------

    def _occupy(self, slot: int, request_id: str) -> None:
        if not 0 <= slot < MAX_SLOTS:
            return
        if slot >= len(self.slots):
            self.slots.extend([None] * (slot + 1 - len(self.slots)))
        self.slots[slot] = request_id

    def _vacate(self, slot: int, request_id: str) -> None:
        if 0 <= slot < len(self.slots) and self.slots[slot] == request_id:
            self.slots[slot] = None

    def slot_kind(self, slot: int) -> tuple[str, str | None]:
        """(kind, request id) of `slot` as of the newest step."""
        request_id = self.slots[slot] if slot < len(self.slots) else None
        mark = self.marks.get(slot)
        if mark is not None and mark[1] >= self.finished_step:
            if request_id is not None or mark[0] == "retracted":
                return mark[0], request_id
        if request_id is None:
            if slot in self.padding_slots:
                return "padding", None
            if slot < self.num_occupied_span:
                return "hole", None
            return ("graph", None) if slot in self.graph_padding_cells() else ("free", None)
        req = self.live.get(request_id)
        if req is None:
            return "decode", request_id
        step = self.finished_step
        if req.last_chunk_step == step:
            return "prefill", request_id
        if req.last_sample_step == step:
            return "decode", request_id
        return "stalled", request_id

    @property
    def num_occupied_span(self) -> int:
        """One past the highest occupied slot: free slots below it are holes."""
        for slot in range(len(self.slots) - 1, -1, -1):
            if self.slots[slot] is not None:
                return slot + 1
        return 0

    def graph_padding_cells(self) -> range:
        """The cells drawn as the newest step's CUDA-graph padding: as many as it padded, after the batch's
        rows (a graph pads the batch's row order, not its slots, so these stand for rows, not slots)."""
        start = max(self.num_occupied_span, max(self.padding_slots, default=-1) + 1)
        return range(start, start + self.num_graph_padding_rows)

    def num_grid_slots(self) -> int:
        max_seqs = self.knobs.get("max_num_seqs")
        base = max_seqs if isinstance(max_seqs, int) else 0
        return min(MAX_SLOTS, max(base, len(self.slots), max(self.padding_slots, default=-1) + 1,
                                  self.graph_padding_cells().stop))

    # -- derived numbers -------------------------------------------------------------------

    @property
    def kv_pct(self) -> float:
        return 100.0 * self.kv_used / self.kv_total if self.kv_total else 0.0

    @property
    def budget_pct(self) -> float:
        return 100.0 * self.budget_used / self.token_budget if self.token_budget else 0.0

    @property
    def num_preempted(self) -> int:
        return sum(1 for r in self.live.values() if r.state == "preempted")

    def request(self, request_id: str) -> RequestView | None:
        return self.live.get(request_id) or self.retired.get(request_id)

    def requests(self, include_finished: bool = True) -> list[RequestView]:
        rows = list(self.live.values())
        if include_finished:
            rows.extend(self.retired.values())
        return rows

    def running_blocks(self) -> list[tuple[str, int]]:
        """(request id, KV blocks) of the running requests, largest first."""
        out = [(r.request_id, r.num_blocks) for r in self.live.values() if r.state == "running"]
        out.sort(key=lambda item: (-item[1], item[0]))
        return out


def cache_line(e: RequestAdmitted) -> str:
    """What the prefix cache gave an admitted request, and why the rest missed, in words."""
    text = f"prefix cache: {e.num_cached_tokens}/{e.num_known_tokens} tokens cached"
    if e.num_full_blocks:
        text += f" ({e.num_hit_blocks}/{e.num_full_blocks} full blocks)"
    reason = e.miss_reason
    if reason == "below_block":
        text += f"; missed: below_block ({e.num_matched_tokens} tokens shared, less than a block)"
    elif reason == "evicted":
        text += f"; missed: evicted {fmt_seconds(e.evicted_ago_s)} ago"
    elif reason:
        text += f"; missed: {reason}"
    return text


def _pct(value: float | None) -> float | None:
    return None if value is None else 100.0 * value


def _p50_p99(samples, end: float) -> tuple[float | None, float | None]:
    """Percentiles of the samples taken in the LATENCY_WINDOW_S before `end`."""
    xs = sorted(v for t, v in samples if end - LATENCY_WINDOW_S < t <= end)
    if not xs:
        return None, None
    return percentile(xs, 50), percentile(xs, 99)


SHORT_MISSES = {"no_prefix": "new", "below_block": "<blk", "evicted": "evict", "partial": "part",
                "disabled": "off", "": ""}
SHORT_REASONS = {"budget": "budget", "max_num_seqs": "seqs", "kv": "kv", "static_batch": "static",
                 "dynamic_batch": "dyn", "preemption": "preempt", "paused": "paused", "next_step": "step"}


def fmt_seconds(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "-"
    if value < 1.0:
        return f"{value * 1000:.0f}ms"
    if value < 100:
        return f"{value:.1f}s"
    return f"{value:.0f}s"


def fmt_rate(value: float) -> str:
    if value >= 1000:
        return f"{value / 1000:.1f}k"
    return f"{value:.0f}" if value >= 10 or value == 0 else f"{value:.1f}"
