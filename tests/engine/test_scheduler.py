"""Scheduler and KV accounting, step by step, with a fake runner (no model)."""
import random

import pytest

from batchtop.engine.core.kv_cache import KVCacheManager
from batchtop.engine.core.request import Request, Status
from batchtop.engine.core.sampling import SamplingParams
from batchtop.engine.core.scheduler import Scheduler, SchedulerKnobs

_seq = iter(range(10**9))


def make_request(rid, prompt_len, max_tokens, priority=0):
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), 0.0,
                   priority=priority, arrival_seq=next(_seq))


def check_invariants(sched: Scheduler, plan, cap: int):
    kv = sched.kv
    held = [b for r in sched.running + list(sched.waiting) for b in kv.block_ids(r.request_id)]
    assert len(held) == len(set(held)), "a block is held twice"
    assert not set(held) & set(kv._free), "a held block is also free"
    assert kv.num_used_blocks + kv.num_free_blocks == kv.num_blocks
    assert len(held) == kv.num_used_blocks
    assert not {id(r) for r in sched.running} & {id(r) for r in sched.waiting}
    assert all(r.status is Status.RUNNING for r in sched.running)
    assert all(r.status in (Status.WAITING, Status.PREEMPTED) for r in sched.waiting)
    assert len(sched.running) <= cap
    if plan is None:
        return
    assert plan.num_tokens <= plan.token_budget
    for row in plan.rows:
        assert row.request.status is Status.RUNNING
        assert kv.num_blocks_held(row.request.request_id) * kv.block_size >= \
            row.request.num_computed_tokens + row.num_tokens


def fake_update(sched: Scheduler, plan, finished: list):
    """What the engine does after the forward: computed catches up, a token is sampled at the end."""
    for row in plan.rows:
        request = row.request
        caught_up = row.samples
        request.num_computed_tokens += row.num_tokens
        if caught_up:
            request.output_token_ids.append(7)
            if request.num_output_tokens >= request.sampling.max_tokens:
                sched.finish(request, "length")
                finished.append(request)


def test_random_workload_keeps_invariants_and_drains_with_aborts():
    rng = random.Random(1)
    kv = KVCacheManager(num_blocks=40, block_size=4)
    knobs = SchedulerKnobs(max_num_seqs=6, max_num_batched_tokens=24, long_prefill_token_threshold=10)
    sched = Scheduler(knobs, kv)
    pending = [make_request(f"q{i}", rng.randint(1, 40), rng.randint(1, 30)) for i in range(80)]
    finished, aborted = [], {"waiting": 0, "prefill": 0, "decode": 0}
    preemptions = 0
    while pending or sched.has_work():
        for _ in range(rng.randint(0, 3)):
            if pending:
                sched.add(pending.pop())
        plan = sched.schedule()
        check_invariants(sched, plan, knobs.max_num_seqs)
        preemptions += len(plan.preempted)
        if plan.preempted:
            assert not plan.admitted, "a step that preempted must not admit"
        fake_update(sched, plan, finished)
        # abort one request now and then, from each state
        if rng.random() < 0.15 and (sched.running or sched.waiting):
            victim = rng.choice(sched.running + list(sched.waiting))
            state = ("waiting" if victim.status is not Status.RUNNING else
                     "prefill" if victim.num_output_tokens == 0 else "decode")
            aborted[state] += 1
            sched.finish(victim, "abort")
            check_invariants(sched, None, knobs.max_num_seqs)
    assert kv.num_free_blocks == kv.num_blocks
    assert all(aborted.values()), aborted
    assert preemptions > 0, "the pool was meant to run dry"
    assert all(r.num_output_tokens == r.sampling.max_tokens for r in finished)


def test_running_requests_are_served_first_and_keep_their_decode_token():
    kv = KVCacheManager(num_blocks=100, block_size=16)
    sched = Scheduler(SchedulerKnobs(max_num_seqs=8, max_num_batched_tokens=32), kv)
    decoders = [make_request(f"d{i}", 5, 50) for i in range(3)]
    for r in decoders:
        sched.add(r)
    plan = sched.schedule()
    fake_update(sched, plan, [])
    assert all(r.num_output_tokens == 1 for r in decoders)
    sched.add(make_request("long", 500, 10))
    plan = sched.schedule()
    tokens = {row.request.request_id: row.num_tokens for row in plan.rows}
    assert tokens == {"d0": 1, "d1": 1, "d2": 1, "long": 29}
    assert [row.request.request_id for row in plan.rows][:3] == ["d0", "d1", "d2"]


def test_chunk_sizes_follow_budget_arithmetic():
    kv = KVCacheManager(num_blocks=100, block_size=16)
    sched = Scheduler(SchedulerKnobs(max_num_seqs=8, max_num_batched_tokens=20,
                                     long_prefill_token_threshold=8), kv)
    a, b, c = make_request("a", 30, 5), make_request("b", 6, 5), make_request("c", 30, 5)
    for r in (a, b, c):
        sched.add(r)
    plan = sched.schedule()        # a: min(30, 20, 8)=8; b: min(6, 12, 8)=6; c: min(30, 6, 8)=6
    assert [(row.request.request_id, row.num_tokens) for row in plan.rows] == [("a", 8), ("b", 6), ("c", 6)]
    fake_update(sched, plan, [])
    plan = sched.schedule()        # a: 8 more; b decodes 1; c: min(24, 11, 8)=8
    assert [(row.request.request_id, row.num_tokens) for row in plan.rows] == [("a", 8), ("b", 1), ("c", 8)]
    assert not plan.rows[0].samples and plan.rows[1].samples
    fake_update(sched, plan, [])
    plan = sched.schedule()        # a: last 14 capped to 8; b: 1; c: min(16, 11, 8)=8
    assert [(row.request.request_id, row.num_tokens) for row in plan.rows] == [("a", 8), ("b", 1), ("c", 8)]


def test_max_num_seqs_caps_running_and_lowering_it_drops_nobody():
    kv = KVCacheManager(num_blocks=100, block_size=16)
    knobs = SchedulerKnobs(max_num_seqs=4, max_num_batched_tokens=100)
    sched = Scheduler(knobs, kv)
    for i in range(6):
        sched.add(make_request(f"r{i}", 4, 20))
    plan = sched.schedule()
    assert len(plan.admitted) == 4 and len(sched.waiting) == 2
    fake_update(sched, plan, [])
    knobs.max_num_seqs = 2
    plan = sched.schedule()
    assert len(sched.running) == 4 and len(plan.rows) == 4 and not plan.admitted


def test_preemption_picks_latest_arrival_requeues_at_front_and_admits_nobody():
    kv = KVCacheManager(num_blocks=4, block_size=4)          # 16 tokens of KV in all
    sched = Scheduler(SchedulerKnobs(max_num_seqs=4, max_num_batched_tokens=64), kv)
    a, b = make_request("a", 4, 10), make_request("b", 4, 10)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    fake_update(sched, plan, [])                 # a and b hold one full block each and have one token
    sched.add(make_request("late", 2, 2))
    # each needs a 2nd block: 2 free -> fits, late waits for budget? no: admitted
    plan = sched.schedule()
    fake_update(sched, plan, [])
    # keep going until the pool runs dry while a and b grow
    while not any(p for p in plan.preempted):
        plan = sched.schedule()
        fake_update(sched, plan, [])
    preempted = plan.preempted[0]
    victim, blocks_freed, recompute = preempted.request, preempted.blocks_freed, preempted.tokens_to_recompute
    assert victim is b, "the latest-arriving running request is the victim"
    assert victim.status is Status.PREEMPTED and sched.waiting[0] is victim
    assert victim.num_computed_tokens == 0 and recompute > 0 and blocks_freed > 0
    assert not plan.admitted
    assert victim.num_output_tokens > 0, "generated tokens survive preemption"


def test_priority_policy_preempts_lowest_priority():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    sched = Scheduler(SchedulerKnobs(max_num_seqs=4, max_num_batched_tokens=64), kv, policy="priority")
    urgent, lazy = make_request("urgent", 4, 12, priority=0), make_request("lazy", 4, 12, priority=5)
    sched.add(lazy)
    sched.add(urgent)
    assert list(sched.waiting) == [urgent, lazy]
    plan = sched.schedule()
    preempted = []
    while sched.has_work() and not preempted:
        fake_update(sched, plan, [])
        plan = sched.schedule()
        preempted = [p.request for p in plan.preempted]
    assert preempted == [lazy]


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy"):
        Scheduler(SchedulerKnobs(1, 1), KVCacheManager(1, 1), policy="lifo")


@pytest.mark.parametrize("mode, expected", [("recompute", "b"), ("retract", "c")])
def test_victim_choice_by_preemption_mode(mode, expected):
    """recompute takes the latest arrival; retract the fewest generated tokens, ties by the longest prompt."""
    kv = KVCacheManager(num_blocks=7, block_size=4)
    sched = Scheduler(SchedulerKnobs(4, 64, preemption_mode=mode), kv)
    c, a, b = make_request("c", 12, 20), make_request("a", 4, 20), make_request("b", 8, 20)
    for request, generated in ((c, 1), (a, 3), (b, 1)):
        request.output_token_ids = [1] * generated
        request.num_computed_tokens = request.num_tokens - 1
        request.status = Status.RUNNING
        sched.running.append(request)
        assert kv.try_allocate(request.request_id, request.num_computed_tokens) is not None
    assert kv.num_free_blocks == 0
    plan = sched.schedule()
    assert [p.request.request_id for p in plan.preempted] == [expected]
    assert plan.preempted[0].reason == ("retracted" if mode == "retract" else "preempted")
    if mode == "retract":
        assert sched.new_token_ratio > 0.7


def step_with_tokens(sched: Scheduler, token_ids, now=1.0):
    """Schedule, then hand `update_from_output` one token per sampling row (scheduler order)."""
    plan = sched.schedule(now)
    sampled = [row for row in plan.rows if row.samples]
    return plan, sched.update_from_output(plan.rows, sampled, list(token_ids[:len(sampled)]), now)


def test_update_from_output_stops_on_eos_stop_ids_and_max_tokens():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerKnobs(max_num_seqs=8, max_num_batched_tokens=64), kv,
                      eos_token_ids=frozenset({2}))
    params = {"eos": SamplingParams(max_tokens=5), "ignore": SamplingParams(max_tokens=5, ignore_eos=True),
              "stop_id": SamplingParams(max_tokens=5, stop_token_ids=(9,)),
              "length": SamplingParams(max_tokens=1)}
    for rid, sampling in params.items():
        sched.add(Request(rid, [5, 6, 7], sampling, 0.0, arrival_seq=next(_seq)))
    plan, result = step_with_tokens(sched, [2, 2, 9, 3], now=1.5)
    assert [(s.request.request_id, s.token_id, s.first, s.finish_reason) for s in result.sampled] == [
        ("eos", 2, True, "stop"), ("ignore", 2, True, None), ("stop_id", 9, True, "stop"),
        ("length", 3, True, "length")]
    assert [(c.request_id, c.num_tokens, c.num_computed_tokens, c.num_known_tokens, c.recompute)
            for c in result.chunks] == [(rid, 3, 3, 3, False) for rid in params]
    ignore = plan.rows[1].request
    assert ignore.output_token_ids == [2]
    assert ignore.first_token_time == 1.5
    assert ignore.num_computed_tokens == 3
    assert [r.request_id for r in sched.running] == ["ignore"]
    assert kv.num_used_blocks == 1, "the retired requests' blocks are free"
    plan, result = step_with_tokens(sched, [4], now=2.0)
    assert [(g.request.request_id, g.reason) for g in plan.left] == [("eos", "stop"), ("stop_id", "stop"),
                                                                     ("length", "length")]
    assert not result.chunks and not result.sampled[0].first and ignore.first_token_time == 1.5
    assert not sched.schedule(3.0).left, "a request leaves the batch once"


def test_left_lists_aborts_of_running_requests_only_and_waits_for_a_step():
    """An abort between steps reaches the next plan that is a step; a waiting request had no row."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerKnobs(4, 64, batching_mode="dynamic", static_batch_size=2,
                                     dynamic_timeout_s=60.0), kv)
    a, b, c, d, e = (make_request(rid, 4, 4) for rid in "abcde")
    for request in (a, b, e):
        sched.add(request)
    assert sched.schedule(1.0).admitted == [a, b]
    sched.finish(e, "abort", 1.1)                 # waiting: no row to leave
    sched.finish(a, "abort", 1.1)
    sched.finish(b, "error", 1.1)
    assert not sched.has_work()
    sched.add(c)
    plan = sched.schedule(2.0)                    # one of two waits: no step; the leavers wait too
    assert not plan.is_step and not plan.left
    sched.add(d)
    plan = sched.schedule(3.0)
    assert plan.admitted == [c,
                             d] and [(g.request, g.reason) for g in plan.left] == [(a, "abort"), (b, "error")]
    assert a.finish_time == 1.1 and kv.num_blocks_held("a") == 0


def test_static_padding_rows_leave_with_their_blocks_when_the_batch_ends():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerKnobs(4, 64, batching_mode="static", static_batch_size=2), kv)
    short, long = make_request("short", 4, 1), make_request("long", 4, 2)
    sched.add(short)
    sched.add(long)
    plan, result = step_with_tokens(sched, [5, 5])
    assert [s.finish_reason for s in result.sampled] == ["length", None]
    assert sched.padding == [short] and kv.num_blocks_held("short") == 1
    plan, result = step_with_tokens(sched, [5])
    assert not plan.left and [row.kind for row in plan.rows] == ["decode", "padding"]
    assert [s.finish_reason for s in result.sampled] == ["length"], "padding rows never sample"
    assert sched.padding == [short, long]
    plan = sched.schedule(2.0)
    assert [(g.request, g.reason, g.blocks_freed) for g in plan.left] == [(short, "padding_released", 1),
                                                                         (long, "padding_released", 2)]
    assert kv.num_used_blocks == 0
