"""The engine's request state, folded from events alone.

`BatchState` starts either at the beginning of a run (`synced=True`: nothing has happened yet)
or anywhere else, unsynced, and then holds nothing until an `EngineSnapshot` arrives. From a
snapshot on, folding every following event keeps it equal to the engine's own state: per
request its status, slot, computed and output tokens and KV blocks. An `EventsDropped` makes
it unsynced again until the next snapshot (ask the engine for one).

What each event does (docs/events.md):
- RequestArrived: a waiting request; RequestAdmitted: running in `slot`;
- BlocksAllocated: its blocks; PrefillChunk: its computed tokens;
- StepFinished: every sampled running request got one output token; one that had no chunk in
  that step was a decode row, which computed one token;
- RowMoved: a new slot; RequestPreempted / RequestRetracted: back to the queue, nothing computed,
  no blocks;
- RequestRetired: gone, unless it keeps blocks (a static batch's padding row) until PaddingReleased;
- StepPlanned / StepFinished / EngineSnapshot: the pool split into used, cached (evictable) and
  free blocks (`pool`), which must add up to the total.
"""
from __future__ import annotations

from dataclasses import dataclass

from batchtop.telemetry import events as ev


@dataclass(slots=True)
class RequestState:
    status: str                  # waiting | preempted | running | padding
    slot: int = -1
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_computed_tokens: int = 0
    num_blocks: int = 0
    max_tokens: int = 0
    chunk_step: int = -1         # the step of its last PrefillChunk

    def key(self) -> tuple:
        """What must equal the engine's own state."""
        return (self.status, self.slot, self.num_computed_tokens, self.num_output_tokens, self.num_blocks)


class BatchState:
    def __init__(self, synced: bool = True):
        self.synced = synced
        self.requests: dict[str, RequestState] = {}
        self.num_snapshots = 0
        self.pool: tuple[int, int, int] | None = None     # (used, cached, total) blocks, as last seen
        self._handlers = {
            ev.RequestArrived: self._arrived, ev.RequestAdmitted: self._admitted,
            ev.BlocksAllocated: self._allocated, ev.PrefillChunk: self._chunk,
            ev.StepPlanned: self._planned, ev.StepFinished: self._finished,
            ev.RowMoved: self._moved, ev.RequestPreempted: self._evicted,
            ev.RequestRetracted: self._evicted, ev.RequestRetired: self._retired,
            ev.PaddingReleased: self._released, ev.EngineSnapshot: self._snapshot,
            ev.EventsDropped: self._dropped,
        }

    def feed(self, events) -> None:
        handlers = self._handlers
        for event in events:
            handler = handlers.get(type(event))
            if handler is not None and (self.synced or handler == self._snapshot):
                handler(event)

    def _arrived(self, e: ev.RequestArrived) -> None:
        self.requests[e.request_id] = RequestState("waiting", num_prompt_tokens=e.num_prompt_tokens,
                                                   max_tokens=e.max_tokens)

    def _admitted(self, e: ev.RequestAdmitted) -> None:
        r = self.requests[e.request_id]
        r.status, r.slot, r.num_computed_tokens = "running", e.slot, e.num_computed_tokens

    def _allocated(self, e: ev.BlocksAllocated) -> None:
        self.requests[e.request_id].num_blocks = e.num_blocks

    def _chunk(self, e: ev.PrefillChunk) -> None:
        r = self.requests[e.request_id]
        r.num_computed_tokens, r.chunk_step = e.num_computed_tokens, e.step

    def _planned(self, e: ev.StepPlanned) -> None:
        self.pool = (e.kv_blocks_used, e.kv_blocks_cached, e.kv_blocks_total)

    def _finished(self, e: ev.StepFinished) -> None:
        self.pool = (e.kv_blocks_used, e.kv_blocks_cached, e.kv_blocks_total)
        requests, step = self.requests, e.step
        for request_id in e.sampled_request_ids:
            r = requests.get(request_id)
            if r is None or r.status != "running":
                continue              # it sampled its last token and retired in this step (counted there)
            self._sampled(r, step)

    @staticmethod
    def _sampled(r: RequestState, step: int) -> None:
        r.num_output_tokens += 1
        if r.chunk_step != step:
            r.num_computed_tokens += 1        # a decode row computes the newest token

    def _moved(self, e: ev.RowMoved) -> None:
        self.requests[e.request_id].slot = e.to_slot

    def _evicted(self, e: ev.RequestPreempted | ev.RequestRetracted) -> None:
        r = self.requests[e.request_id]
        r.status, r.slot, r.num_computed_tokens, r.num_blocks = "preempted", -1, 0, 0

    def _retired(self, e: ev.RequestRetired) -> None:
        r = self.requests.get(e.request_id)
        if r is None:
            return
        if e.reason in ("stop", "length") and r.status == "running":
            self._sampled(r, e.step)          # retired on the token it sampled in this step
        if e.num_blocks:
            r.status, r.num_blocks = "padding", e.num_blocks
        else:
            del self.requests[e.request_id]

    def _released(self, e: ev.PaddingReleased) -> None:
        self.requests.pop(e.request_id, None)

    def _snapshot(self, e: ev.EngineSnapshot) -> None:
        self.requests = {
            request_id: RequestState(status, slot, prompt, output, computed, blocks, max_tokens)
            for request_id, status, slot, prompt, output, computed, blocks, max_tokens in zip(
                e.request_ids, e.statuses, e.slots, e.num_prompt_tokens, e.num_output_tokens,
                e.num_computed_tokens, e.num_blocks, e.max_tokens)}
        self.pool = (e.kv_blocks_used, e.kv_blocks_cached, e.kv_blocks_total)
        self.synced = True
        self.num_snapshots += 1

    def _dropped(self, e: ev.EventsDropped) -> None:
        self.synced = False
        self.requests = {}

    def pool_problems(self) -> list[str]:
        """What breaks the pool's split, in words: used + cached beyond the total, a negative count."""
        if self.pool is None:
            return []
        used, cached, total = self.pool
        if min(used, cached) < 0 or used + cached > total:
            return [f"used {used} + cached {cached} blocks exceed the {total}"]
        return []

    def keys(self) -> dict[str, tuple]:
        return {request_id: r.key() for request_id, r in self.requests.items()}
