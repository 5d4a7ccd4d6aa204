"""Hand-built event sequences shared by the telemetry tests."""
from __future__ import annotations

from batchtop.telemetry.events import (
    AdmissionBlocked,
    BatchRebuilt,
    BlocksAllocated,
    BlocksCached,
    BlocksEvicted,
    CommandRefused,
    EnginePaused,
    EngineResumed,
    EngineSnapshot,
    EventsDropped,
    FirstToken,
    KnobChanged,
    PaddingReleased,
    PrefillChunk,
    RequestAdmitted,
    RequestArrived,
    RequestPreempted,
    RequestRetired,
    RequestRetracted,
    RowMoved,
    StepFailed,
    StepFinished,
    StepPlanned,
)


def one_of_each() -> list:
    """One event of every kind, with awkward values (floats, empty tuple, unicode, None)."""
    return [
        RequestArrived(step=0, t=0.1, request_id="req-ü-0", num_prompt_tokens=17, max_tokens=64, priority=2),
        StepPlanned(step=1, t=0.25, prefill_tokens=17, decode_tokens=0, num_prefill_rows=1, num_decode_rows=0,
                    num_padding_rows=0, token_budget=2048, num_running=1, num_waiting=0, kv_blocks_used=2,
                    kv_blocks_total=100, recompute_tokens=0, num_recompute_rows=0),
        RequestAdmitted(step=1, t=0.2500001, request_id="req-ü-0", slot=0, num_computed_tokens=0,
                        resumed=False),
        PrefillChunk(step=1, t=0.26, request_id="req-ü-0", num_tokens=17, num_computed_tokens=17,
                     num_known_tokens=17),
        StepFinished(step=1, t=0.3, num_rows=1, num_tokens=17,
                     sampled_request_ids=("req-ü-0",), num_running=1, num_waiting=0, kv_blocks_used=2,
                     kv_blocks_total=100, schedule_s=1e-4, prepare_s=2e-4, forward_s=0.0123456789,
                     sample_s=3e-5, update_s=1.5e-5),
        StepFinished(step=2, t=0.31, num_rows=0, num_tokens=0, sampled_request_ids=(),
                     num_running=0, num_waiting=0, kv_blocks_used=0, kv_blocks_total=100, schedule_s=0.0,
                     prepare_s=0.0, forward_s=0.0, sample_s=0.0, update_s=0.0),
        FirstToken(step=1, t=0.3, request_id="req-ü-0", ttft_s=0.2),
        RowMoved(step=2, t=0.4, request_id="req-ü-0", from_slot=3, to_slot=0, num_bytes=4096),
        BatchRebuilt(step=2, t=0.4, layout="condense", rows_kept=3, rows_added=1,
                     rows_removed=1, rows_moved=1, num_bytes=4096),
        RequestPreempted(step=3, t=0.5, request_id="req-ü-0", slot=0, blocks_freed=2, tokens_to_recompute=20,
                         reason="kv pool dry"),
        RequestRetracted(step=4, t=0.6, request_id="req-ü-0", slot=0, blocks_freed=2, tokens_to_recompute=21,
                         new_token_ratio=0.3333333333333333),
        KnobChanged(step=5, t=0.7, name="max_num_seqs", old=8, new=16, source="tui"),
        KnobChanged(step=5, t=0.7, name="batching_mode", old="continuous", new="static", source="cli"),
        KnobChanged(step=5, t=0.7, name="timeout", old=None, new=0.25, source="api"),
        KnobChanged(step=5, t=0.7, name="ignore_eos", old=False, new=True, source="test"),
        CommandRefused(step=6, t=0.8, command="set_knob", message="max_num_seqs must be in 1..256"),
        EnginePaused(step=7, t=0.9),
        EngineResumed(step=7, t=1.0),
        RequestRetired(step=8, t=1.1, request_id="req-ü-0", reason="stop", slot=0, num_prompt_tokens=17,
                       num_output_tokens=5),
        RequestRetired(step=8, t=1.1, request_id="req-1", reason="abort", slot=-1, num_prompt_tokens=3,
                       num_output_tokens=0),
        EventsDropped(step=9, t=1.2, count=15),
        BlocksAllocated(step=9, t=1.25, request_id="req-2", num_new_blocks=1, num_blocks=3),
        BlocksCached(step=9, t=1.25, request_id="req-2", prefix_id="5bfe047e0e91", num_new_blocks=1),
        BlocksEvicted(step=9, t=1.25, block_ids=(4, 7), prefix_ids=("5bfe047e0e91", "a0b1c2d3e4f5")),
        PrefillChunk(step=9, t=1.25, request_id="req-2", num_tokens=5, num_computed_tokens=25,
                     num_known_tokens=25, recompute=True),
        RequestAdmitted(step=10, t=1.3, request_id="req-3", slot=1, num_computed_tokens=32, resumed=True,
                        wait_reasons=("kv", "preemption"), wait_s=(0.125, 1 / 3), num_known_tokens=70,
                        num_cached_tokens=32, num_full_blocks=4, num_hit_blocks=2, miss_reason="evicted",
                        evicted_ago_s=0.5, prefix_id="5bfe047e0e91"),
        RequestRetired(step=10, t=1.3, request_id="req-4", reason="length", slot=2, num_prompt_tokens=3,
                       num_output_tokens=4, num_blocks=1),
        PaddingReleased(step=11, t=1.4, request_id="req-4", slot=2, blocks_freed=1),
        AdmissionBlocked(step=11, t=1.4, reason="kv", request_id="req-5", num_waiting=2, num_running=3,
                         blocks_needed=7, blocks_free=3, blocks_reserved=2),
        EngineSnapshot(step=11, t=1.5, cause="drop", request_ids=("req-2", "req-5"),
                       statuses=("running", "waiting"), slots=(0, -1), num_prompt_tokens=(20, 9),
                       num_output_tokens=(5, 0), num_computed_tokens=(25, 0), num_blocks=(3, 0),
                       max_tokens=(64, 8), kv_blocks_used=3, kv_blocks_total=100),
        EngineSnapshot(step=12, t=1.6, cause="interval", request_ids=(), statuses=(), slots=(),
                       num_prompt_tokens=(), num_output_tokens=(), num_computed_tokens=(),
                       num_blocks=(), max_tokens=(), kv_blocks_used=0, kv_blocks_total=100),
        StepFailed(step=12, t=1.7, error="RuntimeError: simulated kernel failure"),
    ]


STATIC_LENGTHS = [1024, 200, 180, 150, 140, 120, 84, 70]


def static_batch(lengths=STATIC_LENGTHS, dt=0.01) -> list:
    """The reference text's static batch: all rows admitted together, the batch runs until
    the longest row finishes, and every step computes all rows (finished ones as padding).
    Step k (1-based) finishes at k*dt and samples the rows with k <= n_i.
    """
    events = []
    num_rows = len(lengths)
    ids = [f"r{i}" for i in range(num_rows)]
    for rid in ids:
        events.append(RequestArrived(step=0, t=0.0, request_id=rid, num_prompt_tokens=10,
                                     max_tokens=2000, priority=0))
    for slot, rid in enumerate(ids):
        events.append(RequestAdmitted(step=1, t=0.0, request_id=rid, slot=slot, num_computed_tokens=0,
                                      resumed=False))
    for k in range(1, max(lengths) + 1):
        t = k * dt
        sampled = tuple(rid for rid, n in zip(ids, lengths) if k <= n)
        events.append(StepFinished(step=k, t=t, num_rows=num_rows, num_tokens=num_rows,
                                   sampled_request_ids=sampled, num_running=len(sampled), num_waiting=0,
                                   kv_blocks_used=num_rows, kv_blocks_total=64, schedule_s=0.0, prepare_s=0.0,
                                   forward_s=dt, sample_s=0.0, update_s=0.0))
        if k == 1:
            events += [FirstToken(step=k, t=t, request_id=rid, ttft_s=t) for rid in ids]
        for slot, (rid, n) in enumerate(zip(ids, lengths)):
            if n == k:
                events.append(RequestRetired(step=k, t=t, request_id=rid, reason="length", slot=slot,
                                             num_prompt_tokens=10, num_output_tokens=n))
    return events
