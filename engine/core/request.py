"""A request as the scheduler sees it: known tokens versus computed tokens."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .kv_cache import CacheLookup
from .sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"          # back in the waiting queue, its KV freed
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    priority: int = 0                # lower value is served first under the priority policy
    arrival_seq: int = 0             # tie-break: order of arrival
    input_s: float = 0.0             # a server's input path: from its receipt to the engine's hands
    prompt_blocks: tuple[str, ...] = ()   # its full prompt blocks by prefix-cache hash (set on arrival)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None  # stop | length | abort
    admit_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0   # tokens computed again after preemptions
    # the prefix cache at the last admission: its tokens counted as computed, and why the rest missed
    cache: CacheLookup | None = None
    wait_mark: object = None         # the scheduler's WaitClock reading when it last joined the queue
    # its last wait by reason: (reasons, seconds), set when it leaves the queue
    wait_split: tuple = ((), ())

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens: the prompt plus everything generated so far."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_cached_tokens(self) -> int:
        """Tokens the prefix cache gave it at its last admission."""
        return self.cache.num_cached_tokens if self.cache is not None else 0

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
