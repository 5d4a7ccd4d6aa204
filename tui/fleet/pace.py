"""Which data-parallel rank sets the pace: ranks that run in lock step wait for the slowest one, so a
step that takes >= PACE_RATIO x the median of the ranks' steps at that moment names its rank and the
request whose prefill chunk was the longest in it.

Steps are aligned by time, not by number (a rank's step counter is its own): the newest steps of the
rank that finished last are matched, on every other rank, to the step whose span overlaps them most.
The ranks run in lock step when each of the newest `LOCKSTEP_STEPS` steps overlaps a step on every rank
(the ranks' clocks are taken as one: the ranks of one vLLM share a host's monotonic clock). vLLM keeps
the ranks of a mixture-of-experts model in lock step; it runs a dense model's ranks as independent
engines, and the status line then says that no rank sets the others' pace.
"""
from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import Mapping, Sequence

from .rows import StepRecord

PACE_RATIO = 1.5
LOCKSTEP_STEPS = 4


@dataclass(frozen=True)
class Pacer:
    rank: str                  # the engine's name in the fleet ("rank 1")
    step: int                  # its step number
    duration_s: float
    median_s: float            # the median of the ranks' aligned steps
    request_id: str            # the longest prefill chunk of that step ("" when it had none)
    chunk_tokens: int

    def text(self) -> str:
        chunk = (f": {self.request_id}'s prefill chunk of {self.chunk_tokens} tokens"
                 if self.request_id else " (no prefill chunk in it)")
        return (f"{self.rank} set the pace at step {self.step}: {self.duration_s * 1000:.0f} ms, "
                f"{self.duration_s / self.median_s:.1f}x the ranks' median "
                f"{self.median_s * 1000:.0f} ms{chunk}")


def _overlap(a: StepRecord, b: StepRecord) -> float:
    return min(a.end_t, b.end_t) - max(a.start_t, b.start_t)


def aligned(steps: Mapping[str, Sequence[StepRecord]], depth: int = LOCKSTEP_STEPS) -> list[dict]:
    """The newest `depth` groups of overlapping steps, one step per rank each, newest first; [] when the
    ranks do not run in lock step (or fewer than two ranks have steps)."""
    ranks = {name: list(records) for name, records in steps.items() if records}
    if len(ranks) < 2 or len(ranks) != len(steps):
        return []
    lead = max(ranks, key=lambda name: ranks[name][-1].end_t)
    groups = []
    for record in reversed(ranks[lead][-depth:]):
        group = {lead: record}
        for name, records in ranks.items():
            if name == lead:
                continue
            best = max(records, key=lambda other: _overlap(record, other))
            if _overlap(record, best) <= 0:
                return []
            group[name] = best
        groups.append(group)
    return groups if len(groups) == depth else []


def find_pacer(steps: Mapping[str, Sequence[StepRecord]], ratio: float = PACE_RATIO) -> Pacer | None:
    """The newest aligned step that took >= `ratio` x the ranks' median, or None."""
    return _pacer(aligned(steps), ratio)


def _pacer(groups: list[dict], ratio: float) -> Pacer | None:
    for group in groups:
        mid = median(record.duration_s for record in group.values())
        name, slow = max(group.items(), key=lambda item: item[1].duration_s)
        if mid > 0 and slow.duration_s >= ratio * mid:
            return Pacer(name, slow.step, slow.duration_s, mid, slow.chunk_request_id, slow.chunk_tokens)
    return None


NOT_IN_LOCK_STEP = ("ranks not in lock step: each runs its own steps (vLLM runs a dense model's ranks as "
                    "independent engines), so no rank sets the others' pace")


def pace_status(steps: Mapping[str, Sequence[StepRecord]], lock_step: bool | None = None,
                ratio: float = PACE_RATIO) -> str | None:
    """The status line's pace: the rank that set it, or that the ranks are not in lock step; None when
    there is nothing new to say (too few steps, or no step past `ratio` x the median). `lock_step`: what
    the engines say (batchtop's class inside vLLM knows); None: judged from the steps' time spans alone
    (independent ranks that are both busy overlap too, so an engine's word comes first)."""
    if lock_step is False:
        return NOT_IN_LOCK_STEP
    if sum(len(records) >= LOCKSTEP_STEPS for records in steps.values()) < 2:
        return None
    groups = aligned(steps)
    if not groups:
        return None if lock_step else NOT_IN_LOCK_STEP      # said to be in lock step: steps not aligned yet
    pacer = _pacer(groups, ratio)
    return pacer.text() if pacer is not None else None
