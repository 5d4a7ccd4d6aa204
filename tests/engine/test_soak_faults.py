"""A planted fault per invariant of the soak: each makes the soak report that invariant, by name.

Each fault is a small bug put into the engine (a method wrapped, a range widened) before the soak
runs; the soak stops after the first step that broke something. Without its check, each test fails.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from batchtop.engine.core.knobs import knob
from batchtop.engine.core.request import Status
from batchtop.engine.core.sampling import SamplingParams
from batchtop.engine.reliability.invariants import INVARIANTS
from batchtop.engine.reliability.soak import BATCH_CAPACITY, Soak, SoakConfig

# Without a fault this run is test_soak.py's bounded soak (no violation); with one it stops early.
STOP_AT_FIRST = SoakConfig(num_requests=400, seed=1, stop_at_violation=True)
STALLING = dataclasses.replace(STOP_AT_FIRST, stall_rounds=300)
WHOLE_RUN = SoakConfig(num_requests=6, seed=2)                          # faults seen only after the drain


@pytest.fixture(autouse=True)
def keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def wrap(monkeypatch, owner, name, make):
    """Replace `owner.name` by `make(original)`."""
    monkeypatch.setattr(owner, name, make(getattr(owner, name)))


# -- the faults: each takes (soak, monkeypatch) ----------------------------------------------------

def free_twice(soak, mp):
    kv = soak.engine.kv

    def free(original):
        def bad(request_id):
            blocks = list(kv.block_ids(request_id))
            freed = original(request_id)
            kv._ref[blocks[0]] -= 1 if blocks else 0   # the first block's count drops twice
            return freed
        return bad
    wrap(mp, kv, "free", free)


def held_twice(soak, mp):
    kv = soak.engine.kv

    def allocate(original):
        def bad(request_id, num_total_tokens, *args, **kwargs):
            new = original(request_id, num_total_tokens, *args, **kwargs)
            others = [b for rid, blocks in kv._blocks.items() if rid != request_id for b in blocks]
            if new and others and kv._ref[new[-1]] == 1:
                kv._ref[new[-1]] = 0                  # hands out another request's block instead,
                kv._free[new[-1]] = None              # its count unchanged
                kv._blocks[request_id][-1] = others[0]
            return new
        return bad
    wrap(mp, kv, "try_allocate", allocate)


def held_and_free(soak, mp):
    kv = soak.engine.kv

    def allocate(original):
        def bad(request_id, num_total_tokens, *args, **kwargs):
            new = original(request_id, num_total_tokens, *args, **kwargs)
            if new:
                kv._free[new[0]] = None               # the block stays in the free queue as well
            return new
        return bad
    wrap(mp, kv, "try_allocate", allocate)


def lost_block(soak, mp):
    kv = soak.engine.kv

    def free(original):
        def bad(request_id):
            blocks = list(kv.block_ids(request_id))
            freed = original(request_id)
            if blocks and blocks[0] in kv._free:      # the first block is dropped on the floor
                del kv._free[blocks[0]]
            return freed
        return bad
    wrap(mp, kv, "free", free)


def finished_keep_blocks(soak, mp):
    """Retiring (and aborting) forgets to free the request's blocks: they stay held by nobody running."""
    scheduler = soak.engine.scheduler

    def remove(original):
        def bad(request, now=0.0):
            if request.status is Status.RUNNING:
                scheduler.running.remove(request)
            elif request in scheduler.waiting:
                scheduler.waiting.remove(request)
            return 0
        return bad
    wrap(mp, scheduler, "remove", remove)


def abort_keeps_blocks(soak, mp):
    """An abort retires the request but forgets its blocks."""
    scheduler, kv = soak.engine.scheduler, soak.engine.kv

    def finish(original):
        def bad(request, reason, now=0.0):
            if reason != "abort":
                return original(request, reason, now)
            free, kv.free = kv.free, lambda request_id: 0
            try:
                return original(request, reason, now)
            finally:
                kv.free = free
        return bad
    wrap(mp, scheduler, "finish", finish)


def preempted_queued_twice(soak, mp):
    scheduler = soak.engine.scheduler

    def enqueue(original):
        def bad(request, front, now):
            original(request, front, now)
            if front:
                scheduler.waiting.appendleft(request)
        return bad
    wrap(mp, scheduler, "_enqueue", enqueue)


def admitted_left_waiting(soak, mp):
    scheduler = soak.engine.scheduler

    def schedule(original):
        def bad(now=0.0):
            out = original(now)
            scheduler.waiting.extend(out.admitted[:1])
            return out
        return bad
    wrap(mp, scheduler, "schedule", schedule)


def padding_requeued(soak, mp):
    scheduler = soak.engine.scheduler

    def finish(original):
        def bad(request, reason, now=0.0):
            leaves = original(request, reason, now)
            if not leaves:
                scheduler.waiting.append(request)     # a padding row put back in the queue
            return leaves
        return bad
    wrap(mp, scheduler, "finish", finish)


def preempted_stays_running(soak, mp):
    scheduler = soak.engine.scheduler

    def preempt(original):
        def bad(victim, out):
            original(victim, out)
            victim.status = Status.RUNNING
        return bad
    wrap(mp, scheduler, "_preempt", preempt)


def capacity_disagrees_with_knobs(soak, mp):
    """The knobs' range reads one batch capacity, the batch has a smaller one."""
    engine = soak.engine
    mp.setattr(engine, "validate_knob", lambda name, value: knob(name).parse(value, BATCH_CAPACITY))
    mp.setattr(engine.batch, "capacity", 3)


def move_forgets_slot_map(soak, mp):
    batch = soak.engine.batch

    def move(original):
        def bad(src, dst):
            moved = original(src, dst)
            batch.slot_of[moved.request_id] = src
            return moved
        return bad
    wrap(mp, batch, "_move", move)


def recompute_ignores_budget(soak, mp):
    """A preempted request catching up is handed everything it must recompute, budget or not."""
    scheduler = soak.engine.scheduler

    def chunk(original):
        def bad(request, budget, num_cached=0):
            if request.num_preemptions:
                return request.num_tokens_to_compute - num_cached
            return original(request, budget, num_cached)
        return bad
    wrap(mp, scheduler, "_chunk", chunk)


def admits_one_past_the_cap(soak, mp):
    scheduler = soak.engine.scheduler

    def schedule_waiting(original):
        def bad(out, budget):
            knobs = scheduler.knobs
            knobs.max_num_seqs += 1
            knobs.static_batch_size += 1
            try:
                return original(out, budget)
            finally:
                knobs.max_num_seqs -= 1
                knobs.static_batch_size -= 1
        return bad
    wrap(mp, scheduler, "_schedule_waiting", schedule_waiting)


def forward_raises(soak, mp):
    engine = soak.engine

    def execute(original):
        def bad(batch_step, times):
            if engine.step_count == 7:
                raise RuntimeError("planted")
            return original(batch_step, times)
        return bad
    wrap(mp, engine, "_execute", execute)


def pool_never_fits(soak, mp):
    """Admission always finds the pool short: nobody is ever admitted, no step runs."""
    mp.setattr(soak.engine.kv, "can_allocate", lambda *args, **kwargs: False)


def abort_refused(soak, mp):
    mp.setattr(soak.engine, "abort", lambda request_id: False)


def second_abort_accepted(soak, mp):
    wrap(mp, soak.engine, "abort", lambda original: lambda request_id: original(request_id) or True)


def second_abort_takes_a_block(soak, mp):
    kv = soak.engine.kv

    def abort(original):
        def bad(request_id):
            if original(request_id):
                return True
            kv._blocks.setdefault(request_id, []).append(kv._take_free())
            return False
        return bad
    wrap(mp, soak.engine, "abort", abort)


def bool_is_a_count(soak, mp):
    def validate(original):
        def bad(name, value):
            return int(value) if value is True else original(name, value)
        return bad
    wrap(mp, soak.engine, "validate_knob", validate)


def refused_knob_half_applied(soak, mp):
    engine = soak.engine

    def set_knob(original):
        def bad(name, value, source="api"):
            try:
                original(name, value, source)
            except ValueError:
                engine.scheduler.knobs.max_num_batched_tokens = 9
                raise
        return bad
    wrap(mp, engine, "set_knob", set_knob)


def ghost_keeps_a_block(soak, mp):
    """Freeing hands the last block to a holder nobody knows of (a leak the pool's sums do not show)."""
    kv = soak.engine.kv

    def free(original):
        def bad(request_id):
            blocks = kv._blocks.get(request_id, [])
            if blocks:                                # its hold passes to the ghost, counted right
                kv._blocks.setdefault("ghost", []).append(blocks.pop())
            return original(request_id)
        return bad
    wrap(mp, kv, "free", free)


def release_forgets(soak, mp):
    mp.setattr(soak.engine, "release", lambda request_id: None)


def retired_announced_twice(soak, mp):
    def retired(original):
        def bad(*args, **kwargs):
            original(*args, **kwargs)
            original(*args, **kwargs)
        return bad
    wrap(mp, soak.engine.events, "retired", retired)


def every_third_arrival_dropped(soak, mp):
    engine = soak.engine
    arrivals = iter(range(10**9))

    def enqueue(original):
        def bad(request):
            original(request)
            if next(arrivals) % 3 == 2:               # dropped without a retirement
                engine.scheduler.waiting.remove(request)
                del engine.requests[request.request_id]
        return bad
    wrap(mp, engine, "enqueue", enqueue)


FAULTS = [
    # (fault, the run, the invariant the soak must name, a word of its detail)
    (free_twice, STOP_AT_FIRST, "pool accounting", "but counted"),
    (held_twice, STOP_AT_FIRST, "pool accounting", "is held by r"),
    (held_and_free, STOP_AT_FIRST, "pool accounting", "is in the free queue"),
    (lost_block, STOP_AT_FIRST, "pool accounting", "not in the free queue"),
    (finished_keep_blocks, STOP_AT_FIRST, "stray blocks", "neither running nor padding"),
    (preempted_queued_twice, STOP_AT_FIRST, "queued twice", "waiting"),
    (admitted_left_waiting, STOP_AT_FIRST, "waiting and running", "r"),
    (padding_requeued, STOP_AT_FIRST, "padding queued", "r"),
    (preempted_stays_running, STOP_AT_FIRST, "queue status", "waiting with status running"),
    (capacity_disagrees_with_knobs, STOP_AT_FIRST, "batch capacity", "exceed the batch capacity 3"),
    (move_forgets_slot_map, STOP_AT_FIRST, "slot map", "slot"),
    (recompute_ignores_budget, STOP_AT_FIRST, "budget", "over the budget"),
    (admits_one_past_the_cap, STOP_AT_FIRST, "admission cap", "running, cap"),
    (forward_raises, STOP_AT_FIRST, "step raised", "RuntimeError: planted"),
    (pool_never_fits, STALLING, "livelock", "in 300 rounds"),
    (abort_refused, STOP_AT_FIRST, "abort", "was refused"),
    (abort_keeps_blocks, STOP_AT_FIRST, "abort", "still holds blocks"),
    (second_abort_accepted, STOP_AT_FIRST, "double abort", "was accepted"),
    (second_abort_takes_a_block, STOP_AT_FIRST, "double abort", "changed the pool"),
    (bool_is_a_count, STOP_AT_FIRST, "knob validation", "was accepted"),
    (refused_knob_half_applied, STOP_AT_FIRST, "knob validation", "changed the knobs"),
    (ghost_keeps_a_block, WHOLE_RUN, "pool whole", "blocks are still used"),
    (release_forgets, WHOLE_RUN, "requests kept", "still keeps"),
    (retired_announced_twice, WHOLE_RUN, "retired twice", "r"),
    (every_third_arrival_dropped, WHOLE_RUN, "starved", "never retired"),
]


def test_every_invariant_has_a_planted_fault():
    assert {invariant for _, _, invariant, _ in FAULTS} == set(INVARIANTS)


@pytest.mark.parametrize(("fault", "config", "invariant", "detail"), FAULTS,
                         ids=[f"{invariant}-{fault.__name__}" for fault, _, invariant, _ in FAULTS])
def test_a_planted_fault_is_reported_by_its_invariant(monkeypatch, fault, config, invariant, detail):
    soak = Soak(config)
    fault(soak, monkeypatch)
    report = soak.run()
    found = report.of(invariant)
    assert found, f"{fault.__name__}: no {invariant!r} violation in:\n{report.text()}"
    assert any(detail in str(v) for v in found), report.text()


def test_the_whole_run_holds_every_invariant_without_a_fault():
    """What the faults make the soak say comes from them (STOP_AT_FIRST's run unplanted: test_soak.py)."""
    report = Soak(WHOLE_RUN).run()
    assert report.violations == [] and not report.stopped and report.requests == WHOLE_RUN.num_requests


def test_an_admission_past_a_lowered_cap_is_seen_though_a_retirement_offsets_it(monkeypatch):
    """Two running at a cap of 2, one of them retiring this step, and a third admitted: after the step
    two run again, yet the admission went past the cap."""
    soak = Soak(SoakConfig(num_requests=0))
    engine = soak.engine
    engine.set_knob("max_num_seqs", 2)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.add_request([4, 5, 6], SamplingParams(max_tokens=50, ignore_eos=True))
    assert soak.step() and len(engine.scheduler.running) == 2 and soak.report.violations == []
    engine.add_request([7, 8, 9], SamplingParams(max_tokens=50, ignore_eos=True))
    admits_one_past_the_cap(soak, monkeypatch)
    soak.step()
    assert len(engine.scheduler.running) == 2                       # the first retired in this step
    assert [v.invariant for v in soak.report.violations] == ["admission cap"], soak.report.text()
    assert "admitted to 3 running, cap 2" in str(soak.report.violations[0])
