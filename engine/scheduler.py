"""Iteration-level scheduler: one step's plan, running requests first, then waiting ones.

There is no prefill phase and no decode phase. A request has known tokens (prompt +
output) and computed tokens; each step hands out tokens from `max_num_batched_tokens`
so computed catches up with known. Prefill, chunked prefill and decode are one case.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from .block_pool import KVCacheManager
from .request import Request, Status


@dataclass
class SchedulerKnobs:
    """The admission knobs; the engine changes them between steps."""
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int = 0   # 0: a request may take the whole remaining budget


@dataclass
class Row:
    request: Request
    num_tokens: int

    @property
    def samples(self) -> bool:
        """True when this row's tokens bring the request level with its known tokens."""
        return self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    rows: list[Row] = field(default_factory=list)      # running order
    admitted: list[Request] = field(default_factory=list)
    preempted: list[tuple[Request, int, int]] = field(default_factory=list)  # (request, blocks freed, tokens to recompute)
    token_budget: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(row.num_tokens for row in self.rows)


class Scheduler:
    def __init__(self, knobs: SchedulerKnobs, kv: KVCacheManager, policy: str = "fcfs"):
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be fcfs or priority, got {policy!r}")
        self.knobs = knobs
        self.kv = kv
        self.policy = policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # -- queues -------------------------------------------------------------------

    def add(self, request: Request) -> None:
        request.status = Status.WAITING
        self._enqueue(request, front=False)

    def _enqueue(self, request: Request, front: bool) -> None:
        if self.policy == "priority":
            keys = [_priority_key(r) for r in self.waiting]
            self.waiting.insert(bisect.bisect(keys, _priority_key(request)), request)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def remove(self, request: Request) -> int:
        """Take a request out of whichever queue holds it and free its blocks; blocks freed."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        return self.kv.free(request.request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(token_budget=self.knobs.max_num_batched_tokens)
        budget = self._schedule_running(out, out.token_budget)
        # A step that had to take memory away from someone admits nobody new.
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _chunk(self, request: Request, budget: int) -> int:
        num_tokens = min(request.num_tokens_to_compute, budget)
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

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.knobs.max_num_seqs:
            request = self.waiting[0]
            num_tokens = self._chunk(request, budget)
            if self.kv.try_allocate(request.request_id, num_tokens) is None:
                break          # head of line waits for memory; nobody jumps the queue
            self.waiting.popleft()
            request.status = Status.RUNNING
            self.running.append(request)
            out.admitted.append(request)
            out.rows.append(Row(request, num_tokens))
            budget -= num_tokens

    def _pick_victim(self) -> Request:
        """Lowest priority first, then the latest arrival."""
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
        self._enqueue(victim, front=True)
        out.preempted.append((victim, blocks_freed, tokens_to_recompute))

    # -- after the forward pass ------------------------------------------------------

    def finish(self, request: Request, reason: str) -> int:
        """Retire a request; the number of KV blocks it gave back."""
        blocks_freed = self.remove(request)
        request.status = Status.FINISHED
        request.finish_reason = reason
        return blocks_freed


def _priority_key(request: Request) -> tuple[int, int]:
    return (request.priority, request.arrival_seq)
