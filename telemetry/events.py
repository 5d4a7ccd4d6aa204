"""The event schema: small frozen records, each a past fact about one engine step.

Every event carries the engine step it belongs to and `t`, a monotonic time in
seconds (time.monotonic() on the engine's clock). Events hold ids and numbers,
never live objects or tensors, so they serialise as flat JSON objects:
`{"kind": "RequestAdmitted", "step": 3, "t": 12.5, ...}`.

Bump SCHEMA_VERSION whenever a field is added, removed or changes meaning.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

SCHEMA_VERSION = 2              # 2: StepFailed added (a version 1 log reads as it is)


@dataclass(frozen=True, slots=True)
class Event:
    step: int
    t: float

    def to_dict(self) -> dict:
        out = {"kind": type(self).__name__}
        for name in _field_names(type(self)):
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, tuple) else value
        return out


@dataclass(frozen=True, slots=True)
class StepPlanned(Event):
    """The scheduler's plan for this step, before the forward pass."""
    prefill_tokens: int          # tokens of rows still catching up with their known tokens
    decode_tokens: int           # one per decoding row
    num_prefill_rows: int
    num_decode_rows: int
    num_padding_rows: int        # static mode: finished rows still computed as padding
    token_budget: int            # max_num_batched_tokens in force this step
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int


@dataclass(frozen=True, slots=True)
class StepFinished(Event):
    """The step is done: phase timings and who produced a token."""
    num_rows: int                # rows computed, padding included (row-steps of this step)
    num_tokens: int              # tokens computed, padding included
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


@dataclass(frozen=True, slots=True)
class RequestArrived(Event):
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    priority: int


@dataclass(frozen=True, slots=True)
class RequestAdmitted(Event):
    """Moved from waiting to running, into batch row `slot`."""
    request_id: str
    slot: int
    num_computed_tokens: int     # > 0 never for recompute; kept for future prefix reuse
    resumed: bool                # True when it had been preempted or retracted before


@dataclass(frozen=True, slots=True)
class PrefillChunk(Event):
    """A row computed `num_tokens` of its known tokens (prompt, or prompt + output after preemption)."""
    request_id: str
    num_tokens: int
    num_computed_tokens: int     # after this chunk
    num_known_tokens: int        # prompt + output tokens so far; the chunk is the last when equal


@dataclass(frozen=True, slots=True)
class FirstToken(Event):
    request_id: str
    ttft_s: float                # since arrival


@dataclass(frozen=True, slots=True)
class RequestRetired(Event):
    """Left the batch for good. reason: stop | length | abort | error."""
    request_id: str
    reason: str
    slot: int                    # -1 when it retired from the waiting queue
    num_prompt_tokens: int
    num_output_tokens: int


@dataclass(frozen=True, slots=True)
class RowMoved(Event):
    """condense: the highest row slid down into a hole; only its live token prefix was copied."""
    request_id: str
    from_slot: int
    to_slot: int
    num_bytes: int


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
class RequestPreempted(Event):
    """Recompute preemption: blocks freed, generated tokens kept, recomputed on readmission."""
    request_id: str
    slot: int
    blocks_freed: int
    tokens_to_recompute: int
    reason: str


@dataclass(frozen=True, slots=True)
class RequestRetracted(Event):
    """Retraction (SGLang style): like preemption, and the admission estimate rises."""
    request_id: str
    slot: int
    blocks_freed: int
    tokens_to_recompute: int
    new_token_ratio: float       # the ratio after this retraction


@dataclass(frozen=True, slots=True)
class KnobChanged(Event):
    name: str
    old: object
    new: object
    source: str                  # cli | tui | api | test


@dataclass(frozen=True, slots=True)
class CommandRefused(Event):
    """A control command was invalid and changed nothing."""
    command: str
    message: str


@dataclass(frozen=True, slots=True)
class EnginePaused(Event):
    pass


@dataclass(frozen=True, slots=True)
class EngineResumed(Event):
    pass


@dataclass(frozen=True, slots=True)
class StepFailed(Event):
    """The step raised: its running requests are retired with reason `error` next, and the engine goes on."""
    error: str                   # the exception's type and message


@dataclass(frozen=True, slots=True)
class EventsDropped(Event):
    """Told to one subscriber whose buffer overflowed: its oldest `count` events were dropped."""
    count: int


EVENT_TYPES: dict[str, type[Event]] = {
    cls.__name__: cls
    for cls in (
        StepPlanned, StepFinished, RequestArrived, RequestAdmitted, PrefillChunk,
        FirstToken, RequestRetired, RowMoved, BatchRebuilt, RequestPreempted,
        RequestRetracted, KnobChanged, CommandRefused, EnginePaused, EngineResumed,
        EventsDropped, StepFailed,
    )
}

_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls))
    return names


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
            values[name] = tuple(value) if isinstance(value, list) else value
        return cls(**values)
    except KeyError as missing:
        raise ValueError(f"{kind} event lacks field {missing}") from None
