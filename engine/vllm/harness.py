"""vLLM's own scheduler on a virtual clock: no model, no device, no server.

    python -m batchtop.engine.vllm.harness --trace TRACE.json [--limits LIMITS.json]
        [--scheduler vllm|batchtop] [--step-time-s 0.02 | --step-time STEP_TIME.json] [--events]
        > RESULT.json
    python -m batchtop.engine.vllm.harness --serve    # one job a line on stdin, one result a line out

(with vLLM's Python: batchtop's own environment has no vLLM). The way vLLM tests its scheduler:
`build_scheduler()` makes vLLM's `Scheduler` or `AsyncScheduler`, or batchtop's subclasses of them,
from a `VllmConfig` (CPU device) and a `KVCacheConfig` of `num_blocks` blocks; `Harness` adds a
trace's requests at their arrival times, aborts them at their abort times, and steps the scheduler:
`schedule()`, a made-up `ModelRunnerOutput` (every row whose prompt is then computed samples one
token; the token is a stop token at the request's output length, else `max_tokens` ends it), then
`update_from_output()`, the clock advanced by `step_time(scheduler_output)`. Under async scheduling
it follows vLLM's engine core (a batch queue of two): step N+1 is scheduled before N's output.

JSON in: a trace is a list of requests (`TraceRequest`'s fields: `arrival_s`, `prompt_token_ids` or
`num_prompt_tokens`, `output_len`, `max_tokens`, `priority`, `abort_s`, `output_token_ids`: its
first sampled tokens, where a later prompt sends them back); limits are `Limits`'
fields; `joined` (`Joined`'s fields) lists requests already in the scheduler when the run starts (a
recording joined mid-run: running ones with their KV blocks, the rest queued; under async scheduling
with the step then in flight, `num_in_flight_tokens` of each row). A step time is a constant, a
table (`{"table_s": [...]}`: the k-th step that schedules tokens lasts `table_s[k]`, and starts no
earlier than `starts_s[k]` where given, a recording's own timeline: is scheduled no earlier, or
under async scheduling runs no earlier) or a linear law
over the step's shape, what `batchtop whatif` fits: the forward `{"law": {feature: seconds per
unit}, "intercept_s": a}` (features of `StepRecord`) times a constant `"scale"` or a factor drawn
per step from a recorded `"slowdown"` (telemetry/slowdown.py's fields, with `"seed"`), plus an
unscaled `"overhead": {"intercept_s": b, feature: seconds per unit}`.
JSON out: `steps` (one `StepRecord` each), `requests` (one `RequestRecord` each) and, under
batchtop's class with `--events`, the events as docs/events.md's JSON, stamped with the virtual
clock (their times and step timings are the virtual ones, as a recording of the run would read),
with `header`: a recording's header naming this vLLM; or, for a job with `summary`, the figures
of those events (telemetry/run_stats.py's summary, computed here: a what-if that needs only its
table ships no events). `--serve` keeps one vLLM import for many runs: each stdin line is a job
(`trace`, `limits`, `scheduler`, `step_time`, `events`, `summary`), each result one line on stdout
(vLLM's own logging goes to stderr). A guest module: it imports only batchtop's telemetry and vLLM.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import operator
import os
import random
import sys
import tempfile
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    get_request_block_hasher,
    hash_block_tokens,
    init_none_hash,
    make_block_hash_with_group_id,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from batchtop.telemetry.run_stats import Metrics
from batchtop.telemetry.slowdown import Slowdown

SHAPE_FEATURES = ("num_rows", "prefill_tokens", "decode_rows", "head_rows", "context_tokens",
                  "prefill_attention")
# features a law may name beside the shape's own, computed from it (batchtop's StepShape has the same)
DERIVED_FEATURES = {"log_decode_rows": lambda shape: math.log2(1 + shape["decode_rows"])}
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
    output_token_ids: tuple[int, ...] = ()  # its first sampled tokens (a later prompt sends them back)


@dataclass(frozen=True)
class Joined:
    """A request already in the scheduler when the run begins, as a recording joined mid-run found it
    (its first snapshot's entry): a running one holds its KV blocks and its row of the batch, the
    others queue in the snapshot's order."""

    request: TraceRequest  # with its request_id; arrival_s at or before the run's start
    status: str  # running | waiting | preempted
    slot: int = -1  # its row of the batch (running)
    num_output_tokens: int = 0  # generated before the run began
    num_computed_tokens: int = 0
    num_blocks: int = 0  # KV blocks it held
    num_preemptions: int = 0
    num_hit_blocks: int | None = None  # leading blocks the prefix cache gave it at its admission
    num_in_flight_tokens: int = 0  # of its computed tokens, those of the step in flight (async)


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
    # what the step computed (the step-time law's features)
    num_rows: int = 0
    prefill_tokens: int = 0  # tokens of rows still computing a prompt (or recomputing one)
    decode_rows: int = 0
    head_rows: int = 0  # rows through the LM head: all (vLLM's runner takes every row's last logits)
    context_tokens: int = 0  # sum of the rows' sequence lengths after the step
    prefill_attention: int = 0  # sum over prefill rows of chunk x sequence length


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


def build_scheduler(limits: Limits, kind: str = "vllm", model: str | None = None, *, endpoint: bool = False):
    """vLLM's scheduler (or batchtop's subclass) over `model`'s config.json (default: a made-up
    Llama config), on the CPU, with a pool of `limits.num_blocks` blocks. Under batchtop's class
    its observer and command queue run (events in `scheduler.batchtop_events`, knobs through
    `control.set_knob(scheduler, ...)`); its side endpoint only with `endpoint=True` (started on
    $BATCHTOP_EVENTS_PORT as inside a server)."""
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
        **({"batchtop_endpoint": endpoint} if kind == "batchtop" else {}),
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
        step_starts: list[float] | None = None,
        events_to: Callable[[list], None] | None = None,
        joined: list[Joined] = (),
        free_blocks: list[str] = (),
        blocks: dict[str, list] | None = None,
    ):
        self.scheduler = scheduler
        self._joining = list(joined)  # taken in when the run starts (on its clock)
        # the pool's free queue then (a cached block by name, "" an empty one), and each name's parent
        # name and tokens: cached under the hash vLLM gives those tokens
        self._free_names, self._blocks = list(free_blocks), blocks or {}
        self.trace = sorted(
            ((r.request_id or str(i), r) for i, r in enumerate(trace)), key=lambda item: item[1].arrival_s
        )
        self.step_time = step_time
        self.between_steps = between_steps
        # the k-th step that schedules tokens starts no earlier than [k]: is scheduled no earlier, or
        # under async scheduling (planned while the step before runs) runs no earlier
        self.step_starts = step_starts
        # batchtop's events, handed over after every step (the class's buffer is bounded: a long run
        # would drop the oldest)
        self.events_to = events_to
        self._num_scheduled = 0
        self.is_async = isinstance(scheduler, AsyncScheduler)
        self.clock_s = 0.0
        self.steps: list[StepRecord] = []
        self.in_flight: deque = deque()  # (scheduler output, runner output, clock) not yet updated
        self.requests: dict[str, RequestRecord] = {}
        self._next_arrival = 0
        self._aborts = sorted(
            (r.abort_s, rid)
            for rid, r in [*self.trace, *((j.request.request_id, j.request) for j in joined)]
            if r.abort_s is not None
        )
        self._output_len: dict[str, int] = {}
        self._outputs: dict[str, tuple[int, ...]] = {}  # the trace's given output tokens
        self._shapes: dict[int, dict] = {}  # id(scheduler output): its shape, until its update
        cache = scheduler.cache_config
        self._block_hasher = self._hash_fn = None
        if cache.enable_prefix_caching:
            from vllm.utils.hashing import get_hash_fn_by_name

            hash_fn = self._hash_fn = get_hash_fn_by_name(cache.prefix_caching_hash_algo)
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
        if r.output_token_ids:
            self._outputs[request_id] = r.output_token_ids
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

    def _join(self) -> None:
        """The joined requests, in the scheduler as the snapshot had them: a running one in vLLM's running
        list (in order) with its computed tokens, output and KV blocks; a waiting or preempted one
        queued. vLLM's own `add_request`: the recording holds no arrival for them. Under async
        scheduling the step in flight at the snapshot is scheduled again first (`_schedule_in_flight`)."""
        s = self.scheduler
        observer = getattr(s, "batchtop_observer", None)
        taken = []
        for item in self._joining:
            r, request_id = item.request, item.request.request_id
            request = self._request(request_id, r)
            record = RequestRecord(request_id, r.arrival_s, request.num_prompt_tokens)
            self.requests[request_id] = record
            if item.num_output_tokens:
                request.append_output_token_ids([self._sampled(request_id, index)
                                                 for index in range(1, item.num_output_tokens + 1)])
                record.first_token_s, record.num_output_tokens = r.arrival_s, item.num_output_tokens
            request.num_preemptions = item.num_preemptions
            if item.status == "running":
                self._run_joined(request, item)
            taken.append((request, item))
        self._schedule_in_flight([(request, item) for request, item in taken if item.num_in_flight_tokens])
        for request, item in taken:
            if item.status != "running":
                Scheduler.add_request(s, request)
                if item.status == "preempted":
                    request.status = RequestStatus.PREEMPTED
            if observer is not None:
                slot = item.slot if item.status == "running" else -1
                observer.joined(request, slot, item.num_output_tokens)
        if observer is not None and taken:
            observer.mirror.fill_holes()
        self._joining = []
        if self._hash_fn is not None:
            self._restore_free_queue()

    def _run_joined(self, request, item: Joined) -> None:
        """A running request joined: in vLLM's running list with its KV blocks and computed tokens (less
        those of the step in flight, which `_schedule_in_flight` schedules)."""
        s = self.scheduler
        s.requests[request.request_id] = request
        request.status = RequestStatus.RUNNING
        computed = item.num_computed_tokens - item.num_in_flight_tokens
        if item.num_in_flight_tokens:
            tokens = computed
        else:
            tokens = max(computed, (item.num_blocks - 1) * s.block_size + 1)
        shared, num_shared = self._shared(request, item, computed)
        manager = s.kv_cache_manager
        if tokens and manager.allocate_slots(request, tokens - num_shared, num_shared, shared) is None:
            raise ValueError(f"{request.request_id}: its {item.num_blocks} KV blocks at the recording's "
                             "start do not fit the pool")
        request.num_computed_tokens = computed
        s.running.append(request)

    def _schedule_in_flight(self, rows: list[tuple[object, Joined]]) -> None:
        """Under async scheduling a snapshot falls while a step is in flight: its rows' tokens are counted
        as computed, their tokens not yet sampled. That step is scheduled again through vLLM's own
        `schedule()` over its rows alone, with a token budget of their tokens (its placeholders, blocks
        and in-flight counts as vLLM keeps them) and is the first in flight: the run's first update
        samples it, as the recording's first outcome did. Batchtop's class sees no plan of it (the
        recording holds none), only its outcome."""
        if not rows:
            return
        s = self.scheduler
        wanted = {request.request_id: item.num_in_flight_tokens for request, item in rows}
        running, budget, cap = s.running, s.max_num_scheduled_tokens, s.max_num_active_reqs
        observer = getattr(s, "batchtop_observer", None)
        s.running = [request for request in running if request.request_id in wanted]
        s.max_num_scheduled_tokens, s.max_num_active_reqs = sum(wanted.values()), len(wanted)
        if observer is not None:
            observer.before_schedule(s.running)
            s.batchtop_observer = None
        try:
            output = s.schedule()
        finally:
            s.running, s.max_num_scheduled_tokens, s.max_num_active_reqs = running, budget, cap
            s.batchtop_observer = observer
        if dict(output.num_scheduled_tokens) != wanted:
            raise ValueError("the step in flight at the recording's start does not schedule again as "
                             f"recorded: {dict(output.num_scheduled_tokens)} against {wanted}")
        if observer is not None:
            observer.in_flight_at_join(output, s.requests)
        self.shape_of(output)
        if self.step_starts:       # on a recording's timeline the step began before the recording did
            self.clock_s = min(self.clock_s, self.step_starts[0])
        self.in_flight.append((output, self.runner_output(output), self.clock_s))

    def _restore_free_queue(self) -> None:
        """The free queue's blocks, in order, cached as the snapshot had them: a name some prompt of the
        trace gives under the hash vLLM computes of its tokens, another under a hash of its own (never
        hit, evicted in its turn). A hash some block holds already leaves its block empty."""
        hashes: dict[str, BlockHash | None] = {}

        def hash_of(name: str) -> BlockHash | None:
            if name not in hashes:
                hashes[name] = None
                entry = self._blocks.get(name)
                if entry is not None:
                    parent = hash_of(entry[0]) if entry[0] else None
                    if parent is not None or not entry[0]:
                        hashes[name] = hash_block_tokens(self._hash_fn, parent, entry[1])
            return hashes[name]

        def prefix_of(name: str) -> str:
            while self._blocks.get(name, (None,))[0]:
                name = self._blocks[name][0]
            return name

        pool = self.scheduler.kv_cache_manager.block_pool
        observer = getattr(self.scheduler, "batchtop_observer", None)
        for block, name in zip(pool.free_block_queue.get_all_free_blocks(), self._free_names):
            if not name:
                continue
            h = hash_of(name) or BlockHash(("unseen " + name).encode())
            key = make_block_hash_with_group_id(h, 0)
            if pool.cached_block_hash_to_block.get_one_block(key) is not None:
                continue
            block.set_block_hash(key)
            pool.cached_block_hash_to_block.insert(key, block)
            if observer is not None and observer.cache is not None:
                observer.cache.restored(block, prefix_of(name) if hashes.get(name) else "")
        self._free_names = []

    def _shared(self, request, item: Joined, computed: int) -> tuple[object, int]:
        """The cached blocks a running request joined shares with those taken in before it (vLLM's own
        lookup), at most as many as the cache gave it at its admission (`num_hit_blocks`) and among its
        `computed` tokens: (blocks, tokens)."""
        manager = self.scheduler.kv_cache_manager
        blocks, num_cached = manager.get_computed_blocks(request)[:2]
        num_blocks = min(num_cached, computed) // self.scheduler.block_size
        if item.num_hit_blocks is not None:
            num_blocks = min(num_blocks, item.num_hit_blocks)
        if num_blocks == 0:
            return None, 0
        return manager.create_kv_cache_blocks(tuple(group[:num_blocks] for group in blocks.blocks)), \
            num_blocks * self.scheduler.block_size

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
            sampled.append([STOP_TOKEN if index >= self._output_len[request_id]
                            else self._sampled(request_id, index)])
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled
        )

    def _sampled(self, request_id: str, index: int) -> int:
        """Its `index`-th output token (from 1) short of its stop: the trace's, else SAMPLED_TOKEN."""
        given = self._outputs.get(request_id, ())
        return given[index - 1] if index <= len(given) else SAMPLED_TOKEN

    def shape_of(self, output) -> dict:
        """What a scheduled step computes (SHAPE_FEATURES), as `schedule()` left the requests."""
        shape = self._shapes.get(id(output))
        if shape is not None:
            return shape
        shape = dict.fromkeys(SHAPE_FEATURES, 0)
        for request_id, n in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            seq_len = request.num_computed_tokens  # already advanced by schedule()
            shape["num_rows"] += 1
            shape["head_rows"] += 1
            shape["context_tokens"] += seq_len
            if n == 1 and seq_len - 1 >= request.num_prompt_tokens:
                shape["decode_rows"] += 1
            else:
                shape["prefill_tokens"] += n
                shape["prefill_attention"] += n * seq_len
        self._shapes[id(output)] = shape
        return shape

    # -- the loop -----------------------------------------------------------------------------

    def run(self, max_steps: int | None = None) -> Harness:
        """Step until the trace is done (or `max_steps` steps that scheduled tokens)."""
        depth = 2 if self.is_async else 1  # vLLM's batch queue under async scheduling
        s = self.scheduler
        self._join()
        idle = 0
        while (max_steps is None or len(self.steps) < max_steps) and idle < MAX_IDLE_SCHEDULES:
            starts, k = self.step_starts, self._num_scheduled
            if not self.is_async and starts is not None and k < len(starts):
                self.clock_s = max(self.clock_s, starts[k])
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
                if output.total_num_scheduled_tokens:
                    self.shape_of(output)
                    self._num_scheduled += 1
                self.in_flight.append((output, self.runner_output(output), self.clock_s))
                if len(self.in_flight) < depth and output.total_num_scheduled_tokens > 0:
                    continue
            self._update(*self.in_flight.popleft())
            if self.events_to is not None:
                self.events_to(s.batchtop_events.drain())
        if self.events_to is not None:
            self.events_to(s.batchtop_events.drain())
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
        shape = self._shapes.pop(id(output), None) or self.shape_of(output)
        start_s = max(self.clock_s, scheduled_s)
        k = len(self.steps)
        if self.is_async and self.step_starts is not None and k < len(self.step_starts):
            # planned while the step before ran: its recorded start is where it began to run
            start_s = max(start_s, self.step_starts[k])
        self.clock_s = start_s + step_s
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
                **shape,
            )
        )

    def _finished(self, request_id: str, reason: str) -> None:
        record = self.requests[request_id]
        if record.finish_reason is None:
            record.finish_s, record.finish_reason = self.clock_s, reason
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                record.num_preemptions = request.num_preemptions

    def result(self, step_fields: tuple[str, ...] | None = None, with_requests: bool = True) -> dict:
        """The run as JSON-ready dicts: each step's `step_fields` (None: all of StepRecord's) and the
        request records unless `with_requests` is False."""
        names = step_fields or STEP_FIELDS
        out = {"steps": [{name: getattr(s, name) for name in names} for s in self.steps]}
        if with_requests:
            out["requests"] = [{name: getattr(r, name) for name in REQUEST_FIELDS}
                               for r in self.requests.values()]
        return out


STEP_FIELDS = tuple(f.name for f in dataclasses.fields(StepRecord))
REQUEST_FIELDS = tuple(f.name for f in dataclasses.fields(RequestRecord))


class VirtualTime:
    """`time` as batchtop's class inside vLLM reads it, on a harness's virtual clock: events stamped
    with it carry the virtual times, and the step timings (`forward_s`: from the end of `schedule()`
    to `update_from_output()`) come out as the step times the harness was given."""

    def __init__(self):
        self.harness: Harness | None = None

    def monotonic(self) -> float:
        return self.harness.clock_s if self.harness is not None else 0.0

    time = perf_counter = monotonic


@contextlib.contextmanager
def on_virtual_time(harness: Harness):
    """While inside, the events of batchtop's class under `harness` carry its virtual clock."""
    from . import observer, scheduler

    real = observer.time, scheduler.time
    clock = VirtualTime()
    clock.harness = harness
    observer.time = scheduler.time = clock
    try:
        yield harness
    finally:
        observer.time, scheduler.time = real


def step_time_from(spec, harness_of: Callable[[], Harness]) -> Callable[[object], float]:
    """A step-time function from a constant, `{"table_s": [...]}` or a law (see the module's text)."""
    if isinstance(spec, (int, float)):
        return lambda output: float(spec)
    if "table_s" in spec:
        table, taken = list(spec["table_s"]), [0]

        def from_table(output) -> float:
            k = taken[0]
            taken[0] += 1
            return float(table[k]) if k < len(table) else float(table[-1])

        return from_table
    law = _law_terms(spec["law"])
    intercept, scale = float(spec.get("intercept_s", 0.0)), float(spec.get("scale", 1.0))
    overhead = dict(spec.get("overhead", {}))
    overhead_intercept = float(overhead.pop("intercept_s", 0.0))
    overhead_terms = _law_terms(overhead)
    slowdown = Slowdown.from_dict(spec["slowdown"]) if "slowdown" in spec else None
    rng = random.Random(spec.get("seed", 0))

    def from_law(output) -> float:
        harness = harness_of()
        shape = harness.shape_of(output)
        forward = intercept + sum(c * get(shape) for get, c in law)
        factor = scale if slowdown is None else slowdown.draw(rng, shape["num_rows"], harness.clock_s)
        return forward * factor + overhead_intercept + sum(c * get(shape) for get, c in overhead_terms)

    return from_law


def _law_terms(law: dict) -> list[tuple[Callable[[dict], float], float]]:
    """(feature getter, coefficient) for each term of a law."""
    known = (*SHAPE_FEATURES, *DERIVED_FEATURES)
    unknown = set(law) - set(known)
    if unknown:
        raise ValueError(f"step-time law: unknown feature(s) {', '.join(sorted(unknown))}; "
                         f"features: {', '.join(known)}")
    return [(DERIVED_FEATURES.get(name) or operator.itemgetter(name), float(c)) for name, c in law.items()]


def recording_header(scheduler, limits: Limits) -> dict:
    """A recording's header for a run of batchtop's class under the harness: it names this vLLM."""
    import vllm

    from batchtop.telemetry.recorder import make_header

    knobs = {"max_num_seqs": scheduler.max_num_active_reqs,
             "max_num_batched_tokens": scheduler.max_num_scheduled_tokens,
             "long_prefill_token_threshold": scheduler.scheduler_config.long_prefill_token_threshold}
    header = make_header(None, knobs, device=f"vllm {vllm.__version__}",
                         engine=dataclasses.asdict(limits), harness=True)
    header["start_monotonic"] = 0.0
    return header


def run_job(job: dict) -> dict:
    """One run: `trace` (TraceRequest fields), `limits`, `scheduler`, `step_time`, `events`;
    `joined` (Joined's fields, `request` as a trace request's) the requests in the scheduler when it
    starts; `step_fields` (the StepRecord fields each step returns, default all) and `requests` (false:
    no request records) leave out what the caller does not read. Under batchtop's class `summary` (true)
    returns the run's figures (telemetry/run_stats.py's summary of its events) instead of the events,
    and `snapshot_before_step` k has the class publish its snapshot before the k-th step (what a
    recorder joining then starts with)."""
    trace = trace_of(job["trace"])
    joined = [Joined(**{**row, "request": trace_of([row["request"]])[0]}) for row in job.get("joined", ())]
    free_blocks = job.get("free_blocks", ())
    limits = Limits(**job.get("limits", {}))
    step_fields = step_fields_of(job)
    kind = job.get("scheduler", "vllm")
    # More requests running at the start than max_num_seqs: the worker's rows hold them and the admission
    # cap is max_num_seqs, binding as they finish (as batchtop's live knob lowers it)
    running = sum(item.status == "running" for item in joined)
    scheduler = build_scheduler(dataclasses.replace(limits, max_num_seqs=max(limits.max_num_seqs, running)),
                                kind, job.get("model"))
    scheduler.max_num_active_reqs = limits.max_num_seqs
    harness: list[Harness] = []
    spec = job.get("step_time", 0.02)
    step_time = step_time_from(spec, lambda: harness[0])
    starts = spec.get("starts_s") if isinstance(spec, dict) else None
    summary = job.get("summary", False) and kind == "batchtop"
    events = job.get("events", False) and kind == "batchtop" and not summary
    collected, metrics = [], Metrics()
    events_to = metrics.feed if summary else collected.extend if events else None
    snapshot_before = job.get("snapshot_before_step") if kind == "batchtop" else None

    def between_steps(h: Harness) -> None:
        nonlocal snapshot_before
        if snapshot_before is not None and len(h.steps) + 1 >= snapshot_before:
            scheduler.batchtop_snapshot("subscribe")
            snapshot_before = None

    harness.append(Harness(scheduler, trace, step_time=step_time, step_starts=starts, events_to=events_to,
                           joined=joined, free_blocks=free_blocks, blocks=job.get("blocks"),
                           between_steps=between_steps if snapshot_before else None))
    # the cycle collector paused for the run: it builds requests and events by the ten thousand and frees
    # none until the end, so a collection would walk them all for nothing
    collecting = gc.isenabled()
    gc.disable()
    try:
        with on_virtual_time(harness[0]) if events_to else contextlib.nullcontext():
            result = harness[0].run(job.get("max_steps")).result(step_fields, job.get("requests", True))
        if summary:
            result["summary"] = metrics.summary().to_dict()
        if events:
            result["events"] = [e.to_dict() for e in collected]
            result["header"] = recording_header(scheduler, limits)
    finally:
        if collecting:
            gc.enable()
    return result


def step_fields_of(job: dict) -> tuple[str, ...] | None:
    names = job.get("step_fields")
    if names is None:
        return None
    unknown = set(names) - set(STEP_FIELDS)
    if unknown:
        raise ValueError(f"step_fields: unknown field(s) {', '.join(sorted(unknown))}; "
                         f"fields: {', '.join(STEP_FIELDS)}")
    return tuple(names)


def serve(lines, out) -> int:
    """`--serve`: a job a line in, a result a line out (`{"error": ...}` for a bad job)."""
    for line in lines:
        if not line.strip():
            continue
        try:
            result = run_job(json.loads(line))
        except (ValueError, TypeError, KeyError) as error:
            result = {"error": f"{type(error).__name__}: {error}"}
        out.write(json.dumps(result) + "\n")
        out.flush()
    return 0


def read_trace(path: str) -> list[TraceRequest]:
    with open(path) as f:
        raw = json.load(f)
    return trace_of(raw)


def trace_of(raw) -> list[TraceRequest]:
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
        if row.get("output_token_ids"):
            row = {**row, "output_token_ids": tuple(row["output_token_ids"])}
        trace.append(TraceRequest(**row))
    return trace


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m batchtop.engine.vllm.harness", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--serve", action="store_true", help="run jobs read from stdin, one JSON a line")
    parser.add_argument("--trace", help="a JSON list of requests (TraceRequest's fields)")
    parser.add_argument("--limits", help="a JSON object of Limits' fields")
    parser.add_argument("--scheduler", choices=("vllm", "batchtop"), default="vllm")
    parser.add_argument("--step-time-s", type=float, default=0.02, help="the virtual time of every step")
    parser.add_argument("--step-time", help="a JSON file: {\"table_s\": [...]} or a law (see above)")
    parser.add_argument("--model", help="a model folder whose config.json vLLM reads (default: none needed)")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument(
        "--events", action="store_true", help="include batchtop's events (--scheduler batchtop)"
    )
    args = parser.parse_args(argv)
    if args.serve:
        out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # vLLM's logging must not mix with the results
        return serve(sys.stdin, out)
    if not args.trace:
        parser.error("--trace is required (or --serve)")
    try:
        with open(args.trace) as f:
            trace = json.load(f)
        job = {"trace": trace, "scheduler": args.scheduler, "events": args.events,
               "model": args.model, "max_steps": args.max_steps, "step_time": args.step_time_s}
        if args.limits:
            with open(args.limits) as f:
                job["limits"] = json.load(f)
        if args.step_time:
            with open(args.step_time) as f:
                job["step_time"] = json.load(f)
        trace_of(job["trace"])
        Limits(**job.get("limits", {}))
    except (OSError, ValueError, TypeError) as error:
        print(f"harness: {error}", file=sys.stderr)
        return 2
    json.dump(run_job(job), sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
