"""What the scheduler hands out: one step's plan (`SchedulerOutput`, its rows) and, after the forward
pass, what `Scheduler.update_from_output` did with the sampled tokens (`StepResult`).

A plan's `left` is the one list of requests whose rows leave the persistent batch, each with why:
retired since the last plan that was a step (their RequestRetired is already out), then this step's
released padding rows or preempted ones. The batch drops exactly these rows before it adds the admitted.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from .admission import Blocked
from .request import Request


@dataclass
class Row:
    request: Request
    num_tokens: int
    padding: bool = False        # static batching: a finished row computed again, its result thrown away

    @cached_property
    def kind(self) -> str:
        """prefill | recompute | decode | padding (telemetry.events.ROW_KINDS), the one definition used
        by the engine, StepPlanned and PrefillChunk. Read it before the step updates the request.
        decode: the row computes only the newest output token; recompute: any other row of a request
        that was preempted (it computes again what it had); prefill: the rest."""
        if self.padding:
            return "padding"
        request = self.request
        if self.num_tokens == 1 and request.num_output_tokens and request.num_tokens_to_compute == 1:
            return "decode"
        return "recompute" if request.num_preemptions else "prefill"

    @property
    def samples(self) -> bool:
        """True when this row's tokens bring the request level with its known tokens."""
        request = self.request
        return not self.padding and request.num_computed_tokens + self.num_tokens == request.num_tokens

    @property
    def start(self) -> int:
        """First position computed: a padding row recomputes its last computed position."""
        return self.request.num_computed_tokens - 1 if self.padding else self.request.num_computed_tokens


# Why a request left the persistent batch when it did not retire (then: its finish reason).
PREEMPTED, RETRACTED, PADDING_RELEASED = "preempted", "retracted", "padding_released"


@dataclass(frozen=True)
class LeftBatch:
    """A request whose row leaves the persistent batch, why, and the numbers of its event."""
    request: Request
    reason: str                  # stop | length | abort | error, or PREEMPTED, RETRACTED, PADDING_RELEASED
    blocks_freed: int = 0        # preempted, retracted, padding released
    tokens_to_recompute: int = 0  # preempted, retracted

    @property
    def preempted(self) -> bool:
        return self.reason in (PREEMPTED, RETRACTED)


@dataclass
class SchedulerOutput:
    rows: list[Row] = field(default_factory=list)      # running order
    admitted: list[Request] = field(default_factory=list)
    # rows that leave the batch: retired since the last plan, then this step's released or preempted ones
    left: list[LeftBatch] = field(default_factory=list)
    token_budget: int = 0
    new_token_ratio: float = 0.0
    blocked: Blocked | None = None   # what stopped admission at the head of the queue; None: nobody waits

    @property
    def num_tokens(self) -> int:
        return sum(row.num_tokens for row in self.rows)

    @property
    def preempted(self) -> list[LeftBatch]:
        """This step's preempted or retracted requests, in the order they were chosen."""
        return [gone for gone in self.left if gone.preempted]

    @property
    def is_step(self) -> bool:
        """Something runs, joins or leaves (a dynamic batch waiting to fill is no step)."""
        return bool(self.rows or self.admitted or self.left)


@dataclass(frozen=True, slots=True)
class Chunk:
    """A prefill or recompute row's progress this step: the numbers of its PrefillChunk."""
    request_id: str
    num_tokens: int
    num_computed_tokens: int     # after this chunk
    num_known_tokens: int        # before this step's sampled token
    recompute: bool


@dataclass(frozen=True, slots=True)
class SampledToken:
    request: Request
    token_id: int
    first: bool                  # the request's first output token (its first_token_time is now)
    finish_reason: str | None    # set when this token retired the request


@dataclass
class StepResult:
    """What `update_from_output` did with one step's output, rows in batch order."""
    chunks: list[Chunk]
    sampled: list[SampledToken]
