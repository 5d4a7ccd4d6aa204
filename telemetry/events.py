"""The event schema: small frozen records, each a past fact about one engine step.

Every event carries the engine step it belongs to and `t`, a monotonic time in
seconds (time.monotonic() on the engine's clock). Events hold ids and numbers,
never live objects or tensors, so they serialise as flat JSON objects:
`{"kind": "RequestAdmitted", "step": 3, "t": 12.5, ...}`.

Events are built with named fields only (kw_only): a reordered field cannot shift values.
Bump SCHEMA_VERSION whenever a field is added, removed or changes meaning.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

# 2: named fields, row kinds, blocks, snapshots, admission, failed steps, graph padding
# 3: prefix caching: cached tokens and the miss reason at admission, cached and evicted blocks, the
#    pool's cached (evictable) blocks
# 4: RequestArrived's since_arrival_s
# 5: RequestArrived's input_s
# 6: EngineSnapshot's priorities, num_preemptions and new_token_ratio (a replay can start from one)
# 7: RequestArrived's and EngineSnapshot's prompt_blocks, EngineSnapshot's num_hit_blocks and
#    free_blocks (a replay shares prefixes as the recorded prompts did)
SCHEMA_VERSION = 7


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    step: int
    t: float

    def to_dict(self) -> dict:
        out = {"kind": type(self).__name__}
        for name in _field_names(type(self)):
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, tuple) else value
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class StepPlanned(Event):
    """The scheduler's plan for this step, before the forward pass. Rows are of one kind each
    (ROW_KINDS): prefill, recompute, decode or padding."""
    prefill_tokens: int          # prompt tokens of requests never preempted
    recompute_tokens: int        # tokens of preempted requests catching up again (prompt + output)
    decode_tokens: int           # one per decoding row
    num_prefill_rows: int
    num_recompute_rows: int
    num_decode_rows: int
    num_padding_rows: int        # static mode: finished rows still computed as padding
    token_budget: int            # max_num_batched_tokens in force this step
    num_running: int
    num_waiting: int
    kv_blocks_used: int          # held by requests (a shared block once)
    kv_blocks_total: int
    kv_blocks_cached: int = 0    # free but holding a cached prefix (evictable); free = total - used - cached


@dataclass(frozen=True, slots=True, kw_only=True)
class StepFinished(Event):
    """The step is done: phase timings and who produced a token."""
    num_rows: int                # rows computed, static padding rows included (row-steps of this step)
    num_tokens: int              # tokens computed, static padding rows included; not the graph padding below
    sampled_request_ids: tuple[str, ...]   # rows that produced an output token (useful row-steps)
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    schedule_s: float
    prepare_s: float
    forward_s: float
    sample_s: float
    update_s: float
    num_padded_tokens: int = 0   # tokens computed only to fill a replayed CUDA graph (one per padding row)
    kv_blocks_cached: int = 0    # as StepPlanned's

    @property
    def step_s(self) -> float:
        """The step's time from its plan to its update: the phases summed."""
        return self.schedule_s + self.prepare_s + self.forward_s + self.sample_s + self.update_s


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestArrived(Event):
    """Taken in by the engine between steps; the request arrived `since_arrival_s` before (a server
    receives it while a step runs). Its TTFT and end-to-end time count from that arrival. `input_s`
    of that time went to the server's input path (from receiving the HTTP request to handing the
    engine the parsed, tokenized request), the rest to waiting for the step boundary."""
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    priority: int
    since_arrival_s: float = 0.0
    input_s: float = 0.0
    # The prompt's full blocks, each named by its prefix-cache hash (short hex, as prefix_id), where the
    # engine caches prefixes (empty where it does not): equal names, equal leading tokens.
    prompt_blocks: tuple[str, ...] = ()

    @property
    def arrival_t(self) -> float:
        """When the request arrived, on the events' clock."""
        return self.t - self.since_arrival_s


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestAdmitted(Event):
    """Moved from waiting to running, into batch row `slot`."""
    request_id: str
    slot: int
    num_computed_tokens: int     # at admission: its cached tokens
    resumed: bool                # True when it had been preempted or retracted before
    wait_reasons: tuple[str, ...] = ()   # this wait in the queue split by WAIT_REASONS (non-zero ones)
    wait_s: tuple[float, ...] = ()       # seconds per entry of wait_reasons; they sum to the wait
    # The prefix cache. Its full blocks before the last known token could hit; the cached ones are
    # shared; the rest missed for `miss_reason` (MISS_REASONS; "" when no full block missed: the last
    # partial block is never cached and is no miss).
    num_known_tokens: int = 0    # prompt + output tokens at admission: the cache's query
    num_cached_tokens: int = 0
    num_full_blocks: int = 0
    num_hit_blocks: int = 0
    miss_reason: str = ""
    num_matched_tokens: int = 0  # below_block: tokens in common with the closest cached first block
    evicted_ago_s: float = 0.0   # evicted: seconds since the missing block was evicted
    prefix_id: str = ""          # the request's first full block's hash (short hex); "" without one


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillChunk(Event):
    """A prefill or recompute row computed `num_tokens` of its known tokens: every row that is not
    decode or padding emits one (recompute: prompt + output again after a preemption)."""
    request_id: str
    num_tokens: int
    num_computed_tokens: int     # after this chunk
    num_known_tokens: int        # prompt + output tokens so far; the chunk is the last when equal
    recompute: bool = False      # the request was preempted before: it computes these tokens again


@dataclass(frozen=True, slots=True, kw_only=True)
class BlocksAllocated(Event):
    """The request's KV holding grew (admission, a chunk, a decode row crossing a block boundary)."""
    request_id: str
    num_new_blocks: int
    num_blocks: int              # held now


@dataclass(frozen=True, slots=True, kw_only=True)
class BlocksCached(Event):
    """Full blocks of the request's computed tokens became findable in the prefix cache."""
    request_id: str
    prefix_id: str
    num_new_blocks: int


@dataclass(frozen=True, slots=True, kw_only=True)
class BlocksEvicted(Event):
    """Cached free blocks were taken for new ones this step, least recently freed first; one entry per
    block: its id and whose prefix (first block's hash) it held."""
    block_ids: tuple[int, ...]
    prefix_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class FirstToken(Event):
    request_id: str
    ttft_s: float                # since arrival


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestRetired(Event):
    """Left the batch for good. reason: stop | length | abort | error."""
    request_id: str
    reason: str
    slot: int                    # -1 when it retired from the waiting queue
    num_prompt_tokens: int
    num_output_tokens: int
    num_blocks: int = 0          # held after retiring: > 0 only for a static batch's padding row
    wait_reasons: tuple[str, ...] = ()   # retired from the queue: its last wait, as RequestAdmitted's
    wait_s: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class PaddingReleased(Event):
    """A static batch ended: a finished row that stayed as padding leaves the batch and frees its blocks."""
    request_id: str
    slot: int
    blocks_freed: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RowMoved(Event):
    """condense: the highest row slid down into a hole; only its live token prefix was copied."""
    request_id: str
    from_slot: int
    to_slot: int
    num_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchRebuilt(Event):
    """Per-step cost of the persistent batch layout (condense | indexmap | gather).

    rows_kept/rows_added/rows_removed describe the membership change; rows_moved
    and num_bytes what the layout paid for it this step.
    """
    layout: str
    rows_kept: int
    rows_added: int
    rows_removed: int
    rows_moved: int
    num_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestPreempted(Event):
    """Recompute preemption: blocks freed, generated tokens kept, recomputed on readmission."""
    request_id: str
    slot: int
    blocks_freed: int
    tokens_to_recompute: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestRetracted(Event):
    """Retraction (SGLang style): like preemption, and the admission estimate rises."""
    request_id: str
    slot: int
    blocks_freed: int
    tokens_to_recompute: int
    new_token_ratio: float       # the ratio after this retraction


@dataclass(frozen=True, slots=True, kw_only=True)
class KnobChanged(Event):
    name: str
    old: object
    new: object
    source: str                  # cli | tui | api | test


@dataclass(frozen=True, slots=True, kw_only=True)
class CommandRefused(Event):
    """A control command was invalid and changed nothing."""
    command: str
    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class EnginePaused(Event):
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineResumed(Event):
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionBlocked(Event):
    """What stopped admission at the head of the waiting queue (emitted when the reason or the head
    changes). Fields that do not belong to `reason` are 0."""
    reason: str                  # one of WAIT_REASONS but "next_step"
    request_id: str              # the head of the queue
    num_waiting: int
    num_running: int
    tokens_left: int = 0         # budget: what was left of max_num_batched_tokens
    tokens_needed: int = 0       # budget: the head's next chunk
    limit: int = 0               # max_num_seqs: the knob; static_batch / dynamic_batch: the batch size B
    blocks_needed: int = 0       # kv: new blocks the head's first chunk needs
    blocks_free: int = 0
    blocks_reserved: int = 0     # kv, retract mode: kept free for the running requests' growth
    wait_more_s: float = 0.0     # dynamic_batch: until the timeout forms a partial batch

    def describe(self) -> str:
        """The reason in words, with its numbers."""
        head = f"head {self.request_id}"
        reason = self.reason
        if reason == "budget":
            return f"token budget spent — {head} needs {self.tokens_needed}, {self.tokens_left} left"
        if reason == "max_num_seqs":
            return f"max_num_seqs reached — {self.num_running} running of {self.limit}"
        if reason == "kv":
            reserve = f", {self.blocks_reserved} reserved" if self.blocks_reserved else ""
            return f"KV pool — {head} needs {self.blocks_needed} blocks, {self.blocks_free} free{reserve}"
        if reason == "static_batch":
            return f"static batch of {self.limit} still running ({self.num_running} rows)"
        if reason == "dynamic_batch":
            return (f"dynamic batch forming — {self.num_waiting} of {self.limit} waiting, "
                    f"waits {self.wait_more_s:.2f} s more")
        if reason == "preemption":
            return "no admission in a step that preempted"
        if reason == "paused":
            return "engine paused"
        return reason


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSnapshot(Event):
    """The engine's whole request state between steps, one entry per request in each tuple: running
    (running order), then padding rows, then waiting (queue order). A consumer that starts from it
    and folds the following events holds exactly the engine's state (telemetry.state)."""
    cause: str                   # subscribe | drop | interval | request
    request_ids: tuple[str, ...]
    statuses: tuple[str, ...]    # running | padding | waiting | preempted
    slots: tuple[int, ...]       # -1 when not in the batch
    num_prompt_tokens: tuple[int, ...]
    num_output_tokens: tuple[int, ...]
    num_computed_tokens: tuple[int, ...]
    num_blocks: tuple[int, ...]
    max_tokens: tuple[int, ...]
    kv_blocks_used: int
    kv_blocks_total: int
    kv_blocks_cached: int = 0
    priorities: tuple[int, ...] = ()      # per request (empty: not known)
    num_preemptions: tuple[int, ...] = () # per request (empty: not known)
    new_token_ratio: float | None = None  # retraction's admission estimate (None: the engine has none)
    prompt_blocks: tuple[tuple[str, ...], ...] = ()   # per request, as RequestArrived's (empty: not known)
    num_hit_blocks: tuple[int, ...] = ()  # per request, the cache's at its last admission (empty: not known)
    # the KV pool's free queue, the next block taken first: a cached block by name, "" an empty one
    free_blocks: tuple[str, ...] | None = None        # None: not known


@dataclass(frozen=True, slots=True, kw_only=True)
class StepFailed(Event):
    """The step raised: its running requests are retired with reason `error` next, and the engine goes on."""
    error: str                   # the exception's type and message


@dataclass(frozen=True, slots=True, kw_only=True)
class EventsDropped(Event):
    """Told to one subscriber whose buffer overflowed: its oldest `count` events were dropped."""
    count: int


EVENT_TYPES: dict[str, type[Event]] = {
    cls.__name__: cls
    for cls in (
        StepPlanned, StepFinished, RequestArrived, RequestAdmitted, PrefillChunk,
        FirstToken, RequestRetired, RowMoved, BatchRebuilt, RequestPreempted,
        RequestRetracted, KnobChanged, CommandRefused, EnginePaused, EngineResumed,
        EventsDropped, BlocksAllocated, PaddingReleased, AdmissionBlocked, EngineSnapshot, StepFailed,
        BlocksCached, BlocksEvicted,
    )
}

# A row's kind, decided once (Row.kind, engine/core/scheduler_output.py) for the engine, StepPlanned and
# PrefillChunk.
ROW_KINDS = ("prefill", "recompute", "decode", "padding")

# Why a request waits: what stopped admission at the head of the queue while it waited.
# next_step: the queue was empty at the last decision (it arrived during a step).
WAIT_REASONS = ("budget", "max_num_seqs", "kv", "static_batch", "dynamic_batch", "preemption", "paused",
                "next_step")

# Why a request's uncached full blocks missed the prefix cache (RequestAdmitted.miss_reason).
# no_prefix: its first block was never seen; below_block: it shares less than a block with a cached
# prefix; evicted: the missing block was cached and has been evicted; partial: k of n full blocks hit,
# then a block never seen; disabled: prefix caching is off.
MISS_REASONS = ("no_prefix", "below_block", "evicted", "partial", "disabled")

_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls))
    return names


def _tuples(value: list) -> tuple:
    """A JSON array as a tuple, and each array in it (EngineSnapshot's prompt_blocks)."""
    return tuple(tuple(item) if isinstance(item, list) else item for item in value)


def event_from_dict(data: dict) -> Event:
    """Inverse of Event.to_dict; raises ValueError on an unknown kind or missing fields."""
    kind = data.get("kind")
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        raise ValueError(f"unknown event kind {kind!r}")
    try:
        values = {}
        for name in _field_names(cls):
            value = data[name]
            values[name] = _tuples(value) if isinstance(value, list) else value
        return cls(**values)
    except KeyError as missing:
        raise ValueError(f"{kind} event lacks field {missing}") from None
