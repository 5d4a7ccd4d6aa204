"""The engine: requests in, one step at a time (schedule → prepare → forward → sample → update), events out."""
from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from batchtop import kernels
from batchtop.kernels import cpu
from batchtop.telemetry import events as ev
from batchtop.telemetry.flight import FlightRecorder

from .admission import Blocked
from .batch import PersistentBatch
from .kv_cache import KVCacheManager
from .config import EngineConfig
from .knobs import KNOBS, knob
from batchtop.engine.model.loading import LoadedModel, load_model
from .request import Request, Status
from batchtop.engine.model.runner import Runner
from .sampling import Sampler, SamplingParams
from .scheduler import Row, Scheduler, SchedulerKnobs

Sink = Callable[[ev.Event], None]


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    arrival_time: float
    first_token_time: float | None
    finish_time: float
    num_preemptions: int


class Engine:
    def __init__(self, config: EngineConfig, sink: Sink | None = None, loaded: LoadedModel | None = None):
        self.config = config
        # Always on unless configured off: the last steps' events, written out when a step raises.
        self.flight = (FlightRecorder(config.flight_recorder_steps, header=self._flight_header)
                       if config.flight_recorder_steps else None)
        self._sink = self.flight.tee(sink) if self.flight is not None else sink
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        kernels.select_backend(config.attention_backend)
        dtype = getattr(torch, config.dtype)
        device = torch.device(config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {config.device} is not available: this torch sees no CUDA device")
        self.loaded = loaded or load_model(config.model, dtype)
        if self.loaded.model.device != device:
            self.loaded.model.to(device)          # moves the caller's model too: one copy of the weights
        self.tokenizer = self.loaded.tokenizer
        model_config = self.loaded.model.config
        self.max_model_len = min(config.max_model_len or self.loaded.max_model_len, self.loaded.max_model_len)
        num_blocks = config.num_kv_blocks or max(1, int(
            config.kv_cache_mb * 2**20 // (Runner.kv_bytes_per_token(model_config, dtype) * config.block_size)))
        self.kv = KVCacheManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(
            SchedulerKnobs(config.max_num_seqs, config.max_num_batched_tokens, config.long_prefill_token_threshold,
                           config.batching_mode, config.static_batch_size, config.dynamic_timeout_s,
                           config.preemption_mode),
            self.kv, config.policy)
        self._pending_batching_mode: tuple[str, str] | None = None   # (mode, source) until a batch boundary
        self.batch = PersistentBatch(config.layout, config.batch_capacity, self.max_model_len,
                                     -(-self.max_model_len // config.block_size))
        self.runner = Runner(self.loaded.model, num_blocks, config.block_size, dtype, cuda_graphs=config.cuda_graphs,
                             max_rows=config.batch_capacity, max_blocks_per_seq=self.batch.block_table.shape[1])
        self.kernel_note = _kernel_note(device, dtype)
        self.sampler = Sampler()
        self.eos_token_ids = frozenset(self.loaded.eos_token_ids)
        self.vocab_size = int(model_config.vocab_size)
        self.step_count = 0
        self.requests: dict[str, Request] = {}
        self._retired_from_batch: list[str] = []    # leave the persistent batch at the next step
        self._blocked_key: tuple[str, str] | None = None   # of the last AdmissionBlocked
        self._ids = itertools.count()
        self._arrivals = itertools.count()

    # -- events -------------------------------------------------------------------------

    def _emit(self, event_type, **fields) -> None:
        if self._sink is not None:
            self._sink(event_type(step=self.step_count, t=time.monotonic(), **fields))

    def snapshot(self, cause: str) -> ev.EngineSnapshot:
        """The whole request state as one event: running (running order), padding rows, waiting (queue order)."""
        scheduler, slot_of, kv = self.scheduler, self.batch.slot_of, self.kv
        members = ([(r, "running") for r in scheduler.running] + [(r, "padding") for r in scheduler.padding]
                   + [(r, r.status.value) for r in scheduler.waiting])
        requests = [r for r, _ in members]
        return ev.EngineSnapshot(
            step=self.step_count, t=time.monotonic(), cause=cause,
            request_ids=tuple(r.request_id for r in requests),
            statuses=tuple(status for _, status in members),
            slots=tuple(slot_of.get(r.request_id, -1) for r in requests),
            num_prompt_tokens=tuple(r.num_prompt_tokens for r in requests),
            num_output_tokens=tuple(r.num_output_tokens for r in requests),
            num_computed_tokens=tuple(r.num_computed_tokens for r in requests),
            num_blocks=tuple(kv.num_blocks_held(r.request_id) for r in requests),
            max_tokens=tuple(r.sampling.max_tokens for r in requests),
            kv_blocks_used=kv.num_used_blocks, kv_blocks_total=kv.num_blocks)

    def emit_snapshot(self, cause: str = "request") -> None:
        """Between steps (engine thread): publish the state, so a consumer that missed events resyncs."""
        if self._sink is not None:
            self._sink(self.snapshot(cause))

    # -- requests in ----------------------------------------------------------------------

    def tokenize(self, prompt: str | list[dict], chat: bool = False) -> list[int]:
        if chat:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False))
        return self.tokenizer.encode(prompt)

    def add_request(self, prompt: str | list[int] | list[dict], sampling: SamplingParams | None = None, *,
                    chat: bool = False, priority: int = 0, request_id: str | None = None) -> str:
        """Validate and queue a request; ValueError (naming the lengths) if it can never be served."""
        request = self.make_request(prompt, sampling, chat=chat, priority=priority, request_id=request_id)
        self.enqueue(request)
        return request.request_id

    def make_request(self, prompt: str | list[int] | list[dict], sampling: SamplingParams | None = None, *,
                     chat: bool = False, priority: int = 0, request_id: str | None = None) -> Request:
        """Tokenize and validate without touching the queues (safe from any thread)."""
        sampling = sampling or SamplingParams()
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], dict)):
            if not prompt:
                raise ValueError("prompt is empty")
            token_ids = self.tokenize(prompt, chat)
        else:
            token_ids = [int(t) for t in prompt]
        if not token_ids:
            raise ValueError("prompt is empty")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size - 1}]")
        needed = len(token_ids) + sampling.max_tokens
        if needed > self.max_model_len:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({sampling.max_tokens}) = {needed} "
                             f"exceeds the model's context of {self.max_model_len} tokens")
        capacity = self.kv.num_blocks * self.kv.block_size
        if needed - 1 > capacity:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({sampling.max_tokens}) = {needed} "
                             f"exceeds the whole KV pool of {capacity} tokens")
        return Request(request_id or f"r{next(self._ids)}", token_ids, sampling, time.monotonic(),
                       priority=priority, arrival_seq=next(self._arrivals))

    def enqueue(self, request: Request) -> None:
        """Hand a validated request to the scheduler (engine thread only, between steps)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.scheduler.add(request)
        self._emit(ev.RequestArrived, request_id=request.request_id, num_prompt_tokens=request.num_prompt_tokens,
                   max_tokens=request.sampling.max_tokens, priority=request.priority)

    def release(self, request_id: str) -> None:
        """Forget a finished request (a long-running engine calls this once its result is read)."""
        request = self.requests.get(request_id)
        if request is not None and request.finished:
            del self.requests[request_id]

    def abort(self, request_id: str) -> bool:
        """Drop a waiting or running request and free its blocks; False if unknown or finished."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return False
        slot = self.batch.slot_of.get(request_id, -1)
        self._retire(request, "abort", slot)
        return True

    def _retire(self, request: Request, reason: str, slot: int) -> None:
        request.finish_time = time.monotonic()
        queued = request.status in (Status.WAITING, Status.PREEMPTED)
        self.sampler.forget(request.request_id)
        if self.scheduler.finish(request, reason, request.finish_time) and slot >= 0:
            self._retired_from_batch.append(request.request_id)
        wait_reasons, wait_s = request.wait_split if queued else ((), ())
        self._emit(ev.RequestRetired, request_id=request.request_id, reason=reason, slot=slot,
                   num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=request.num_output_tokens,
                   num_blocks=self.kv.num_blocks_held(request.request_id), wait_reasons=wait_reasons, wait_s=wait_s)

    def fail_running(self) -> list[RequestOutput]:
        """A step raised (its StepFailed is out): retire every running request with reason `error`
        so the engine can go on."""
        outputs = []
        for request in list(self.scheduler.running):
            self._retire(request, "error", self.batch.slot_of.get(request.request_id, -1))
            outputs.append(RequestOutput(request.request_id, [], True, "error"))
        return outputs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- one step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step; a step that raises is marked (StepFailed), the flight recorder's log written, and
        the error re-raised (the loop then calls `fail_running`)."""
        try:
            return self._step()
        except Exception as error:
            message = f"{type(error).__name__}: {error}"
            self._emit(ev.StepFailed, error=message)
            if self.flight is not None:
                self.flight.dump(f"step {self.step_count} raised", message)
            raise

    def _flight_header(self) -> dict:
        return {"model": self.config.model, "knobs": self.knobs(), "layout": self.config.layout,
                "device": self.config.device}

    def _step(self) -> list[RequestOutput]:
        if not self.scheduler.has_work():
            return []
        self._apply_pending_batching_mode()
        t0 = time.perf_counter()
        plan = self.scheduler.schedule(time.monotonic())
        if not (plan.rows or plan.admitted or plan.preempted or plan.released):
            self._note_blocked(plan.blocked)      # a dynamic batch waiting to fill: not a step
            return []
        self.step_count += 1
        t_schedule = time.perf_counter()
        self._update_batch(plan)
        rows = plan.rows
        if self._sink is not None:
            self._emit_plan(plan)
            self._note_blocked(plan.blocked)
        if not rows:
            return []
        arrays = self._row_arrays(rows)
        inputs = self.runner.prepare(self.batch.token_ids, self.batch.block_table, *arrays)
        t_prepare = time.perf_counter()
        logits = self.runner.forward(inputs)
        t_forward = time.perf_counter()
        sampling_rows = [rows[i] for i in np.flatnonzero(arrays[-1])]
        tokens = self.sampler.sample(logits, [(r.request.request_id, r.request.sampling) for r in sampling_rows])
        t_sample = time.perf_counter()
        outputs = self._update(rows, sampling_rows, tokens)
        t_update = time.perf_counter()
        if self._sink is not None:
            self._emit(ev.StepFinished, num_rows=len(rows), num_tokens=inputs.num_actual_tokens,
                       sampled_request_ids=tuple(r.request.request_id for r in sampling_rows),
                       num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                       kv_blocks_used=self.kv.num_used_blocks, kv_blocks_total=self.kv.num_blocks,
                       schedule_s=t_schedule - t0, prepare_s=t_prepare - t_schedule, forward_s=t_forward - t_prepare,
                       sample_s=t_sample - t_forward, update_s=t_update - t_sample,
                       num_padded_tokens=inputs.num_padded_tokens)
            interval = self.config.snapshot_interval_steps
            if interval and self.step_count % interval == 0:
                self.emit_snapshot("interval")
        return outputs

    def _note_blocked(self, blocked) -> None:
        """AdmissionBlocked when what stops the head of the queue (reason or head) changed."""
        key = blocked.key if blocked is not None else None
        if key == self._blocked_key:
            return
        self._blocked_key = key
        if blocked is not None:
            self._emit(ev.AdmissionBlocked, **dataclasses.asdict(blocked))

    def _update_batch(self, plan) -> None:
        """Mirror the scheduler's running set in the persistent batch, then sync block tables."""
        removed = (self._retired_from_batch + [r.request_id for r, _, _ in plan.preempted]
                   + [r.request_id for r, _ in plan.released])
        self._retired_from_batch = []
        slot_of = self.batch.slot_of
        for request, blocks_freed, tokens in plan.preempted:     # their slots, before the batch forgets them
            slot = slot_of.get(request.request_id, -1)
            if plan.retracting:
                self._emit(ev.RequestRetracted, request_id=request.request_id, slot=slot, blocks_freed=blocks_freed,
                           tokens_to_recompute=tokens, new_token_ratio=plan.new_token_ratio)
            else:
                self._emit(ev.RequestPreempted, request_id=request.request_id, slot=slot, blocks_freed=blocks_freed,
                           tokens_to_recompute=tokens, reason="kv pool exhausted")
        for request, blocks_freed in plan.released:
            self._emit(ev.PaddingReleased, request_id=request.request_id, slot=slot_of.get(request.request_id, -1),
                       blocks_freed=blocks_freed)
        update = self.batch.update(removed, [(r.request_id, r.prompt_token_ids + r.output_token_ids)
                                             for r in plan.admitted])
        for request in plan.admitted:
            reasons, seconds = request.wait_split
            self._emit(ev.RequestAdmitted, request_id=request.request_id, slot=slot_of[request.request_id],
                       num_computed_tokens=request.num_computed_tokens, resumed=request.num_preemptions > 0,
                       wait_reasons=reasons, wait_s=seconds)
        for move in update.moves + update.renumbered:
            self._emit(ev.RowMoved, request_id=move.request_id, from_slot=move.from_slot, to_slot=move.to_slot,
                       num_bytes=move.num_bytes)
        if removed or plan.admitted:
            self._emit(ev.BatchRebuilt, layout=self.batch.layout, rows_kept=update.rows_kept,
                       rows_added=update.rows_added, rows_removed=update.rows_removed, rows_moved=len(update.moves),
                       num_bytes=update.num_bytes)
        for row in plan.rows:
            request_id = row.request.request_id
            block_ids = self.kv.block_ids(request_id)
            num_new = self.batch.sync_blocks(request_id, block_ids)
            if num_new:
                self._emit(ev.BlocksAllocated, request_id=request_id, num_new_blocks=num_new,
                           num_blocks=len(block_ids))

    def _row_arrays(self, rows: list[Row]):
        """Rows in the layout's batch order as arrays: slots, starts, query lengths, samples."""
        slot_of = self.batch.slot_of
        slots = np.fromiter((slot_of[r.request.request_id] for r in rows), dtype=np.int64, count=len(rows))
        query_lens = np.fromiter((r.num_tokens for r in rows), dtype=np.int64, count=len(rows))
        order = self.batch.order(slots, np.fromiter((r.kind == "decode" for r in rows), dtype=bool, count=len(rows)))
        if not np.array_equal(order, slots):
            position = {slot: i for i, slot in enumerate(slots.tolist())}
            rows[:] = [rows[position[s]] for s in order.tolist()]
            slots, query_lens = order, query_lens[[position[s] for s in order.tolist()]]
        starts = np.fromiter((r.start for r in rows), dtype=np.int64, count=len(rows))
        samples = np.fromiter((r.samples for r in rows), dtype=bool, count=len(rows))
        return slots, starts, query_lens, samples

    def _update(self, rows: list[Row], sampling_rows: list[Row], tokens: list[int]) -> list[RequestOutput]:
        now = time.monotonic()
        for row in rows:
            if row.padding:
                continue
            request = row.request
            kind = row.kind                      # decided before the update
            request.num_computed_tokens += row.num_tokens
            if kind != "decode":
                self._emit(ev.PrefillChunk, request_id=request.request_id, num_tokens=row.num_tokens,
                           num_computed_tokens=request.num_computed_tokens, num_known_tokens=request.num_tokens,
                           recompute=kind == "recompute")
        outputs = []
        for row, token in zip(sampling_rows, tokens):
            request = row.request
            request.output_token_ids.append(token)
            self.batch.append_token(request.request_id, token)
            if request.first_token_time is None:
                request.first_token_time = now
                self._emit(ev.FirstToken, request_id=request.request_id, ttft_s=now - request.arrival_time)
            reason = self._stop_reason(request, token)
            if reason is not None:
                self._retire(request, reason, self.batch.slot_of[request.request_id])
            outputs.append(RequestOutput(request.request_id, [token], reason is not None, reason))
        return outputs

    def _stop_reason(self, request: Request, token: int) -> str | None:
        sampling = request.sampling
        if (token in self.eos_token_ids and not sampling.ignore_eos) or token in sampling.stop_token_ids:
            return "stop"
        if request.num_output_tokens >= sampling.max_tokens:
            return "length"
        return None

    def _emit_plan(self, plan) -> None:
        tokens = dict.fromkeys(ev.ROW_KINDS, 0)
        rows = dict.fromkeys(ev.ROW_KINDS, 0)
        for row in plan.rows:
            kind = row.kind
            tokens[kind] += row.num_tokens
            rows[kind] += 1
        self._emit(ev.StepPlanned, prefill_tokens=tokens["prefill"], recompute_tokens=tokens["recompute"],
                   decode_tokens=tokens["decode"], num_prefill_rows=rows["prefill"],
                   num_recompute_rows=rows["recompute"], num_decode_rows=rows["decode"],
                   num_padding_rows=rows["padding"], token_budget=plan.token_budget,
                   num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                   kv_blocks_used=self.kv.num_used_blocks, kv_blocks_total=self.kv.num_blocks)

    # -- knobs ------------------------------------------------------------------------------

    def knobs(self) -> dict[str, object]:
        """Every live knob's value; a batching mode waiting for the batch boundary shows as set."""
        values = {name: getattr(self.scheduler.knobs, name) for name in KNOBS}
        if self._pending_batching_mode is not None:
            values["batching_mode"] = self._pending_batching_mode[0]
        return values

    def validate_knob(self, name: str, value):
        """The value to set, or ValueError naming the allowed range; changes nothing."""
        return knob(name).parse(value, self.batch.capacity)

    def set_knob(self, name: str, value, source: str = "api") -> None:
        """Change a knob between steps; the next step obeys it. A batching mode change waits for the
        current static batch to end. ValueError (nothing changes) when the value is invalid."""
        value = self.validate_knob(name, value)
        old = self.knobs()[name]
        if name == "batching_mode":
            self._pending_batching_mode = (value, source)
            self._apply_pending_batching_mode()
            return
        setattr(self.scheduler.knobs, name, value)
        self.note_knob(name, old, value, source)

    def note_knob(self, name: str, old, new, source: str) -> None:
        """Announce a knob change (the engine's own, or one of a load driving it)."""
        self._emit(ev.KnobChanged, name=name, old=old, new=new, source=source)

    def _apply_pending_batching_mode(self) -> None:
        if self._pending_batching_mode is None:
            return
        knobs = self.scheduler.knobs
        at_boundary = knobs.batching_mode == "continuous" or not self.scheduler.running
        if at_boundary:
            (mode, source), self._pending_batching_mode = self._pending_batching_mode, None
            old, knobs.batching_mode = knobs.batching_mode, mode
            self.note_knob("batching_mode", old, mode, source)

    def refuse(self, command: str, message: str) -> None:
        """Record that a control command was invalid and changed nothing."""
        self._emit(ev.CommandRefused, command=command, message=message)

    def note_paused(self, paused: bool) -> None:
        self.scheduler.note_paused(time.monotonic(), paused)
        self._emit(ev.EnginePaused if paused else ev.EngineResumed)
        waiting = self.scheduler.waiting
        self._note_blocked(Blocked("paused", waiting[0].request_id, len(waiting), len(self.scheduler.running))
                           if paused and waiting else None)

    # -- blocking convenience ----------------------------------------------------------------

    def generate(self, prompts: Sequence[str | list[int]], sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, chat: bool = False) -> list[Completion]:
        """Run every prompt through the engine at once; completions in prompt order. The requests are
        released once read, so an engine that serves many `generate` calls does not keep them all."""
        params = sampling if isinstance(sampling, (list, tuple)) else [sampling or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, s, chat=chat) for p, s in zip(prompts, params)]
        while any(not self.requests[i].finished for i in ids):
            self.step()
        completions = [self.completion(i) for i in ids]
        for request_id in ids:
            self.release(request_id)
        return completions

    def completion(self, request_id: str) -> Completion:
        r = self.requests[request_id]
        return Completion(r.request_id, r.prompt_token_ids, list(r.output_token_ids),
                          self.tokenizer.decode(r.output_token_ids, skip_special_tokens=True), r.finish_reason,
                          r.arrival_time, r.first_token_time, r.finish_time, r.num_preemptions)


def _kernel_note(device: torch.device, dtype: torch.dtype) -> str | None:
    """What a dashboard header says when the C++ CPU kernels that this engine would use are off."""
    if device.type != "cpu" or dtype != torch.float32 or cpu.available():
        return None
    return f"C++ kernels off ({cpu.unavailable_reason()}): torch ops serve, slower"
