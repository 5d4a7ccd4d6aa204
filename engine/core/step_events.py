"""Step events: the one observer that turns engine steps into telemetry events.

The engine hands it each step at two points: `planned`, once the persistent batch follows the
plan (before the forward pass, so a step that raises still leaves its plan in the log), and
`finished`, once the scheduler has taken the output. The order of the events is the contract
its consumers fold by (telemetry.state, the dashboard's model). A request retired outside a
step (abort, a failed step's rows) goes through `retired` at once. With no sink it builds nothing.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from batchtop.telemetry import events as ev

from .admission import Blocked
from .scheduler_output import PADDING_RELEASED, PREEMPTED, RETRACTED

if TYPE_CHECKING:
    from .batch import BatchStep, PersistentBatch
    from .engine import Executed
    from .kv_cache import KVCacheManager
    from .request import Request
    from .scheduler import Scheduler
    from .scheduler_output import SchedulerOutput, StepResult

Sink = Callable[[ev.Event], None]


@dataclass
class StepTimes:
    """perf_counter readings at the ends of a step's phases: StepFinished's timings."""
    start: float = field(default_factory=time.perf_counter)
    scheduled: float = 0.0
    prepared: float = 0.0
    forwarded: float = 0.0
    sampled: float = 0.0
    updated: float = 0.0


class StepEvents:
    def __init__(self, sink: Sink | None, scheduler: Scheduler, batch: PersistentBatch, kv: KVCacheManager,
                 snapshot_interval_steps: int, clock: Callable[[], float] = time.monotonic):
        self._sink = sink
        self._clock = clock          # events' `t`: the engine's monotonic clock, or a virtual one (what-if)
        self.scheduler = scheduler
        self.batch = batch
        self.kv = kv
        self.snapshot_interval_steps = snapshot_interval_steps
        self._blocked_key: tuple[str, str] | None = None   # of the last AdmissionBlocked

    # -- one step -------------------------------------------------------------------------

    def planned(self, step: int, plan: SchedulerOutput, batch_step: BatchStep) -> None:
        """The rows that left, the admitted, the batch's moves and cost, grown block tables, StepPlanned,
        and what blocks admission."""
        evictions = self.kv.take_evictions()      # taken with or without a sink: they must not pile up
        sink = self._sink
        if sink is None:
            return
        t = self._clock()
        self._left(step, t, plan, batch_step.left_slots)
        if evictions:
            sink(ev.BlocksEvicted(step=step, t=t, block_ids=tuple(e.block_id for e in evictions),
                                  prefix_ids=tuple(e.prefix_id for e in evictions)))
        for request in plan.admitted:
            sink(self._admitted(step, t, request))
        self._rebuilt(step, t, plan, batch_step.update)
        for request_id, num_new, num_blocks in batch_step.grown:
            sink(ev.BlocksAllocated(step=step, t=t, request_id=request_id, num_new_blocks=num_new,
                                    num_blocks=num_blocks))
        self._planned(step, t, plan)
        self.blocked(step, plan.blocked)

    def _left(self, step: int, t: float, plan: SchedulerOutput, slots: list[int]) -> None:
        """Preempted, retracted and released rows (a retired one had its RequestRetired when it retired)."""
        sink = self._sink
        for gone, slot in zip(plan.left, slots):
            request_id, reason = gone.request.request_id, gone.reason
            if reason == PREEMPTED:
                sink(ev.RequestPreempted(step=step, t=t, request_id=request_id, slot=slot,
                                         blocks_freed=gone.blocks_freed,
                                         tokens_to_recompute=gone.tokens_to_recompute,
                                         reason="kv pool exhausted"))
            elif reason == RETRACTED:
                sink(ev.RequestRetracted(step=step, t=t, request_id=request_id, slot=slot,
                                         blocks_freed=gone.blocks_freed,
                                         tokens_to_recompute=gone.tokens_to_recompute,
                                         new_token_ratio=plan.new_token_ratio))
            elif reason == PADDING_RELEASED:
                sink(ev.PaddingReleased(step=step, t=t, request_id=request_id, slot=slot,
                                        blocks_freed=gone.blocks_freed))

    def _admitted(self, step: int, t: float, request: Request) -> ev.RequestAdmitted:
        reasons, seconds = request.wait_split
        cache = request.cache
        return ev.RequestAdmitted(
            step=step, t=t, request_id=request.request_id, slot=self.batch.slot_of[request.request_id],
            num_computed_tokens=request.num_computed_tokens, resumed=request.num_preemptions > 0,
            wait_reasons=reasons, wait_s=seconds, num_known_tokens=request.num_tokens,
            num_cached_tokens=cache.num_cached_tokens, num_full_blocks=cache.num_full_blocks,
            num_hit_blocks=cache.num_hit_blocks, miss_reason=cache.reason or "",
            num_matched_tokens=cache.num_matched_tokens, evicted_ago_s=cache.evicted_ago_s or 0.0,
            prefix_id=cache.prefix_id)

    def _rebuilt(self, step: int, t: float, plan: SchedulerOutput, update) -> None:
        sink = self._sink
        for move in update.moves + update.renumbered:
            sink(ev.RowMoved(step=step, t=t, request_id=move.request_id, from_slot=move.from_slot,
                             to_slot=move.to_slot, num_bytes=move.num_bytes))
        if plan.left or plan.admitted:
            sink(ev.BatchRebuilt(step=step, t=t, layout=self.batch.layout, rows_kept=update.rows_kept,
                                 rows_added=update.rows_added, rows_removed=update.rows_removed,
                                 rows_moved=len(update.moves), num_bytes=update.num_bytes))

    def _planned(self, step: int, t: float, plan: SchedulerOutput) -> None:
        tokens = dict.fromkeys(ev.ROW_KINDS, 0)
        rows = dict.fromkeys(ev.ROW_KINDS, 0)
        for row in plan.rows:
            kind = row.kind
            tokens[kind] += row.num_tokens
            rows[kind] += 1
        self._sink(ev.StepPlanned(
            step=step, t=t, prefill_tokens=tokens["prefill"], recompute_tokens=tokens["recompute"],
            decode_tokens=tokens["decode"], num_prefill_rows=rows["prefill"],
            num_recompute_rows=rows["recompute"], num_decode_rows=rows["decode"],
            num_padding_rows=rows["padding"], token_budget=plan.token_budget,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.kv.num_used_blocks, kv_blocks_total=self.kv.num_blocks,
            kv_blocks_cached=self.kv.num_cached_blocks))

    def finished(self, step: int, batch_step: BatchStep, executed: Executed, result: StepResult,
                 times: StepTimes) -> None:
        """Chunks, first tokens and retirements in batch order, StepFinished, and now and then a snapshot."""
        cached = self.kv.take_cached()
        sink = self._sink
        if sink is None:
            return
        t = self._clock()
        for chunk in result.chunks:
            sink(ev.PrefillChunk(step=step, t=t, request_id=chunk.request_id, num_tokens=chunk.num_tokens,
                                 num_computed_tokens=chunk.num_computed_tokens,
                                 num_known_tokens=chunk.num_known_tokens, recompute=chunk.recompute))
        for blocks in cached:
            sink(ev.BlocksCached(step=step, t=t, request_id=blocks.request_id, prefix_id=blocks.prefix_id,
                                 num_new_blocks=blocks.num_blocks))
        slot_of = self.batch.slot_of
        for sampled in result.sampled:
            request = sampled.request
            if sampled.first:
                sink(ev.FirstToken(step=step, t=t, request_id=request.request_id,
                                   ttft_s=request.first_token_time - request.arrival_time))
            if sampled.finish_reason is not None:
                self.retired(step, request, sampled.finish_reason, slot_of[request.request_id], queued=False)
        self._finished(step, batch_step, executed, times)
        interval = self.snapshot_interval_steps
        if interval and step % interval == 0:
            sink(self.snapshot(step, "interval"))

    def _finished(self, step: int, batch_step: BatchStep, executed: Executed, times: StepTimes) -> None:
        scheduler, kv = self.scheduler, self.kv
        self._sink(ev.StepFinished(
            step=step, t=self._clock(), num_rows=len(batch_step.rows), num_tokens=executed.num_tokens,
            sampled_request_ids=tuple(row.request.request_id for row in executed.sampled),
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            kv_blocks_used=kv.num_used_blocks, kv_blocks_total=kv.num_blocks,
            kv_blocks_cached=kv.num_cached_blocks, schedule_s=times.scheduled - times.start,
            prepare_s=times.prepared - times.scheduled,
            forward_s=times.forwarded - times.prepared, sample_s=times.sampled - times.forwarded,
            update_s=times.updated - times.sampled, num_padded_tokens=executed.num_padded_tokens))

    # -- at any time ------------------------------------------------------------------------

    def retired(self, step: int, request: Request, reason: str, slot: int, queued: bool) -> None:
        """RequestRetired; `queued`: it retired from the waiting queue (its wait split goes with it)."""
        if self._sink is None:
            return
        wait_reasons, wait_s = request.wait_split if queued else ((), ())
        self._sink(ev.RequestRetired(
            step=step, t=self._clock(), request_id=request.request_id, reason=reason, slot=slot,
            num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=request.num_output_tokens,
            num_blocks=self.kv.num_blocks_held(request.request_id), wait_reasons=wait_reasons, wait_s=wait_s))

    def blocked(self, step: int, blocked: Blocked | None) -> None:
        """AdmissionBlocked when what stops the head of the queue (reason or head) changed."""
        if self._sink is None:
            return
        key = blocked.key if blocked is not None else None
        if key == self._blocked_key:
            return
        self._blocked_key = key
        if blocked is not None:
            self._sink(ev.AdmissionBlocked(step=step, t=self._clock(), **dataclasses.asdict(blocked)))

    def snapshot(self, step: int, cause: str) -> ev.EngineSnapshot:
        """The whole request state as one event: running (running order), padding rows, waiting (queue
        order)."""
        scheduler, slot_of, kv = self.scheduler, self.batch.slot_of, self.kv
        members = ([(r, "running") for r in scheduler.running] + [(r, "padding") for r in scheduler.padding]
                   + [(r, r.status.value) for r in scheduler.waiting])
        requests = [r for r, _ in members]
        return ev.EngineSnapshot(
            step=step, t=self._clock(), cause=cause,
            request_ids=tuple(r.request_id for r in requests),
            statuses=tuple(status for _, status in members),
            slots=tuple(slot_of.get(r.request_id, -1) for r in requests),
            num_prompt_tokens=tuple(r.num_prompt_tokens for r in requests),
            num_output_tokens=tuple(r.num_output_tokens for r in requests),
            num_computed_tokens=tuple(r.num_computed_tokens for r in requests),
            num_blocks=tuple(kv.num_blocks_held(r.request_id) for r in requests),
            max_tokens=tuple(r.sampling.max_tokens for r in requests),
            kv_blocks_used=kv.num_used_blocks, kv_blocks_total=kv.num_blocks,
            kv_blocks_cached=kv.num_cached_blocks, priorities=tuple(r.priority for r in requests),
            num_preemptions=tuple(r.num_preemptions for r in requests),
            new_token_ratio=scheduler.new_token_ratio,
            prompt_blocks=tuple(r.prompt_blocks for r in requests),
            num_hit_blocks=tuple(r.cache.num_hit_blocks if r.cache else 0 for r in requests),
            free_blocks=kv.free_queue() if kv.enable_caching else None)
