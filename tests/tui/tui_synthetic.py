"""A synthetic event stream shaped like a busy engine: many rows, steady churn."""
from __future__ import annotations

from batchtop.telemetry.events import (
    FirstToken, PrefillChunk, RequestAdmitted, RequestArrived, RequestRetired, StepFinished, StepPlanned,
)


def busy_stream(num_rows: int = 256, steps_per_s: float = 200.0, seconds: float = 30.0, churn: int = 2,
                t0: float = 1000.0):
    """Yield one list of events per step: `num_rows` decoding rows, `churn` of them replaced each step.

    Every step retires the `churn` oldest rows and admits as many new requests into their
    slots (arrival, admission, a one-chunk prefill, first token), so request ids keep growing.
    """
    dt = 1.0 / steps_per_s
    slot_of: dict[str, int] = {}
    order: list[str] = []
    next_id = 0
    for step in range(1, int(seconds * steps_per_s) + 1):
        t = t0 + step * dt
        events = []
        freed = []
        if len(order) >= num_rows:
            for _ in range(churn):
                rid = order.pop(0)
                freed.append(slot_of.pop(rid))
                events.append(RequestRetired(step, t, rid, "length", freed[-1], 32, 64))
        free_slots = freed or [s for s in range(num_rows) if s not in set(slot_of.values())][:churn * 8]
        new = []
        for slot in free_slots:
            rid = f"s{next_id}"
            next_id += 1
            events.append(RequestArrived(step, t - dt / 2, rid, 32, 64, 0))
            events.append(RequestAdmitted(step, t, rid, slot, 0, False))
            slot_of[rid] = slot
            order.append(rid)
            new.append(rid)
        events.append(StepPlanned(step, t, 32 * len(new), len(order) - len(new), len(new), len(order) - len(new),
                                  0, 8192, len(order), 0, len(order) * 4, num_rows * 8))
        for rid in new:
            events.append(PrefillChunk(step, t, rid, 32, 32, 32))
            events.append(FirstToken(step, t, rid, dt))
        events.append(StepFinished(step, t, len(order), len(order) - len(new) + 32 * len(new), tuple(order),
                                   len(order), 0, len(order) * 4, num_rows * 8, 1e-4, 1e-4, dt / 2, 1e-4, 1e-4))
        yield events
