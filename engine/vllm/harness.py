"""vLLM's own scheduler on a virtual clock: no model, no device, no server.

    python -m batchtop.engine.vllm.harness --trace TRACE.json [--limits LIMITS.json]
        [--scheduler vllm|batchtop] [--step-time-s 0.02] [--events] > RESULT.json

(with vLLM's Python: batchtop's own environment has no vLLM). The way vLLM tests its scheduler:
`build_scheduler()` makes vLLM's `Scheduler` or `AsyncScheduler`, or batchtop's subclasses of them,
from a `VllmConfig` (CPU device) and a `KVCacheConfig` of `num_blocks` blocks; `Harness` adds a
trace's requests at their arrival times, aborts them at their abort times, and steps the scheduler:
`schedule()`, a made-up `ModelRunnerOutput` (every row whose prompt is then computed samples one
token; the token is a stop token at the request's output length, else `max_tokens` ends it), then
`update_from_output()`, the clock advanced by `step_time(scheduler_output)`. Under async scheduling
it follows vLLM's engine core (a batch queue of two): step N+1 is scheduled before N's output.

JSON in: a trace is a list of requests (`TraceRequest`'s fields: `arrival_s`, `prompt_token_ids` or
`num_prompt_tokens`, `output_len`, `max_tokens`, `priority`, `abort_s`); limits are `Limits`'
fields. JSON out: `steps` (one `StepRecord` each), `requests` (one `RequestRecord` each) and, under
batchtop's class with `--events`, the events as docs/events.md's JSON. A guest module: it imports
only batchtop's telemetry and vLLM.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

STOP_TOKEN = 2  # the made-up runner's token that ends a request before max_tokens
SAMPLED_TOKEN = 7  # every other sampled token
FIRST_PROMPT_TOKEN = 10  # prompts made from a length use ids from here on
VOCAB_SIZE = 32_000
MAX_IDLE_SCHEDULES = 100_000  # empty schedules in a row with nothing to wait for: the run is stuck
# A Llama config of no particular model: vLLM's ModelConfig reads config.json, never weights.
NO_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 32_768,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": STOP_TOKEN,
}


@dataclass(frozen=True)
class Limits:
    """The scheduler's limits and its KV pool (`num_blocks` includes vLLM's null block)."""

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    long_prefill_token_threshold: int = 0  # 0: no cap on a prompt's chunk
    max_model_len: int = 2048
    block_size: int = 16
    num_blocks: int = 41
    enable_prefix_caching: bool = False
    policy: str = "fcfs"  # fcfs | priority
    async_scheduling: bool = False


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    output_len: int
    prompt_token_ids: tuple[int, ...] | None = None
    num_prompt_tokens: int = 0  # when prompt_token_ids is None: distinct made-up ids
    max_tokens: int | None = None  # None: output_len (the request ends by length)
    priority: int = 0
    abort_s: float | None = None  # aborted from outside (finish_requests) at this time
    request_id: str | None = None  # None: its index in the trace


@dataclass(frozen=True)
class StepRecord:
    step: int  # 1, 2, ...: steps that scheduled tokens
    t_s: float  # the virtual clock when the step was scheduled
    step_s: float
    num_scheduled_tokens: dict[str, int]
    preempted_req_ids: list[str]
    finished_req_ids: list[str]  # ended by their output in this step
    num_running: int
    num_waiting: int
    kv_blocks_used: int


@dataclass
class RequestRecord:
    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    first_token_s: float | None = None
    finish_s: float | None = None
    finish_reason: str | None = None
    num_output_tokens: int = 0
    num_preemptions: int = 0


def scheduler_classes(kind: str) -> tuple[type, type]:
    """(synchronous, async) classes: vLLM's own ("vllm") or batchtop's ("batchtop")."""
    if kind == "vllm":
        return Scheduler, AsyncScheduler
    if kind == "batchtop":
        from .scheduler import BatchtopAsyncScheduler, BatchtopScheduler

        return BatchtopScheduler, BatchtopAsyncScheduler
    raise ValueError(f"unknown scheduler kind {kind!r}: vllm or batchtop")


def no_model_folder() -> str:
    folder = os.path.join(tempfile.gettempdir(), "batchtop-harness-model")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        with open(path + f".{os.getpid()}", "w") as out:
            json.dump(NO_MODEL_CONFIG, out)
        os.replace(path + f".{os.getpid()}", path)
    return folder


def build_scheduler(limits: Limits, kind: str = "vllm", model: str | None = None):
    """vLLM's scheduler (or batchtop's subclass) over `model`'s config.json (default: a made-up
    Llama config), on the CPU, with a pool of `limits.num_blocks` blocks. Under batchtop's class
    its observer and command queue run (events in `scheduler.batchtop_events`, knobs through
    `control.set_knob(scheduler, ...)`), never its side endpoint."""
    model_config = ModelConfig(
        model=model or no_model_folder(),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=limits.max_model_len,
        seed=0,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=limits.max_num_seqs,
        max_num_batched_tokens=limits.max_num_batched_tokens,
        max_model_len=limits.max_model_len,
        enable_chunked_prefill=True,
        policy=limits.policy,
        long_prefill_token_threshold=limits.long_prefill_token_threshold,
        async_scheduling=limits.async_scheduling,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(
        block_size=limits.block_size, enable_prefix_caching=limits.enable_prefix_caching
    )
    cache_config.num_gpu_blocks = limits.num_blocks
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        device_config=DeviceConfig(device="cpu"),
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=limits.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=limits.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            )
        ],
    )
    sync_cls, async_cls = scheduler_classes(kind)
    cls = async_cls if limits.async_scheduling else sync_cls
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=limits.block_size,
        **({"batchtop_endpoint": False} if kind == "batchtop" else {}),
    )


class Harness:
    """Steps `scheduler` through `trace` on a virtual clock. `between_steps(harness)`, when given,
    runs before every `schedule()` (knob changes, checks of the state after the last update)."""

    def __init__(
        self,
        scheduler,
        trace: list[TraceRequest],
        *,
        step_time: Callable[[object], float] = lambda output: 0.02,
        between_steps: Callable[[Harness], None] | None = None,
    ):
        self.scheduler = scheduler
        self.trace = sorted(
            ((r.request_id or str(i), r) for i, r in enumerate(trace)), key=lambda item: item[1].arrival_s
        )
        self.step_time = step_time
        self.between_steps = between_steps
        self.is_async = isinstance(scheduler, AsyncScheduler)
        self.clock_s = 0.0
        self.steps: list[StepRecord] = []
        self.in_flight: deque = deque()  # (scheduler output, runner output, clock) not yet updated
        self.requests: dict[str, RequestRecord] = {}
        self._next_arrival = 0
        self._aborts = sorted((r.abort_s, rid) for rid, r in self.trace if r.abort_s is not None)
        self._output_len: dict[str, int] = {}
        cache = scheduler.cache_config
        self._block_hasher = None
        if cache.enable_prefix_caching:
            from vllm.utils.hashing import get_hash_fn_by_name

            hash_fn = get_hash_fn_by_name(cache.prefix_caching_hash_algo)
            init_none_hash(hash_fn)
            self._block_hasher = get_request_block_hasher(scheduler.block_size, hash_fn)

    # -- the trace's side -------------------------------------------------------------------

    def _request(self, request_id: str, r: TraceRequest) -> Request:
        base = zlib.crc32(request_id.encode())  # the same made-up prompt in every process
        prompt = (
            list(r.prompt_token_ids)
            if r.prompt_token_ids is not None
            else [
                FIRST_PROMPT_TOKEN + (base + 7919 * i) % (VOCAB_SIZE - FIRST_PROMPT_TOKEN)
                for i in range(r.num_prompt_tokens)
            ]
        )
        max_tokens = r.max_tokens or r.output_len
        self._output_len[request_id] = r.output_len
        params = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            stop_token_ids=[STOP_TOKEN] if r.output_len < max_tokens else None,
        )
        return Request(
            request_id,
            prompt,
            params,
            None,
            arrival_time=r.arrival_s,
            priority=r.priority,
            block_hasher=self._block_hasher,
        )

    def _arrive_and_abort(self) -> None:
        while (
            self._next_arrival < len(self.trace)
            and self.trace[self._next_arrival][1].arrival_s <= self.clock_s
        ):
            request_id, r = self.trace[self._next_arrival]
            self._next_arrival += 1
            request = self._request(request_id, r)
            self.requests[request_id] = RequestRecord(request_id, r.arrival_s, len(request.prompt_token_ids))
            self.scheduler.add_request(request)
        while self._aborts and self._aborts[0][0] <= self.clock_s:
            _, request_id = self._aborts.pop(0)
            if request_id in self.scheduler.requests:
                self._finished(request_id, "abort")
                self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    def _next_event_s(self) -> float | None:
        times = [
            t
            for t in (
                self.trace[self._next_arrival][1].arrival_s if self._next_arrival < len(self.trace) else None,
                self._aborts[0][0] if self._aborts else None,
            )
            if t is not None
        ]
        return min(times) if times else None

    # -- the runner's side ------------------------------------------------------------------

    def runner_output(self, output) -> ModelRunnerOutput:
        """Right after `schedule()`: a row samples when its request has no prompt left to compute
        (vLLM's own `is_prefill_chunk`); the token stops the request at its output length."""
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for request_id in req_ids:
            request = self.scheduler.requests[request_id]
            if request.is_prefill_chunk:
                sampled.append([])
                continue
            # under async scheduling this step's token is already a placeholder
            index = (
                len(request.output_token_ids) + request.num_output_placeholders + (0 if self.is_async else 1)
            )
            sampled.append([STOP_TOKEN if index >= self._output_len[request_id] else SAMPLED_TOKEN])
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled
        )

    # -- the loop -----------------------------------------------------------------------------

    def run(self, max_steps: int | None = None) -> Harness:
        """Step until the trace is done (or `max_steps` steps that scheduled tokens)."""
        depth = 2 if self.is_async else 1  # vLLM's batch queue under async scheduling
        s = self.scheduler
        idle = 0
        while (max_steps is None or len(self.steps) < max_steps) and idle < MAX_IDLE_SCHEDULES:
            self._arrive_and_abort()
            if not s.has_requests() and not self.in_flight:
                next_s = self._next_event_s()
                if next_s is None:
                    break
                self.clock_s = max(self.clock_s, next_s)
                continue
            if s.has_requests():
                if self.between_steps is not None:
                    self.between_steps(self)
                output = s.schedule()
                idle = 0 if output.total_num_scheduled_tokens else idle + 1
                self.in_flight.append((output, self.runner_output(output), self.clock_s))
                if len(self.in_flight) < depth and output.total_num_scheduled_tokens > 0:
                    continue
            self._update(*self.in_flight.popleft())
        return self

    def _update(self, output, runner_output, scheduled_s: float) -> None:
        s = self.scheduler
        if output.total_num_scheduled_tokens == 0:
            s.update_from_output(output, runner_output)
            if not any(o.total_num_scheduled_tokens for o, _, _ in self.in_flight):
                next_s = self._next_event_s()  # nothing runs: on to the next arrival or abort
                self.clock_s = next_s if next_s is not None and next_s > self.clock_s else self.clock_s + 1e-3
            return
        step_s = float(self.step_time(output))
        self.clock_s = max(self.clock_s, scheduled_s) + step_s
        finished = []
        for outputs in s.update_from_output(output, runner_output).values():
            for out in outputs.outputs:
                record = self.requests[out.request_id]
                if out.new_token_ids and record.first_token_s is None:
                    record.first_token_s = self.clock_s
                record.num_output_tokens += len(out.new_token_ids)
                if out.finish_reason is not None:
                    finished.append(out.request_id)
                    self._finished(out.request_id, str(out.finish_reason))
        num_running, num_waiting = s.get_request_counts()
        pool = s.kv_cache_manager.block_pool
        self.steps.append(
            StepRecord(
                step=len(self.steps) + 1,
                t_s=scheduled_s,
                step_s=step_s,
                num_scheduled_tokens=dict(output.num_scheduled_tokens),
                preempted_req_ids=sorted(output.preempted_req_ids or ()),
                finished_req_ids=finished,
                num_running=num_running,
                num_waiting=num_waiting,
                kv_blocks_used=pool.num_gpu_blocks - 1 - pool.get_num_free_blocks(),
            )
        )

    def _finished(self, request_id: str, reason: str) -> None:
        record = self.requests[request_id]
        if record.finish_reason is None:
            record.finish_s, record.finish_reason = self.clock_s, reason
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                record.num_preemptions = request.num_preemptions

    def result(self, with_events: bool = False) -> dict:
        out = {
            "steps": [dataclasses.asdict(s) for s in self.steps],
            "requests": [dataclasses.asdict(r) for r in self.requests.values()],
        }
        if with_events and hasattr(self.scheduler, "batchtop_events"):
            out["events"] = [e.to_dict() for e in self.scheduler.batchtop_events.drain()]
        return out


def read_trace(path: str) -> list[TraceRequest]:
    with open(path) as f:
        raw = json.load(f)
    rows = raw["requests"] if isinstance(raw, dict) else raw
    names = {f.name for f in dataclasses.fields(TraceRequest)}
    trace = []
    for i, row in enumerate(rows):
        unknown = set(row) - names
        if unknown:
            raise ValueError(
                f"trace request {i}: unknown field(s) {', '.join(sorted(unknown))}; "
                f"fields: {', '.join(sorted(names))}"
            )
        if row.get("prompt_token_ids") is not None:
            row = {**row, "prompt_token_ids": tuple(row["prompt_token_ids"])}
        trace.append(TraceRequest(**row))
    return trace


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m batchtop.engine.vllm.harness", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--trace", required=True, help="a JSON list of requests (TraceRequest's fields)")
    parser.add_argument("--limits", help="a JSON object of Limits' fields")
    parser.add_argument("--scheduler", choices=("vllm", "batchtop"), default="vllm")
    parser.add_argument("--step-time-s", type=float, default=0.02, help="the virtual time of every step")
    parser.add_argument("--model", help="a model folder whose config.json vLLM reads (default: none needed)")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument(
        "--events", action="store_true", help="include batchtop's events (--scheduler batchtop)"
    )
    args = parser.parse_args(argv)
    try:
        trace = read_trace(args.trace)
        limits = Limits()
        if args.limits:
            with open(args.limits) as f:
                limits = Limits(**json.load(f))
    except (OSError, ValueError, TypeError) as error:
        print(f"harness: {error}", file=sys.stderr)
        return 2
    scheduler = build_scheduler(limits, args.scheduler, args.model)
    harness = Harness(scheduler, trace, step_time=lambda output: args.step_time_s).run(args.max_steps)
    json.dump(harness.result(with_events=args.events), sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
