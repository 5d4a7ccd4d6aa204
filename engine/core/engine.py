"""The engine: requests in, one step at a time, events out.

A step is schedule → execute → update: the scheduler plans, the persistent batch follows the plan,
the runner computes the rows and the sampler picks their tokens, the scheduler takes the output.
StepEvents watches each step; knob changes and requests arrive between steps (engine thread).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from batchtop import kernels
from batchtop.engine.model.dims import ModelDims
from batchtop.engine.model.loading import LoadedModel, load_model
from batchtop.engine.model.runner import Runner
from batchtop.kernels import cpu
from batchtop.telemetry import events as ev
from batchtop.telemetry.flight import FlightRecorder

from . import openmp
from .admission import Blocked
from .batch import BatchStep, PersistentBatch
from .config import EngineConfig
from .knobs import KNOBS, knob
from .kv_cache import KVCacheManager
from .request import Request, Status
from .sampling import Sampler, SamplingParams
from .scheduler import Scheduler, SchedulerKnobs
from .scheduler_output import Row, SchedulerOutput, StepResult
from .step_events import Sink, StepEvents, StepTimes


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


@dataclass
class Executed:
    """One step's forward pass and sampling."""
    sampled: list[Row]           # the rows that sampled, in batch order
    token_ids: list[int]         # one per sampled row
    num_tokens: int              # computed, static padding rows included
    num_padded_tokens: int       # computed only to fill a replayed CUDA graph


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
        block_bytes = ModelDims.of(model_config).kv_bytes_per_token(dtype) * config.block_size
        num_blocks = config.num_kv_blocks or max(1, int(config.kv_cache_mb * 2**20 // block_bytes))
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerKnobs.of(config), self.kv, config.policy,
                                   frozenset(self.loaded.eos_token_ids))
        self._pending_batching_mode: tuple[str, str] | None = None   # (mode, source) until a batch boundary
        self.batch = PersistentBatch(config.layout, config.batch_capacity, self.max_model_len,
                                     -(-self.max_model_len // config.block_size))
        self.runner = Runner(self.loaded.model, num_blocks, config.block_size, dtype,
                             cuda_graphs=config.cuda_graphs, max_rows=config.batch_capacity,
                             max_blocks_per_seq=self.batch.block_table.shape[1])
        self.kernels_off = _kernels_off(device, dtype)
        self.sampler = Sampler()
        self.events = StepEvents(self._sink, self.scheduler, self.batch, self.kv,
                                 config.snapshot_interval_steps)
        self.vocab_size = int(model_config.vocab_size)
        self.step_count = 0
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        # The load ran torch's parallel ops on this thread; the engine may step on another (EngineLoop),
        # and this thread's OpenMP workers would make a second team there (engine/core/openmp.py).
        openmp.release_workers()

    # -- events -------------------------------------------------------------------------

    def _emit(self, event_type, **fields) -> None:
        if self._sink is not None:
            self._sink(event_type(step=self.step_count, t=time.monotonic(), **fields))

    def snapshot(self, cause: str) -> ev.EngineSnapshot:
        """The whole request state as one event: running (running order), padding rows, waiting (queue
        order)."""
        return self.events.snapshot(self.step_count, cause)

    def emit_snapshot(self, cause: str = "request") -> None:
        """Between steps (engine thread): publish the state, so a consumer that missed events resyncs."""
        if self._sink is not None:
            self._sink(self.snapshot(cause))

    # -- requests in ----------------------------------------------------------------------

    def tokenize(self, prompt: str | list[dict], chat: bool = False) -> list[int]:
        if chat:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            return list(self.tokenizer.apply_chat_template(messages,
                                                           add_generation_prompt=True, tokenize=True,
                                                           return_dict=False))
        return self.tokenizer.encode(prompt)

    def add_request(self, prompt: str | list[int] | list[dict], sampling: SamplingParams | None = None, *,
                    chat: bool = False, priority: int = 0, request_id: str | None = None,
                    arrival_time: float | None = None) -> str:
        """Validate and queue a request; ValueError (naming the lengths) if it can never be served."""
        request = self.make_request(prompt, sampling, chat=chat, priority=priority, request_id=request_id,
                                    arrival_time=arrival_time)
        self.enqueue(request)
        return request.request_id

    def make_request(self, prompt: str | list[int] | list[dict], sampling: SamplingParams | None = None, *,
                     chat: bool = False, priority: int = 0, request_id: str | None = None,
                     arrival_time: float | None = None, received_time: float | None = None) -> Request:
        """Tokenize and validate without touching the queues (safe from any thread). `arrival_time`
        (time.monotonic()): when the request arrived, if before now; its TTFT counts from then.
        `received_time`: when a server received it, its arrival too, and the time from then to now (the
        server's input path: parsing, tokenizing, validating) its `input_s`."""
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
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({sampling.max_tokens}) = "
                             f"{needed} exceeds the model's context of {self.max_model_len} tokens")
        capacity = self.kv.num_blocks * self.kv.block_size
        if needed - 1 > capacity:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({sampling.max_tokens}) = "
                             f"{needed} exceeds the whole KV pool of {capacity} tokens")
        now = time.monotonic()
        given = received_time if received_time is not None else arrival_time
        arrived = now if given is None else min(given, now)
        return Request(request_id or f"r{next(self._ids)}", token_ids, sampling, arrived,
                       priority=priority, arrival_seq=next(self._arrivals),
                       input_s=now - arrived if received_time is not None else 0.0)

    def enqueue(self, request: Request) -> None:
        """Hand a validated request to the scheduler (engine thread only, between steps)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        request.prompt_blocks = self.kv.prompt_blocks(request.request_id, request.prompt_token_ids)
        self.scheduler.add(request)
        self._emit(ev.RequestArrived, request_id=request.request_id,
                   num_prompt_tokens=request.num_prompt_tokens, max_tokens=request.sampling.max_tokens,
                   priority=request.priority,
                   since_arrival_s=max(0.0, time.monotonic() - request.arrival_time),
                   input_s=request.input_s, prompt_blocks=request.prompt_blocks)

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
        self._retire(request, "abort")
        return True

    def fail_running(self) -> list[RequestOutput]:
        """A step raised (its StepFailed is out): retire every running request with reason `error`
        so the engine can go on."""
        outputs = []
        for request in list(self.scheduler.running):
            self._retire(request, "error")
            outputs.append(RequestOutput(request.request_id, [], True, "error"))
        return outputs

    def _retire(self, request: Request, reason: str) -> None:
        """Retire a request between steps; its row (if any) leaves the batch with the next plan."""
        queued = request.status in (Status.WAITING, Status.PREEMPTED)
        slot = self.batch.slot_of.get(request.request_id, -1)
        self.sampler.forget(request.request_id)
        self.scheduler.finish(request, reason, time.monotonic())
        self.events.retired(self.step_count, request, reason, slot, queued)

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
        times = StepTimes()
        plan = self._schedule()
        if plan is None:
            return []
        times.scheduled = time.perf_counter()
        batch_step = self.batch.apply(plan, self.kv)
        self.events.planned(self.step_count, plan, batch_step)
        if not batch_step.rows:
            return []
        executed = self._execute(batch_step, times)
        result = self.scheduler.update_from_output(batch_step.rows, executed.sampled, executed.token_ids,
                                                   time.monotonic())
        times.updated = time.perf_counter()
        self.events.finished(self.step_count, batch_step, executed, result, times)
        return self._outputs(result)

    def _schedule(self) -> SchedulerOutput | None:
        """The step's plan, counted; None when there is no step (nothing to do, or a dynamic batch
        waiting to fill)."""
        if not self.scheduler.has_work():
            return None
        self._apply_pending_batching_mode()
        plan = self.scheduler.schedule(time.monotonic())
        if not plan.is_step:
            self.events.blocked(self.step_count, plan.blocked)
            return None
        self.step_count += 1
        return plan

    def _execute(self, batch_step: BatchStep, times: StepTimes) -> Executed:
        """Prepare the rows' flat batch, run the model, sample the rows that caught up, and write their
        tokens into the persistent batch."""
        inputs = self.runner.prepare(self.batch.token_ids, self.batch.block_table, batch_step.slots,
                                     batch_step.starts, batch_step.query_lens, batch_step.samples)
        times.prepared = time.perf_counter()
        logits = self.runner.forward(inputs)
        times.forwarded = time.perf_counter()
        rows = batch_step.rows
        sampled = [rows[i] for i in np.flatnonzero(batch_step.samples)]
        token_ids = self.sampler.sample(logits, [(r.request.request_id, r.request.sampling) for r in sampled])
        self.batch.append_tokens(sampled, token_ids)
        times.sampled = time.perf_counter()
        return Executed(sampled, token_ids, inputs.num_actual_tokens, inputs.num_padded_tokens)

    def _outputs(self, result: StepResult) -> list[RequestOutput]:
        outputs = []
        for sampled in result.sampled:
            request_id, reason = sampled.request.request_id, sampled.finish_reason
            if reason is not None:
                self.sampler.forget(request_id)
            outputs.append(RequestOutput(request_id, [sampled.token_id], reason is not None, reason))
        return outputs

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
        blocked = None
        if paused and waiting:
            blocked = Blocked("paused", waiting[0].request_id, len(waiting), len(self.scheduler.running))
        self.events.blocked(self.step_count, blocked)

    # -- blocking convenience ----------------------------------------------------------------

    def generate(self, prompts: Sequence[str | list[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 chat: bool = False) -> list[Completion]:
        """Run every prompt through the engine at once; completions in prompt order. The requests are
        released once read, so an engine that serves many `generate` calls does not keep them all."""
        params = sampling if isinstance(sampling,
                                        (list, tuple)) else [sampling or SamplingParams()] * len(prompts)
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
                          self.tokenizer.decode(r.output_token_ids, skip_special_tokens=True),
                          r.finish_reason, r.arrival_time, r.first_token_time, r.finish_time,
                          r.num_preemptions)


def _kernels_off(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the C++ CPU kernels this engine would use are off (torch ops serve instead), or None."""
    if device.type != "cpu" or dtype != torch.float32 or cpu.available():
        return None
    return cpu.unavailable_reason()
