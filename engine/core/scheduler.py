"""Iteration-level scheduler: one step's plan, running requests first, then waiting ones.

There is no prefill phase and no decode phase. A request has known tokens (prompt +
output) and computed tokens; each step hands out tokens from `max_num_batched_tokens`
so computed catches up with known. Prefill, chunked prefill and decode are one case.
After the forward pass `update_from_output` appends the sampled tokens and retires whoever
stopped; each plan lists the requests that left the persistent batch since the last one.
"""
from __future__ import annotations

import bisect
from collections import deque

from batchtop.telemetry.wait_clock import NEXT_STEP, WaitClock

from .admission import Blocked
from .config import SchedulerKnobs
from .knobs import POLICIES
from .kv_cache import KVCacheManager
from .request import Request, Status
from .scheduler_output import (
    PADDING_RELEASED,
    PREEMPTED,
    RETRACTED,
    Chunk,
    LeftBatch,
    Row,
    SampledToken,
    SchedulerOutput,
    StepResult,
)

# Retraction's admission estimate (SGLang's new_token_ratio): the share of each running
# request's remaining max_tokens that admission keeps free. A retraction raises it; it
# then decays back step by step.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
RETRACT_DECODE_STEPS = 20


class Scheduler:
    def __init__(self, knobs: SchedulerKnobs, kv: KVCacheManager, policy: str = "fcfs",
                 eos_token_ids: frozenset[int] = frozenset()):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.knobs = knobs
        self.kv = kv
        self.policy = policy
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.padding: list[Request] = []        # finished members of the current static batch
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.wait_clock = WaitClock()
        self._now = 0.0                         # the time of the step being scheduled
        self._left: list[LeftBatch] = []        # retired from the batch since the last plan that was a step

    # -- queues -------------------------------------------------------------------

    def add(self, request: Request) -> None:
        request.status = Status.WAITING
        self._enqueue(request, front=False, now=request.arrival_time)

    def _enqueue(self, request: Request, front: bool, now: float) -> None:
        request.wait_mark = self.wait_clock.mark(now)
        if self.policy == "priority":
            keys = [_priority_key(r) for r in self.waiting]
            self.waiting.insert(bisect.bisect(keys, _priority_key(request)), request)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def remove(self, request: Request, now: float = 0.0) -> int:
        """Take a request out of whichever queue holds it and free its blocks; blocks freed.
        One taken from the queue keeps its last wait's split in `wait_split`."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
            request.wait_split = self.wait_clock.split(request.wait_mark, now)
        return self.kv.free(request.request_id)

    def note_paused(self, now: float, paused: bool) -> None:
        """While the engine is paused, whoever waits, waits for that."""
        self.wait_clock.set(now, "paused" if paused else NEXT_STEP)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.padding)

    # -- one step -----------------------------------------------------------------

    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        """One step's plan at time `now`; `out.blocked` says why whoever still waits was not admitted."""
        self._now = now
        out = SchedulerOutput(token_budget=self.knobs.max_num_batched_tokens)
        if self.padding and not self.running:
            out.left = self._end_static_batch()
        budget = self._schedule_running(out, out.token_budget)
        preempted = any(gone.preempted for gone in out.left)
        # A step that had to take memory away from someone admits nobody new.
        if preempted:
            out.blocked = self._blocked("preemption")
        elif self._may_admit(now):
            out.blocked = self._schedule_waiting(out, budget)
        else:
            out.blocked = self._batch_blocked(now)
        if not self.waiting:
            out.blocked = None
        self.wait_clock.set(now, out.blocked.reason if out.blocked else NEXT_STEP)
        out.rows += [Row(r, 1, padding=True) for r in self.padding]
        if self.knobs.preemption_mode == "retract" and not preempted:
            self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        out.new_token_ratio = self.new_token_ratio
        if out.is_step:             # a plan that is no step is dropped: its leavers wait for the next
            out.left[:0], self._left = self._left, []
        return out

    def _may_admit(self, now: float) -> bool:
        """continuous: every step is a batch boundary. static and dynamic: only an empty batch takes rows;
        dynamic also waits until B requests wait or the oldest has waited the timeout."""
        mode = self.knobs.batching_mode
        if mode == "continuous":
            return True
        if self.running or self.padding or not self.waiting:
            return False
        if mode == "dynamic":
            full = len(self.waiting) >= self._static_batch_size()
            return full or now - self.waiting[0].arrival_time >= self.knobs.dynamic_timeout_s
        return True

    def _blocked(self, reason: str, **numbers) -> Blocked | None:
        if not self.waiting:
            return None
        return Blocked(reason, self.waiting[0].request_id, len(self.waiting), len(self.running), **numbers)

    def _batch_blocked(self, now: float) -> Blocked | None:
        """Why a static or dynamic batch takes nobody this step."""
        size = self._static_batch_size()
        if self.running or self.padding or self.knobs.batching_mode == "static":
            return self._blocked("static_batch", limit=size)
        waited = now - self.waiting[0].arrival_time if self.waiting else 0.0
        return self._blocked("dynamic_batch", limit=size,
                             wait_more_s=max(0.0, self.knobs.dynamic_timeout_s - waited))

    def _static_batch_size(self) -> int:
        return min(self.knobs.static_batch_size, self.knobs.max_num_seqs)

    def _end_static_batch(self) -> list[LeftBatch]:
        """The longest row of the static batch finished: its padding rows give their blocks back."""
        released, self.padding = self.padding, []
        return [LeftBatch(request, PADDING_RELEASED,
                          self.kv.free(request.request_id)) for request in released]

    def _take_cached(self, request: Request, cached) -> None:
        """Admission: the cached prefix counts as computed (a preempted request computes less again)."""
        request.cache = cached
        request.num_computed_tokens = cached.num_cached_tokens
        if request.num_preemptions:
            request.num_recomputed_tokens -= cached.num_cached_tokens

    def _chunk(self, request: Request, budget: int, num_cached: int = 0) -> int:
        """Tokens the request computes this step: what it lacks (past `num_cached`), within the budget
        and the per-request threshold."""
        num_tokens = min(request.num_tokens_to_compute - num_cached, budget)
        threshold = self.knobs.long_prefill_token_threshold
        return min(num_tokens, threshold) if threshold > 0 else num_tokens

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        scheduled: dict[int, Row] = {}
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_tokens = self._chunk(request, budget)
            if num_tokens <= 0:
                index += 1
                continue
            while self.kv.try_allocate(request.request_id, request.num_computed_tokens + num_tokens) is None:
                victim = self._pick_victim()
                victim_index = self.running.index(victim)
                dropped = scheduled.pop(id(victim), None)
                if dropped is not None:
                    budget += dropped.num_tokens
                self._preempt(victim, out)
                if victim_index < index:
                    index -= 1
                if victim is request:
                    break
            else:
                row = Row(request, num_tokens)
                scheduled[id(request)] = row
                budget -= num_tokens
                index += 1
        out.rows = [scheduled[id(r)] for r in self.running if id(r) in scheduled]
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> Blocked | None:
        """Admit from the head of the queue; what stopped it (None when the queue emptied)."""
        continuous = self.knobs.batching_mode == "continuous"
        cap = self.knobs.max_num_seqs if continuous else self._static_batch_size()
        # A static batch is formed whole; its rows may start with no tokens if the budget is short.
        while self.waiting:
            if len(self.running) >= cap:
                return self._blocked("max_num_seqs" if continuous else "static_batch", limit=cap)
            request = self.waiting[0]
            cached = self.kv.lookup(request.request_id, request.all_token_ids)
            num_cached = cached.num_cached_tokens
            if continuous and budget <= 0:
                return self._blocked("budget", tokens_left=budget,
                                     tokens_needed=self._chunk(request, 1 << 30, num_cached))
            num_tokens = self._chunk(request, budget, num_cached)
            reserve = self._kv_reserve(request)
            if not self.kv.can_allocate(request.request_id, num_cached + num_tokens, reserve, cached):
                # Head of line waits for memory; nobody jumps the queue.
                needed = self.kv.blocks_short(request.request_id, num_cached + num_tokens, cached)
                return self._blocked("kv", blocks_needed=needed, blocks_free=self.kv.num_free_blocks,
                                     blocks_reserved=reserve)
            self.kv.try_allocate(request.request_id, num_cached + num_tokens, cached)
            self._take_cached(request, cached)
            self.waiting.popleft()
            request.status = Status.RUNNING
            request.wait_split = self.wait_clock.split(request.wait_mark, self._now)
            request.admit_time = request.admit_time or self._now
            self.running.append(request)
            out.admitted.append(request)
            if num_tokens > 0:
                out.rows.append(Row(request, num_tokens))
            budget -= num_tokens
        return None

    def _kv_reserve(self, request: Request) -> int:
        """Blocks admission keeps free. recompute: none (the first chunk must fit). retract: room for
        what the running requests are estimated to still generate (new_token_ratio of their remaining
        max_tokens)."""
        if self.knobs.preemption_mode != "retract":
            return 0
        remaining = sum(r.sampling.max_tokens - r.num_output_tokens for r in self.running)
        remaining += request.sampling.max_tokens
        return self.kv.blocks_needed(int(remaining * self.new_token_ratio))

    def _pick_victim(self) -> Request:
        """recompute: lowest priority first, then the latest arrival.
        retract: fewest generated tokens (least work lost), ties by the longest prompt."""
        if self.knobs.preemption_mode == "retract":
            return min(self.running, key=lambda r: (r.num_output_tokens, -r.num_prompt_tokens))
        if self.policy == "priority":
            return max(self.running, key=_priority_key)
        return max(self.running, key=lambda r: r.arrival_seq)

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        """Recompute preemption: free the blocks, keep the generated tokens, compute them again later."""
        self.running.remove(victim)
        blocks_freed = self.kv.free(victim.request_id)
        tokens_to_recompute = victim.num_computed_tokens
        victim.num_recomputed_tokens += tokens_to_recompute
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = Status.PREEMPTED
        self._enqueue(victim, front=True, now=self._now)
        retract = self.knobs.preemption_mode == "retract"
        out.left.append(LeftBatch(victim, RETRACTED if retract else PREEMPTED, blocks_freed,
                                  tokens_to_recompute))
        if retract:
            self._raise_new_token_ratio()

    def _raise_new_token_ratio(self) -> None:
        """After a retraction, estimate that the survivors generate more (SGLang's formula), capped at 1."""
        decoded = sum(r.num_output_tokens for r in self.running)
        max_new = sum(r.sampling.max_tokens for r in self.running) or 1
        estimate = (decoded + RETRACT_DECODE_STEPS * len(self.running)) / max_new
        self.new_token_ratio = min(1.0, max(self.new_token_ratio, estimate))

    # -- after the forward pass ------------------------------------------------------

    def update_from_output(self, rows: list[Row], sampled: list[Row], token_ids: list[int],
                           now: float) -> StepResult:
        """After the forward pass: computed tokens catch up, then each sampling row (`sampled`, the rows
        whose `samples` was true before this call, with `token_ids`) gets its token and may retire.
        `rows` in batch order; the step's result in that order."""
        chunks = self._advance(rows)
        return StepResult(chunks, [self._append(row.request, token_id, now)
                                   for row, token_id in zip(sampled, token_ids)])

    def _advance(self, rows: list[Row]) -> list[Chunk]:
        chunks = []
        for row in rows:
            if row.padding:
                continue
            request = row.request
            kind = row.kind                      # decided before the update
            before = request.num_computed_tokens
            request.num_computed_tokens += row.num_tokens
            if request.num_computed_tokens // self.kv.block_size > before // self.kv.block_size:
                self.kv.cache_computed(request.request_id, request.all_token_ids, request.num_computed_tokens)
            if kind != "decode":
                chunks.append(Chunk(request.request_id, row.num_tokens, request.num_computed_tokens,
                                    request.num_tokens, kind == "recompute"))
        return chunks

    def _append(self, request: Request, token_id: int, now: float) -> SampledToken:
        request.output_token_ids.append(token_id)
        first = request.first_token_time is None
        if first:
            request.first_token_time = now
        reason = self._stop_reason(request, token_id)
        if reason is not None:
            self.finish(request, reason, now)
        return SampledToken(request, token_id, first, reason)

    def _stop_reason(self, request: Request, token_id: int) -> str | None:
        sampling = request.sampling
        is_eos = token_id in self.eos_token_ids and not sampling.ignore_eos
        if is_eos or token_id in sampling.stop_token_ids:
            return "stop"
        if request.num_output_tokens >= sampling.max_tokens:
            return "length"
        return None

    def finish(self, request: Request, reason: str, now: float = 0.0) -> bool:
        """Retire a request at `now`. True when it leaves the batch now (a running one is in the next
        plan's `left`); False when it stays as a static padding row (its blocks held) until the longest
        row of its batch finishes."""
        running = request.status is Status.RUNNING
        stays_as_padding = (self.knobs.batching_mode != "continuous" and reason not in ("abort", "error")
                            and running)
        if stays_as_padding:
            self.running.remove(request)
            self.padding.append(request)
        else:
            self.remove(request, now)
            if running:
                self._left.append(LeftBatch(request, reason))
        request.status = Status.FINISHED
        request.finish_reason = reason
        request.finish_time = now
        return not stays_as_padding


def _priority_key(request: Request) -> tuple[int, int]:
    return (request.priority, request.arrival_seq)
