"""Which data-parallel rank sets the pace: ranks that run in lock step wait for the slowest one, so a
step that takes >= PACE_RATIO x the median of the ranks' steps at that moment names its rank and the
request whose prefill chunk was the longest in it.

Steps are aligned by time, not by number (a rank's step counter is its own): the newest steps of the
rank that finished last are matched, on every other rank, to the step whose span overlaps them most.
The ranks run in lock step when each of the newest `LOCKSTEP_STEPS` steps overlaps a step on every rank
(the ranks' clocks are taken as one: the ranks of one vLLM share a host's monotonic clock).
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
    for group in aligned(steps):
        mid = median(record.duration_s for record in group.values())
        name, slow = max(group.items(), key=lambda item: item[1].duration_s)
        if mid > 0 and slow.duration_s >= ratio * mid:
            return Pacer(name, slow.step, slow.duration_s, mid, slow.chunk_request_id, slow.chunk_tokens)
    return None
