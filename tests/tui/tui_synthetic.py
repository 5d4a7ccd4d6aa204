"""A synthetic event stream shaped like a busy engine: many rows, steady churn."""
from __future__ import annotations

from batchtop.telemetry.events import (
    FirstToken,
    PrefillChunk,
    RequestAdmitted,
    RequestArrived,
    RequestRetired,
    StepFinished,
    StepPlanned,
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
                events.append(RequestRetired(step=step, t=t, request_id=rid, reason="length", slot=freed[-1],
                                             num_prompt_tokens=32, num_output_tokens=64))
        free_slots = freed or [s for s in range(num_rows) if s not in set(slot_of.values())][:churn * 8]
        new = []
        for slot in free_slots:
            rid = f"s{next_id}"
            next_id += 1
            events.append(RequestArrived(step=step, t=t - dt / 2, request_id=rid,
                                         num_prompt_tokens=32, max_tokens=64, priority=0))
            events.append(RequestAdmitted(step=step, t=t, request_id=rid, slot=slot, num_computed_tokens=0,
                                          resumed=False))
            slot_of[rid] = slot
            order.append(rid)
            new.append(rid)
        events.append(StepPlanned(step=step, t=t, prefill_tokens=32 * len(new),
                                  decode_tokens=len(order) - len(new), num_prefill_rows=len(new),
                                  num_decode_rows=len(order) - len(new), num_padding_rows=0,
                                  token_budget=8192, num_running=len(order), num_waiting=0,
                                  kv_blocks_used=len(order) * 4, kv_blocks_total=num_rows * 8,
                                  recompute_tokens=0, num_recompute_rows=0))
        for rid in new:
            events.append(PrefillChunk(step=step, t=t, request_id=rid, num_tokens=32, num_computed_tokens=32,
                                       num_known_tokens=32))
            events.append(FirstToken(step=step, t=t, request_id=rid, ttft_s=dt))
        events.append(StepFinished(step=step, t=t, num_rows=len(order),
                                   num_tokens=len(order) - len(new) + 32 * len(new),
                                   sampled_request_ids=tuple(order), num_running=len(order), num_waiting=0,
                                   kv_blocks_used=len(order) * 4, kv_blocks_total=num_rows * 8,
                                   schedule_s=1e-4, prepare_s=1e-4, forward_s=dt / 2, sample_s=1e-4,
                                   update_s=1e-4))
        yield events
