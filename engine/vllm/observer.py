"""vLLM's scheduling decisions as batchtop's events (the schema and meanings of docs/events.md).

`StepObserver` is driven by batchtop's scheduler class from vLLM's own hooks: a request
added, `schedule()` returned a `SchedulerOutput`, a request was preempted inside it,
`update_from_output()` returned the step's outputs, requests were finished from outside
(aborts). It reads vLLM's objects and never changes them.

A step is a `SchedulerOutput` that schedules tokens. Its plan events (preemptions,
admissions, row moves, `StepPlanned`) are emitted when it is scheduled, its outcome
(`PrefillChunk`, `FirstToken`, `RequestRetired`, `StepFinished`) when its output comes
back. Under async scheduling vLLM plans step N+1 before N's output returns: N+1's plan is
then held back until N has finished, so the stream reads plan N, finish N, plan N+1, as
for batchtop's engine, and step numbers never decrease.

Timings: `schedule_s` is `schedule()`, `update_s` is `update_from_output()`, `forward_s` the
time the scheduler waited for the step's output: from the end of its last call before the
update (the step's own `schedule()`; under async scheduling the next step's, planned while
this one ran) to the start of `update_from_output()` (the worker's step: inputs, forward,
sampling, as the scheduler sees it, less what overlapped the scheduler's own work). So the
steps' phases add up to the engine's time, one step after the other, under either scheduling.
`prepare_s` and `sample_s` are 0 (inside the worker).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable

from batchtop.telemetry import events as ev
from batchtop.telemetry.wait_clock import NEXT_STEP, WaitClock, WaitMark

from .prefix_cache import PrefixCacheWatch
from .slots import TOKEN_ID_BYTES, InputBatchMirror


class _Track:
    """What batchtop keeps of one live request: counts the events report."""
    __slots__ = ("num_prompt_tokens", "arrival_time", "num_output_tokens", "got_first_token",
                 "num_hit_blocks")

    def __init__(self, num_prompt_tokens: int, arrival_time: float):
        self.num_prompt_tokens = num_prompt_tokens
        self.arrival_time = arrival_time        # vLLM's, time.time() when the API server took the request
        self.num_output_tokens = 0
        self.got_first_token = False
        self.num_hit_blocks = 0                 # the prefix cache's at its last admission


class _Step:
    """One scheduled step, from its `SchedulerOutput` until its output comes back."""
    __slots__ = ("output", "step", "plan", "prefill_rows", "scheduled_at", "schedule_s")

    def __init__(self, output, step: int, plan: list, prefill_rows: list, scheduled_at: float,
                 schedule_s: float):
        self.output = output
        self.step = step                # 0: an empty schedule (nothing computed), not a step
        self.plan = plan                # (event type, fields) not yet emitted
        self.prefill_rows = prefill_rows    # (request id, tokens, computed after, known)
        self.scheduled_at = scheduled_at
        self.schedule_s = schedule_s


class StepObserver:
    def __init__(self, sink: Callable[[ev.Event], None], *, blocks_of: Callable[[str], int],
                 kv_usage: Callable[[], tuple[int, int]], cache: PrefixCacheWatch | None = None):
        self._sink = sink
        self._blocks_of = blocks_of         # exact KV blocks a request holds now
        self._kv_usage = kv_usage           # (blocks used, blocks total)
        self.cache = cache                  # vLLM's prefix cache, read back (None: not read)
        self.mirror = InputBatchMirror()
        self.step = 0                       # the last step scheduled
        self._emitted_step = 0              # the last step whose plan was emitted
        self._tracks: dict[str, _Track] = {}
        self._in_flight: deque[_Step] = deque()
        self._last_call_end = 0.0           # when the scheduler's last schedule() or update ended
        self._known_before: dict[str, int] = {}
        self._preempted: list[tuple[type, dict]] = []
        self._held: dict[str, int] = {}             # KV blocks each request held at the last look
        self._blocked_key: tuple | None = None
        # each wait split by what stopped admission, as batchtop's engine splits it: the reason of each
        # schedule() holds until the next; a request's reading taken when it joined the queue
        self.wait_clock = WaitClock()
        self._wait_marks: dict[str, WaitMark] = {}

    def _emit(self, kind: type, step: int | None = None, **fields) -> None:
        self._sink(kind(step=self._emitted_step if step is None else step, t=time.monotonic(), **fields))

    # -- requests in and out ----------------------------------------------------------------

    def arrived(self, request) -> None:
        self._tracks[request.request_id] = _Track(request.num_prompt_tokens, request.arrival_time)
        self._wait_marks[request.request_id] = self.wait_clock.mark(time.monotonic())
        self._emit(ev.RequestArrived, request_id=request.request_id,
                   num_prompt_tokens=request.num_prompt_tokens, max_tokens=request.max_tokens,
                   priority=request.priority, since_arrival_s=max(0.0, time.time() - request.arrival_time),
                   prompt_blocks=self.cache.prompt_blocks(request) if self.cache is not None else ())

    def joined(self, request, slot: int, num_output_tokens: int) -> None:
        """A request already in vLLM's state when a run begins from a snapshot (the harness replaying a
        recording joined mid-run): no arrival event; running in row `slot` (-1: queued) with
        `num_output_tokens` generated."""
        track = self._tracks[request.request_id] = _Track(request.num_prompt_tokens, request.arrival_time)
        track.num_output_tokens = num_output_tokens
        track.got_first_token = num_output_tokens > 0
        if slot >= 0:
            self.mirror.place(request.request_id, slot)
            self._held[request.request_id] = self._blocks_of(request.request_id)
        else:
            self._wait_marks[request.request_id] = self.wait_clock.mark(time.monotonic())

    def in_flight_at_join(self, output, requests: dict) -> None:
        """The step in flight when a run begins from a snapshot taken under async scheduling (scheduled
        again by the harness; `before_schedule` saw its rows first): it has no plan here, as the
        recording has none after its snapshot; its outcome comes when its output does."""
        self.step += 1
        prefill_rows, _ = self._rows(output.num_scheduled_tokens, requests)
        self._in_flight.append(_Step(output, self.step, [], prefill_rows, time.perf_counter(), 0.0))

    def finished_outside(self, requests) -> None:
        """Requests that `finish_requests()` ended (aborts from the API server)."""
        for request in requests:
            self._retire(request.request_id, str(request.get_finished_reason()))

    def _retire(self, request_id: str, reason: str) -> None:
        self._held.pop(request_id, None)
        if self.cache is not None:
            self.cache.retired(request_id)
        track = self._tracks.pop(request_id, None)
        mark = self._wait_marks.pop(request_id, None)      # retired from the queue: its last wait
        if track is None:
            return
        wait_reasons, wait_s = self.wait_clock.split(mark, time.monotonic()) if mark else ((), ())
        self._emit(ev.RequestRetired, request_id=request_id, reason=reason,
                   slot=self.mirror.slot_of.get(request_id, -1), num_prompt_tokens=track.num_prompt_tokens,
                   num_output_tokens=track.num_output_tokens, wait_reasons=wait_reasons, wait_s=wait_s)

    # -- schedule() ---------------------------------------------------------------------------

    def before_schedule(self, running) -> None:
        """Known tokens of the running requests before `schedule()` advances their counts."""
        self._known_before = {r.request_id: r.num_tokens + r.num_output_placeholders for r in running}
        self._preempted = []

    def preempting(self, request) -> None:
        """Inside `schedule()`, just before vLLM frees the victim's blocks."""
        self._held.pop(request.request_id, None)
        self._wait_marks[request.request_id] = self.wait_clock.mark(time.monotonic())
        if self.cache is not None:
            self.cache.preempting(request.request_id)
        self._preempted.append((ev.RequestPreempted, dict(
            request_id=request.request_id, slot=self.mirror.slot_of.get(request.request_id, -1),
            blocks_freed=self._blocks_of(request.request_id), tokens_to_recompute=request.num_computed_tokens,
            reason="kv pool exhausted")))

    def scheduled(self, output, requests: dict, token_budget: int, counts: tuple[int, int],
                  schedule_s: float, blocked: dict | None = None) -> None:
        """`schedule()` returned `output`; `requests` is the scheduler's request table; `blocked` what
        stopped admission at the head of the queue (AdmissionBlocked's fields), None when nobody waits."""
        decided_t = time.monotonic()
        cached = output.scheduled_cached_reqs
        scheduled_ids = output.num_scheduled_tokens
        to_add = [r.req_id for r in output.scheduled_new_reqs] + list(cached.req_ids)
        update = self.mirror.update(output.finished_req_ids, scheduled_ids.keys(),
                                    cached.resumed_req_ids, to_add,
                                    lambda request_id: requests[request_id].num_tokens)
        plan = self._preempted
        self._preempted = []
        admitted = dict(update.added)
        resumed = [(r, c) for r, c in zip(cached.req_ids, cached.num_computed_tokens)
                   if r in cached.resumed_req_ids]
        new_reqs = [(new.req_id, new.num_computed_tokens) for new in output.scheduled_new_reqs]
        lookups = self._cache_step(output, resumed + new_reqs, requests, plan)
        for request_id, computed in resumed + new_reqs:   # computed > 0: a prefix-cache hit
            fields = lookups[request_id].fields() if request_id in lookups else {}
            if request_id in self._tracks:
                self._tracks[request_id].num_hit_blocks = fields.get("num_hit_blocks", 0)
            mark = self._wait_marks.pop(request_id, None)
            wait_reasons, wait_s = self.wait_clock.split(mark, decided_t) if mark else ((), ())
            plan.append((ev.RequestAdmitted, dict(request_id=request_id, slot=admitted[request_id],
                                                  num_computed_tokens=computed,
                                                  resumed=request_id in cached.resumed_req_ids,
                                                  wait_reasons=wait_reasons, wait_s=wait_s, **fields)))
        if self.cache is not None:
            for request_id, pid, num_new in self.cache.take_cached():
                plan.append((ev.BlocksCached, dict(request_id=request_id, prefix_id=pid,
                                                   num_new_blocks=num_new)))
        for request_id in cached.req_ids:
            if request_id in cached.resumed_req_ids:
                continue
            if request_id in admitted:     # running, left out of an earlier step: its row was rebuilt
                plan.append((ev.RowMoved,
                             dict(request_id=request_id, from_slot=update.left.get(request_id, -1),
                                               to_slot=admitted[request_id],
                                               num_bytes=requests[request_id].num_tokens * TOKEN_ID_BYTES)))
        for request_id in scheduled_ids:
            held, now = self._held.get(request_id, 0), self._blocks_of(request_id)
            if now != held:
                self._held[request_id] = now
                plan.append((ev.BlocksAllocated, dict(request_id=request_id, num_new_blocks=now - held,
                                                      num_blocks=now)))
        for move in update.moves:
            plan.append((ev.RowMoved, dict(request_id=move.request_id, from_slot=move.from_slot,
                                           to_slot=move.to_slot, num_bytes=move.num_bytes)))
        if update.added or update.num_removed:
            plan.append((ev.BatchRebuilt,
                         dict(layout="vllm", rows_kept=update.num_kept, rows_added=len(update.added),
                                               rows_removed=update.num_removed, rows_moved=len(update.moves),
                                               num_bytes=sum(m.num_bytes for m in update.moves))))
        step = 0
        prefill_rows = []
        if output.total_num_scheduled_tokens > 0:
            self.step = step = self.step + 1
            prefill_rows, planned = self._rows(scheduled_ids, requests)
            used, total = self._kv_usage()
            plan.append((ev.StepPlanned, dict(**planned, num_padding_rows=0, token_budget=token_budget,
                                              num_running=counts[0], num_waiting=counts[1],
                                              kv_blocks_used=used, kv_blocks_total=total,
                                              kv_blocks_cached=self._num_cached_blocks())))
        self.wait_clock.set(decided_t, NEXT_STEP if blocked is None else blocked["reason"])
        key = None if blocked is None else (blocked["reason"], blocked["request_id"])
        if key != self._blocked_key:
            self._blocked_key = key
            if blocked is not None:
                plan.append((ev.AdmissionBlocked, blocked))
        record = _Step(output, step, plan, prefill_rows, time.perf_counter(), schedule_s)
        self._last_call_end = record.scheduled_at
        self._in_flight.append(record)
        if len(self._in_flight) == 1:
            self._emit_plan(record)

    def _cache_step(self, output, admitted: list[tuple[str, int]], requests: dict, plan: list) -> dict:
        """vLLM's prefix cache this step, read in its order (running rows, then each admission): the
        blocks it evicted (BlocksEvicted, into `plan`) and each admission's lookup."""
        cache = self.cache
        if cache is None:
            return {}
        admitted_ids = {request_id for request_id, _ in admitted}
        running = [r for r in output.num_scheduled_tokens if r not in admitted_ids]
        lookups = cache.scheduled(running, admitted, requests)
        evictions = cache.take_evictions()
        if evictions:
            plan.append((ev.BlocksEvicted, dict(block_ids=tuple(b for b, _ in evictions),
                                                prefix_ids=tuple(p for _, p in evictions))))
        return lookups

    def _num_cached_blocks(self) -> int:
        return self.cache.num_cached_blocks if self.cache is not None else 0

    def _rows(self, scheduled_ids: dict[str, int], requests: dict) -> tuple[list, dict]:
        """The rows by kind (ROW_KINDS): decode computes one token, the last known one, and that token is
        an output token; any other row of a request preempted before is recompute, else prefill."""
        chunks = []
        tokens = {"prefill": 0, "recompute": 0}
        rows = {"prefill": 0, "recompute": 0}
        num_decode = 0
        known_before = self._known_before
        for request_id, num_tokens in scheduled_ids.items():
            request = requests[request_id]
            computed = request.num_computed_tokens            # already advanced by this step
            known = known_before.get(request_id, request.num_tokens)
            if num_tokens == 1 and computed == known and known > request.num_prompt_tokens:
                num_decode += 1
                continue
            kind = "recompute" if request.num_preemptions > 0 else "prefill"
            tokens[kind] += num_tokens
            rows[kind] += 1
            chunks.append((request_id, num_tokens, computed, known, kind == "recompute"))
        return chunks, dict(prefill_tokens=tokens["prefill"], recompute_tokens=tokens["recompute"],
                            decode_tokens=num_decode, num_prefill_rows=rows["prefill"],
                            num_recompute_rows=rows["recompute"], num_decode_rows=num_decode)

    def _emit_plan(self, record: _Step) -> None:
        """Under async scheduling a held plan can name a request that retired meanwhile (it finished in
        the step before, or was aborted): its part of the plan is dropped, the step's totals stay."""
        step = record.step or self._emitted_step
        tracks = self._tracks
        for kind, fields in record.plan:
            if "request_id" in fields and fields["request_id"] not in tracks:
                continue
            self._emit(kind, step, **fields)
        record.plan = []
        self._emitted_step = step

    # -- update_from_output() -----------------------------------------------------------------

    def updated(self, output, engine_outputs: dict, counts: tuple[int, int], update_s: float) -> None:
        """`update_from_output(output, ...)` returned `engine_outputs` (client index -> EngineCoreOutputs)."""
        record = self._take(output)
        if record is None:
            return
        update_started = time.perf_counter() - update_s
        forward_s = max(0.0, update_started - max(record.scheduled_at, self._last_call_end))
        self._last_call_end = update_started + update_s
        step = record.step or self._emitted_step
        for request_id, num_tokens, computed, known, recompute in record.prefill_rows:
            if request_id not in self._tracks:
                continue                        # retired while this step was in flight
            self._emit(ev.PrefillChunk, step, request_id=request_id, num_tokens=num_tokens,
                       num_computed_tokens=computed, num_known_tokens=known, recompute=recompute)
        sampled = []
        for outputs in engine_outputs.values():
            for out in outputs.outputs:
                track = self._tracks.get(out.request_id)
                if track is None:
                    continue
                if out.new_token_ids:
                    sampled.append(out.request_id)
                    track.num_output_tokens += len(out.new_token_ids)
                    if not track.got_first_token:
                        track.got_first_token = True
                        self._emit(ev.FirstToken, step, request_id=out.request_id,
                                   ttft_s=max(0.0, time.time() - track.arrival_time))
                if out.finish_reason is not None:
                    self._retire(out.request_id, str(out.finish_reason))
        if record.step:
            used, total = self._kv_usage()
            self._emit(ev.StepFinished, step, num_rows=len(output.num_scheduled_tokens),
                       num_tokens=output.total_num_scheduled_tokens, sampled_request_ids=tuple(sampled),
                       num_running=counts[0], num_waiting=counts[1], kv_blocks_used=used,
                       kv_blocks_total=total, schedule_s=record.schedule_s, prepare_s=0.0,
                       forward_s=forward_s, sample_s=0.0, update_s=update_s,
                       kv_blocks_cached=self._num_cached_blocks())
        if self._in_flight:
            self._emit_plan(self._in_flight[0])

    def _take(self, output) -> _Step | None:
        for i, record in enumerate(self._in_flight):
            if record.output is output:
                del self._in_flight[i]
                return record
        return None

    # -- snapshots ------------------------------------------------------------------------------

    def snapshot(self, running, waiting, cause: str) -> None:
        """Between steps: every live request's state (EngineSnapshot), for a consumer that missed events.
        Under async scheduling a step may be in flight: the snapshot waits for none, so its counts
        include that step's scheduled tokens."""
        entries = [(r, "running") for r in running] + [
            (r, "preempted" if r.num_preemptions > 0 else "waiting") for r in waiting]
        entries = [(r, status) for r, status in entries if r.request_id in self._tracks]
        used, total = self._kv_usage()
        self._emit(ev.EngineSnapshot, cause=cause, request_ids=tuple(r.request_id for r, _ in entries),
                   statuses=tuple(status for _, status in entries),
                   slots=tuple(self.mirror.slot_of.get(r.request_id, -1) if status == "running" else -1
                               for r, status in entries),
                   num_prompt_tokens=tuple(r.num_prompt_tokens for r, _ in entries),
                   num_output_tokens=tuple(self._tracks[r.request_id].num_output_tokens for r, _ in entries),
                   num_computed_tokens=tuple(r.num_computed_tokens for r, _ in entries),
                   num_blocks=tuple(self._blocks_of(r.request_id) for r, _ in entries),
                   max_tokens=tuple(r.max_tokens for r, _ in entries), kv_blocks_used=used,
                   kv_blocks_total=total, kv_blocks_cached=self._num_cached_blocks(),
                   priorities=tuple(r.priority for r, _ in entries),
                   num_preemptions=tuple(r.num_preemptions for r, _ in entries),
                   prompt_blocks=(tuple(self.cache.prompt_blocks(r) for r, _ in entries)
                                  if self.cache is not None else ()),
                   num_hit_blocks=tuple(self._tracks[r.request_id].num_hit_blocks for r, _ in entries),
                   free_blocks=self.cache.free_queue() if self.cache is not None else None)
