"""How long each request waited for what: the queue's blocked time per reason, read at join and admission.

The scheduler decides once per step what stopped admission; `WaitClock` turns those decisions into
per-request waiting time by reason without any work per waiting request: it keeps, per reason, the
seconds the queue has spent blocked by it since the start; a request remembers the clock's reading
when it joined the queue, and its wait split is the difference at admission. The split of one wait
sums to that wait exactly. The engine's scheduler and the dashboard's model (from AdmissionBlocked
events) each run one.
"""
from __future__ import annotations

from dataclasses import dataclass

from .events import WAIT_REASONS

_INDEX = {reason: i for i, reason in enumerate(WAIT_REASONS)}
NEXT_STEP = "next_step"


@dataclass(frozen=True)
class WaitMark:
    """The clock's reading when a request joined the queue."""
    t: float
    totals: tuple[float, ...]


class WaitClock:
    """Seconds the queue spent blocked, per reason; the reason set at `t` holds until the next `set`."""

    def __init__(self, t0: float = 0.0):
        self._totals = [0.0] * len(WAIT_REASONS)
        self._t = t0
        self._reason = _INDEX[NEXT_STEP]

    def set(self, now: float, reason: str) -> None:
        """From `now` on the queue waits for `reason` (time before `now` goes to the previous one)."""
        if now > self._t:
            self._totals[self._reason] += now - self._t
            self._t = now
        self._reason = _INDEX[reason]

    def mark(self, now: float) -> WaitMark:
        """The reading at `now`. A request made on another thread may join with a `now` before the
        clock's last setting: that gap counts as waiting for the next step."""
        totals = list(self._totals)
        if now >= self._t:
            totals[self._reason] += now - self._t
        else:
            totals[_INDEX[NEXT_STEP]] -= self._t - now
        return WaitMark(now, tuple(totals))

    def split(self, mark: WaitMark, now: float) -> tuple[tuple[str, ...], tuple[float, ...]]:
        """(reasons, seconds) waited since `mark`, non-zero reasons only, in WAIT_REASONS order."""
        now_mark = self.mark(now)
        pairs = [(reason, after - before) for reason, after,
                 before in zip(WAIT_REASONS, now_mark.totals, mark.totals)
                 if after - before > 0]
        return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
