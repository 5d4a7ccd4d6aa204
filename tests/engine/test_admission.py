"""Why the head of the queue waits: each reason with its numbers, and the per-request wait split.

Scheduler-level tests drive `schedule(now)` with explicit times, so the splits are exact.
"""
import pytest

from batchtop.engine.core.config import EngineConfig
from batchtop.engine.core.engine import Engine
from batchtop.engine.core.kv_cache import KVCacheManager
from batchtop.engine.core.request import Request
from batchtop.engine.core.sampling import SamplingParams
from batchtop.engine.core.scheduler import Scheduler, SchedulerKnobs
from batchtop.engine.model.loading import load_model
from batchtop.telemetry import events as ev

_seq = iter(range(10**9))


def make_request(rid, prompt_len, max_tokens, arrival=0.0):
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), arrival,
                   arrival_seq=next(_seq))


def scheduler(num_blocks=64, block_size=4, **knobs):
    knobs = {"max_num_seqs": 8, "max_num_batched_tokens": 64, **knobs}
    return Scheduler(SchedulerKnobs(**knobs), KVCacheManager(num_blocks, block_size))


def run_step(sched, now):
    """Schedule at `now`, then what the engine does after the forward (a token per caught-up row)."""
    plan = sched.schedule(now)
    for row in plan.rows:
        if row.padding:
            continue
        samples = row.samples
        row.request.num_computed_tokens += row.num_tokens
        if samples:
            row.request.output_token_ids.append(7)
            if row.request.num_output_tokens >= row.request.sampling.max_tokens:
                sched.finish(row.request, "length", now)
    return plan


def fields(blocked):
    return {k: v for k, v in vars(blocked).items() if v not in (0, 0.0) or k in ("reason", "request_id")}


def test_token_budget_spent():
    sched = scheduler(max_num_batched_tokens=8)
    for rid in ("a", "b"):
        sched.add(make_request(rid, 8, 4))
    plan = sched.schedule(1.0)
    assert [r.request_id for r in plan.admitted] == ["a"]
    assert fields(plan.blocked) == {"reason": "budget", "request_id": "b", "num_waiting": 1, "num_running": 1,
                                    "tokens_needed": 8}


def test_max_num_seqs_reached():
    sched = scheduler(max_num_seqs=2)
    for rid in ("a", "b", "c"):
        sched.add(make_request(rid, 4, 4))
    plan = sched.schedule(1.0)
    assert fields(plan.blocked) == {"reason": "max_num_seqs", "request_id": "c", "num_waiting": 1,
                                    "num_running": 2, "limit": 2}


def test_kv_pool_short_with_the_blocks_it_needs():
    sched = scheduler(num_blocks=4, block_size=4)
    sched.add(make_request("a", 12, 4))        # 3 of the 4 blocks
    sched.add(make_request("b", 8, 4))         # needs 2, 1 free
    plan = sched.schedule(1.0)
    assert fields(plan.blocked) == {"reason": "kv", "request_id": "b", "num_waiting": 1, "num_running": 1,
                                    "blocks_needed": 2, "blocks_free": 1}


def test_kv_reserve_in_retract_mode():
    sched = scheduler(num_blocks=8, block_size=4, preemption_mode="retract")
    sched.add(make_request("a", 8, 10))        # 2 blocks
    sched.add(make_request("b", 4, 10))        # 1 block fits, but the reserve does not
    plan = sched.schedule(1.0)
    # reserve = blocks for int((10 - 0 + 10) * 0.7) = 14 tokens = 4 blocks; 6 free, 1 + 4 <= 6 would fit...
    assert [r.request_id for r in plan.admitted] == ["a", "b"]
    sched.add(make_request("c", 4, 20))        # reserve: int((10 + 10 + 20) * 0.7) = 28 tokens = 7 blocks
    plan = sched.schedule(2.0)
    assert fields(plan.blocked) == {"reason": "kv", "request_id": "c", "num_waiting": 1, "num_running": 2,
                                    "blocks_needed": 1, "blocks_free": 5, "blocks_reserved": 7}


def test_static_batch_full_then_still_running():
    sched = scheduler(batching_mode="static", static_batch_size=2)
    for rid in ("a", "b", "c"):
        sched.add(make_request(rid, 4, 3))
    plan = run_step(sched, 1.0)
    assert fields(plan.blocked) == {"reason": "static_batch", "request_id": "c", "num_waiting": 1,
                                    "num_running": 2, "limit": 2}
    plan = run_step(sched, 2.0)
    assert plan.blocked.reason == "static_batch" and plan.blocked.num_running == 2


def test_dynamic_batch_forming_says_how_long_it_still_waits():
    sched = scheduler(batching_mode="dynamic", static_batch_size=4, dynamic_timeout_s=0.5)
    for rid in ("a", "b"):
        sched.add(make_request(rid, 4, 3, arrival=10.0))
    plan = sched.schedule(10.125)
    assert fields(plan.blocked) == {"reason": "dynamic_batch", "request_id": "a", "num_waiting": 2,
                                    "limit": 4, "wait_more_s": 0.375}
    assert [r.request_id for r in sched.schedule(10.5).admitted] == ["a", "b"]


def test_no_admission_in_a_step_that_preempted():
    sched = scheduler(num_blocks=3, block_size=4)
    sched.add(make_request("a", 4, 8))
    sched.add(make_request("b", 4, 8))
    sched.add(make_request("c", 3, 8))
    run_step(sched, 1.0)                        # a, b, c admitted: 3 blocks, the pool is full
    plan = run_step(sched, 2.0)                 # a and b decode into position 4: second blocks, c and b out
    assert [p.request.request_id for p in plan.preempted] == ["c", "b"]
    assert fields(plan.blocked) == {"reason": "preemption", "request_id": "b", "num_waiting": 2,
                                    "num_running": 1}


def test_queue_empty_means_nothing_blocked():
    sched = scheduler()
    sched.add(make_request("a", 4, 2))
    assert sched.schedule(1.0).blocked is None


def test_wait_split_follows_the_reasons_and_sums_to_the_wait():
    sched = scheduler(max_num_seqs=1)
    sched.add(make_request("a", 4, 3, arrival=0.0))
    sched.add(make_request("b", 4, 3, arrival=0.5))
    run_step(sched, 1.0)                        # a runs; b blocked by max_num_seqs from 1.0
    sched.knobs.max_num_batched_tokens = 64
    run_step(sched, 2.0)
    sched.note_paused(2.5, True)                # paused 2.5 .. 4.0
    sched.note_paused(4.0, False)
    run_step(sched, 4.25)                       # a finishes (its 3rd token) in this step
    plan = run_step(sched, 5.0)                 # b admitted
    b = plan.admitted[0]
    reasons, seconds = b.wait_split
    split = dict(zip(reasons, seconds))
    # next_step: 0.5 .. 1.0 (arrived during a step) and 4.0 .. 4.25 (resumed, before the next decision);
    # max_num_seqs: 1.0 .. 2.5 and 4.25 .. 5.0; paused: 2.5 .. 4.0
    assert split == pytest.approx({"next_step": 0.75, "max_num_seqs": 2.25, "paused": 1.5})
    assert sum(seconds) == pytest.approx(5.0 - 0.5)


def test_a_preempted_request_waits_again_from_its_preemption():
    sched = scheduler(num_blocks=2, block_size=4)
    sched.add(make_request("a", 4, 4, arrival=0.0))     # at most 7 tokens computed: 2 blocks
    sched.add(make_request("b", 4, 4, arrival=0.0))
    run_step(sched, 1.0)
    plan = run_step(sched, 2.0)                 # a needs its second block: b is preempted
    victim = plan.preempted[0].request
    assert victim.request_id == "b"
    t = 2.0
    while victim.status.value != "running" and t < 20:
        t += 1.0
        run_step(sched, t)
    assert sum(victim.wait_split[1]) == pytest.approx(t - 2.0)
    assert "preemption" in victim.wait_split[0]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def test_engine_emits_admission_blocked_on_change_only_and_splits_sum_to_queue_time(tiny):
    events = []
    engine = Engine(EngineConfig(model="tiny", max_num_seqs=2, num_kv_blocks=64, block_size=4),
                    sink=events.append, loaded=tiny)
    for i in range(6):
        engine.add_request([100 + i] * 6, SamplingParams(max_tokens=5, ignore_eos=True))
    engine.note_paused(True)
    engine.note_paused(False)
    while engine.has_unfinished():
        engine.step()
    blocked = [e for e in events if isinstance(e, ev.AdmissionBlocked)]
    assert blocked[0].reason == "paused" and blocked[0].num_waiting == 6
    steps_waiting = sum(1 for e in events if isinstance(e, ev.StepPlanned) and e.num_waiting)
    # r0 and r1 run together and finish together, so the head goes from r2 to r4
    assert [(b.reason, b.request_id) for b in blocked[1:]] == [("max_num_seqs", "r2"), ("max_num_seqs", "r4")]
    assert steps_waiting > len(blocked)                                 # not one per step
    for e in events:
        if isinstance(e, ev.RequestAdmitted):
            request = engine.requests[e.request_id]
            assert sum(e.wait_s) == pytest.approx(request.admit_time - request.arrival_time, abs=1e-9)
            assert set(e.wait_reasons) <= set(ev.WAIT_REASONS)
