"""batchtop's engine without a model: its own scheduler, KV pool, persistent batch and step events on a
virtual clock.

A step is the engine's: `Scheduler.schedule` plans, `PersistentBatch.apply` follows the plan,
`StepEvents` reports it; the forward pass is made up: a row whose prompt is done samples one token,
a stop token when the request reaches the output length it was recorded with (a `length` request
runs to its max_tokens, as it did). The clock reads what the caller's step times say, so the events
are a real recording's events, with a real recording's times when the caller gives the recorded ones.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from batchtop.engine.core.batch import BatchStep, PersistentBatch
from batchtop.engine.core.kv_cache import ROOT, CacheLookup, KVCacheManager, block_hash
from batchtop.engine.core.request import Request, Status
from batchtop.engine.core.sampling import SamplingParams
from batchtop.engine.core.scheduler import Scheduler, SchedulerKnobs
from batchtop.engine.core.scheduler_output import Row
from batchtop.engine.core.step_events import Sink, StepEvents, StepTimes
from batchtop.telemetry import events as ev

from .recording import EngineSetup, InFlight, PromptTokens, Recording, TraceRequest

STOP_TOKEN = 2                  # a request ends on it; the made-up prompt and output ids count from 3


@dataclass(frozen=True)
class StepShape:
    """What a step computed, the step-time model's inputs."""
    num_rows: int
    prefill_tokens: int          # tokens of prefill and recompute rows
    decode_rows: int             # decode and padding rows (one token each)
    head_rows: int               # rows whose last token goes through the LM head (here: those that sample)
    context_tokens: int          # sum of the rows' sequence lengths: KV read by attention
    prefill_attention: int       # sum over prefill rows of chunk x sequence length
    start_s: float = 0.0         # when it began on the virtual clock (the machine's load then)

    @property
    def log_decode_rows(self) -> float:
        """log2(1 + decode_rows): a law's term for a step cost concave in its rows (the vLLM harness's
        DERIVED_FEATURES has the same)."""
        return math.log2(1 + self.decode_rows)


@dataclass(frozen=True)
class PhaseTimes:
    """One step's phases in seconds, as StepFinished carries them."""
    schedule_s: float
    prepare_s: float
    forward_s: float
    sample_s: float
    update_s: float

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.prepare_s + self.forward_s + self.sample_s + self.update_s


@dataclass(frozen=True)
class _Executed:
    """The made-up forward pass, in the fields StepEvents reads of the engine's."""
    sampled: list[Row]
    token_ids: list[int]
    num_tokens: int
    num_padded_tokens: int = 0


class VirtualEngine:
    def __init__(self, setup: EngineSetup, knobs: dict, sink: Sink | None,
                 snapshot_interval_steps: int = 1000):
        if knobs.get("max_num_seqs", 0) > setup.batch_capacity:
            raise ValueError(f"max_num_seqs={knobs['max_num_seqs']} is above the recorded engine's batch "
                             f"capacity of {setup.batch_capacity} rows")
        self.now = 0.0
        self.setup = setup
        # prompts share the blocks the recorded ones shared; outputs are each request's own, but where
        # later prompts send them back
        self.kv = KVCacheManager(setup.num_kv_blocks, setup.block_size,
                                 enable_caching=setup.enable_prefix_caching)
        self.tokens = PromptTokens(setup.block_size, first=STOP_TOKEN + 1)
        self.scheduler = Scheduler(SchedulerKnobs(**knobs), self.kv, setup.policy, frozenset({STOP_TOKEN}))
        self.batch = PersistentBatch(setup.layout, setup.batch_capacity, setup.max_model_len,
                                     -(-setup.max_model_len // setup.block_size))
        self._sink = sink
        self.events = StepEvents(sink, self.scheduler, self.batch, self.kv, snapshot_interval_steps,
                                 clock=lambda: self.now)
        self.step_count = 0
        self.requests: dict[str, Request] = {}
        self._stops_at: dict[str, int] = {}        # output length at which a `stop` request samples stop
        self._pending_mode: str | None = None
        self.shapes: list[StepShape] = []
        self.num_retired_last = 0                  # requests the last step finished

    def _emit(self, event_type, **fields) -> None:
        if self._sink is not None:
            self._sink(event_type(step=self.step_count, t=self.now, **fields))

    # -- between steps --------------------------------------------------------------------

    def add(self, item: TraceRequest, now: float, announce: bool = True) -> None:
        """Take in a request that arrived at `item.arrival_s` and could enter at `item.entry_s` (at or
        before `now`, a step boundary); its RequestArrived event where `announce`."""
        self.now = now
        request = Request(item.request_id, self.tokens.prompt(item),
                          SamplingParams(max_tokens=item.max_tokens), min(now, item.arrival_s),
                          priority=item.priority, arrival_seq=len(self.requests))
        self.requests[item.request_id] = request
        request.prompt_blocks = self.kv.prompt_blocks(item.request_id, request.prompt_token_ids)
        if item.stops:
            self._stops_at[item.request_id] = item.num_output_tokens
        self.scheduler.add(request)
        if announce:
            self._emit(ev.RequestArrived, request_id=item.request_id,
                       num_prompt_tokens=item.num_prompt_tokens, max_tokens=item.max_tokens,
                       priority=item.priority, since_arrival_s=now - request.arrival_time,
                       input_s=item.input_s, prompt_blocks=request.prompt_blocks)

    def start_from(self, rec: Recording, now: float) -> None:
        """Start from the requests a recording joined, as its first snapshot had them (`InFlight`), and
        from retraction's estimate then, where it says; outputs that later prompts send back are made up
        as those prompts name them (Recording.continued_blocks)."""
        self.tokens.continued = rec.continued_blocks
        for item in rec.in_flight:
            self._take_in_flight(item, now)
        if rec.start_new_token_ratio is not None:
            self.scheduler.new_token_ratio = rec.start_new_token_ratio
        if rec.start_free_blocks is not None and self.kv.enable_caching:
            self.kv.restore_free_queue(self._free_queue(rec, rec.start_free_blocks))

    def _free_queue(self, rec: Recording, names: tuple[str, ...]) -> list[tuple[bytes, bytes] | None]:
        """The snapshot's free queue in this engine's hashes: a cached block that some prompt of the
        recording names gets the hash that prompt's made-up tokens give it (and its prefix's first),
        one no prompt names a hash of its own (never hit, evicted in its turn)."""
        hashes: dict[str, tuple[bytes, bytes]] = {}
        for name, parent in rec.block_parents().items():
            h = block_hash(hashes[parent][0] if parent else ROOT, self.tokens.block(name))
            hashes[name] = (h, hashes[parent][1] if parent else h)
        queue = []
        for name in names:
            own = ("unseen " + name).encode()
            queue.append(None if not name else hashes.get(name, (own, own)))
        return queue

    def _take_in_flight(self, item: InFlight, now: float) -> None:
        """A running request (or a static batch's padding row) in its row of the batch with its computed
        tokens and KV blocks, a waiting or preempted one at the back of the queue; no arrival event (the
        recording holds none)."""
        self.add(item.request, now, announce=False)
        request = self.requests[item.request.request_id]
        request.output_token_ids = [self.tokens.output(request.request_id, request.num_prompt_tokens, index)
                                    for index in range(item.num_output_tokens)]
        if item.num_output_tokens:
            request.first_token_time = request.arrival_time      # its first token came before: none again
        request.num_preemptions = item.num_preemptions
        if item.status == "preempted":
            request.status = Status.PREEMPTED
        if item.status not in ("running", "padding"):
            return
        self.scheduler.waiting.remove(request)
        tokens = max(item.num_computed_tokens, (item.num_blocks - 1) * self.kv.block_size + 1)
        if item.num_blocks and self.kv.try_allocate(request.request_id, tokens,
                                                    self._shared(request, item)) is None:
            raise ValueError(f"{request.request_id}: its {item.num_blocks} KV blocks at the recording's "
                             f"start do not fit the pool of {self.setup.num_kv_blocks}")
        request.num_computed_tokens, request.admit_time = item.num_computed_tokens, now
        self.kv.cache_computed(request.request_id, request.all_token_ids, item.num_computed_tokens)
        if item.status == "padding":
            request.status, request.finish_reason = Status.FINISHED, "length"
            self.scheduler.padding.append(request)
        else:
            request.status = Status.RUNNING
            self.scheduler.running.append(request)
        self.batch.place(request.request_id, item.slot, request.all_token_ids)
        self.batch.sync_blocks(request.request_id, self.kv.block_ids(request.request_id))

    def _shared(self, request: Request, item: InFlight) -> CacheLookup:
        """The blocks a running request joined shares with those taken in before it: its cached leading
        blocks among its computed tokens, as many as the cache gave it at its admission where the
        snapshot says."""
        found = self.kv.lookup(request.request_id, request.all_token_ids)
        num_shared = item.num_computed_tokens // self.kv.block_size
        if item.num_hit_blocks is not None:
            num_shared = min(num_shared, item.num_hit_blocks)
        shared = found.block_ids[:num_shared]
        return replace(found, block_ids=shared, num_cached_tokens=len(shared) * self.kv.block_size)

    def abort(self, request_id: str, now: float, reason: str = "abort") -> bool:
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return False
        self.now = now
        queued = request.status in (Status.WAITING, Status.PREEMPTED)
        slot = self.batch.slot_of.get(request_id, -1)
        self.scheduler.finish(request, reason, now)
        self.events.retired(self.step_count, request, reason, slot, queued)
        return True

    def set_knob(self, name: str, value, now: float, source: str = "whatif") -> None:
        """As Engine.set_knob: a batching mode change waits for the batch boundary."""
        self.now = now
        if name == "batching_mode":
            self._pending_mode = value
            self._apply_pending_mode()
            return
        old = getattr(self.scheduler.knobs, name)
        setattr(self.scheduler.knobs, name, value)
        self._emit(ev.KnobChanged, name=name, old=old, new=value, source=source)

    def _apply_pending_mode(self) -> None:
        knobs = self.scheduler.knobs
        if self._pending_mode is None or knobs.batching_mode != "continuous" and self.scheduler.running:
            return
        old, knobs.batching_mode, self._pending_mode = knobs.batching_mode, self._pending_mode, None
        self._emit(ev.KnobChanged, name="batching_mode", old=old, new=knobs.batching_mode, source="whatif")

    def note_paused(self, paused: bool, now: float) -> None:
        self.now = now
        self.scheduler.note_paused(now, paused)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- one step -------------------------------------------------------------------------

    def try_step(self, start: float, times: Callable[[StepShape], PhaseTimes]) -> PhaseTimes | None:
        """One step starting at `start`, its phases from `times(shape)`; None when the scheduler had no
        step to run (nothing to do, or a dynamic batch still forming)."""
        if not self.scheduler.has_work():
            return None
        self.now = start
        self._apply_pending_mode()
        plan = self.scheduler.schedule(start)
        if not plan.is_step:
            self.events.blocked(self.step_count, plan.blocked)
            return None
        self.step_count += 1
        batch_step = self.batch.apply(plan, self.kv)
        shape = _shape(batch_step, start)
        phases = times(shape)
        self.shapes.append(shape)
        self.now = start + phases.schedule_s
        self.events.planned(self.step_count, plan, batch_step)
        if not batch_step.rows:
            return phases
        sampled = [row for row in batch_step.rows if row.samples]
        token_ids = [self._token(row.request) for row in sampled]
        self.batch.append_tokens(sampled, token_ids)
        sampled_at = start + phases.schedule_s + phases.prepare_s + phases.forward_s + phases.sample_s
        result = self.scheduler.update_from_output(batch_step.rows, sampled, token_ids, sampled_at)
        self.num_retired_last = sum(token.finish_reason is not None for token in result.sampled)
        self.now = start + phases.total_s
        executed = _Executed(sampled, token_ids, int(batch_step.query_lens.sum()))
        self.events.finished(self.step_count, batch_step, executed, result,
                             StepTimes(start, start + phases.schedule_s,
                                       start + phases.schedule_s + phases.prepare_s,
                                       sampled_at - phases.sample_s, sampled_at, self.now))
        return phases

    def _token(self, request: Request) -> int:
        stops_at = self._stops_at.get(request.request_id)
        last = stops_at is not None and request.num_output_tokens + 1 >= stops_at
        if last:
            return STOP_TOKEN
        return self.tokens.output(request.request_id, request.num_prompt_tokens, request.num_output_tokens)


def _shape(batch_step: BatchStep, start_s: float) -> StepShape:
    prefill_tokens = decode_rows = context = attention = 0
    for row, start, num_tokens in zip(batch_step.rows, batch_step.starts.tolist(),
                                      batch_step.query_lens.tolist()):
        seq_len = start + num_tokens
        context += seq_len
        if row.padding or row.kind == "decode":
            decode_rows += 1
        else:
            prefill_tokens += num_tokens
            attention += num_tokens * seq_len
    sampled = int(batch_step.samples.sum())
    return StepShape(len(batch_step.rows), prefill_tokens, decode_rows, sampled, context, attention, start_s)
