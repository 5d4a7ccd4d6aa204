"""The soak, bounded: every invariant after every step through aborts, a knob storm and a dry pool."""
from __future__ import annotations

import pytest
import torch

from batchtop.engine.core.kv_cache import NO_LOOKUP
from batchtop.engine.reliability.invariants import check_invariants
from batchtop.engine.reliability.soak import Soak, SoakConfig

NUM_REQUESTS = 400


@pytest.fixture
def keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_bounded_soak_holds_every_invariant(keep_torch_threads):
    soak = Soak(SoakConfig(num_requests=NUM_REQUESTS, seed=1))
    kv, allocate, shared = soak.engine.kv, soak.engine.kv.try_allocate, []

    def counting(request_id, num_total_tokens, cached=NO_LOOKUP):
        shared.extend(b for b in cached.block_ids if kv._ref[b] > 0)  # already held by another request
        return allocate(request_id, num_total_tokens, cached)
    kv.try_allocate = counting
    report = soak.run()
    print(report.text(), f"\nblocks shared with a running request at admission: {len(shared)}")
    assert len(shared) >= 100                                        # 223 at seed 1
    assert report.violations == []
    assert sum(report.finished.values()) == NUM_REQUESTS
    assert report.finished["abort"] == sum(n for kind, n in report.aborts.items() if kind != "finished")
    assert min(report.aborts["waiting"], report.aborts["prefill"], report.aborts["decode"]) >= 3
    assert report.aborts["finished"] == report.finished["abort"]       # every second abort refused
    assert report.preemptions >= 30 and report.retractions >= 5
    assert report.knob_changes >= 300 and report.mode_switches >= 60 and report.knobs_refused >= 500
    assert report.longest_wait_steps < 2_000


def test_the_checks_see_a_leak_a_double_holder_and_a_double_queue(keep_torch_threads):
    """check_invariants on its own (tests/engine/test_soak_faults.py plants a fault per invariant)."""
    soak = Soak(SoakConfig(num_requests=0))
    engine = soak.engine
    assert check_invariants(engine) == []
    a = engine.add_request([1, 2, 3])
    engine.step()
    kv = engine.kv
    kv._blocks["ghost"] = [kv._free.popitem(last=False)[0]]          # a block nobody running holds
    assert any("neither running nor padding" in str(p) for p in check_invariants(engine))
    kv._blocks["ghost"] = list(kv.block_ids(a))                       # held twice
    assert any("held by" in str(p) and "ghost" in str(p) for p in check_invariants(engine))
    kv._blocks.pop("ghost")
    held = kv.block_ids(a)[0]
    kv._free[held] = None                                             # freed while held
    assert any("is in the free queue" in str(p) for p in check_invariants(engine))
    del kv._free[held]
    engine.scheduler.waiting.append(engine.scheduler.running[0])
    assert "waiting and running" in [p.invariant for p in check_invariants(engine)]
