"""Why the head of the waiting queue was not admitted.

The scheduler decides once per step what stopped admission (a `Blocked`, or None when nobody
waits); `telemetry.wait_clock.WaitClock` turns those decisions into per-request waiting time.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Blocked:
    """What stopped admission at the head of the queue this step, with its numbers (0 when not theirs)."""
    reason: str
    request_id: str
    num_waiting: int
    num_running: int
    tokens_left: int = 0
    tokens_needed: int = 0
    limit: int = 0
    blocks_needed: int = 0
    blocks_free: int = 0
    blocks_reserved: int = 0
    wait_more_s: float = 0.0

    @property
    def key(self) -> tuple[str, str]:
        """An AdmissionBlocked is emitted when this changes."""
        return self.reason, self.request_id
