"""vLLM's prefix cache through batchtop's class: at each admission the cached tokens and the reason for
the rest, the blocks vLLM evicted, the pool split; checked against vLLM's own numbers. The three loads
of prefix_loads.py (a shared prefix, a prefix just below one block, more prefixes than the pool holds):
under the harness on every vLLM version here (its scheduler, no model), and on the real vLLM 0.32
server of the session (conftest.py: a pool of 5 usable blocks of 128 tokens) with vLLM's
`usage.prompt_tokens_details.cached_tokens` and its `vllm:prefix_cache_*` counters."""
from __future__ import annotations

import httpx
import pytest
from prefix_loads import expected_reasons, loads
from test_vllm_scheduler import metric
from vllm_helpers import EVENTS_API_KEY, PORT, EventFollower

from batchtop.telemetry import events as ev

SERVER_BLOCK_SIZE = 128            # vLLM's CPU build
LOADS = ("shared", "below_block", "eviction")


@pytest.mark.parametrize("load", LOADS)
def test_under_the_harness_reasons_and_sums_are_vllms(checked, load):
    """Synchronous and async scheduling: each admission's reason as expected, its cached tokens vLLM's
    hits for it, the sums vLLM's hits and queries, the cached free blocks vLLM's after every step
    (harness_check.py's `prefix_cache` scenario: the `checked` fixture of conftest.py)."""
    for mode in (load, f"{load}_async"):
        run = checked["prefix_cache"]["runs"][mode]
        assert run["failure"] is None and run["vllm_preempted"] == 0
        assert run["reasons"] == expected_reasons(load), mode
        assert run["cached"] == run["vllm_hits"]
        assert (run["sum_cached"], run["sum_known"]) == (run["vllm_hits_total"], run["vllm_queries_total"])
        assert run["kv_blocks_cached"] == run["vllm_cached_free"], mode
        if load == "shared":
            assert run["sum_cached"] == 2 * 48
        if load == "eviction":
            assert run["evicted_blocks"] > 0


# -- the real vLLM 0.32 server -----------------------------------------------------------------------


def prefix_metrics() -> tuple[float, float]:
    base = f"http://127.0.0.1:{PORT}"
    return metric(base, "vllm:prefix_cache_hits_total"), metric(base, "vllm:prefix_cache_queries_total")


def complete(prompt: list[int]) -> dict:
    response = httpx.post(f"http://127.0.0.1:{PORT}/v1/completions", timeout=300, json={
        "model": "smollm2", "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True})
    response.raise_for_status()
    return response.json()


@pytest.fixture(scope="module")
def server_runs(vllm_server):
    """Each load, one request at a time: (responses, admissions, hits delta, queries delta, evictions)."""
    follower = EventFollower(vllm_server[1], api_key=EVENTS_API_KEY)
    try:
        runs = {}
        for name, prompts in loads(SERVER_BLOCK_SIZE, seed=2).items():
            hits, queries = prefix_metrics()
            responses = [complete(p) for p in prompts]
            ids = [r["id"] for r in responses]

            def done(events):
                retired = [e.request_id for e in events if isinstance(e, ev.RequestRetired)]
                return all(any(r.startswith(i) for r in retired) for i in ids)
            events = follower.wait_for(done, timeout=60)
            admitted = [next(e for e in events if isinstance(e, ev.RequestAdmitted)
                             and e.request_id.startswith(i)) for i in ids]
            hits_after, queries_after = prefix_metrics()
            evicted = sum(len(e.block_ids) for e in events if isinstance(e, ev.BlocksEvicted))
            runs[name] = (responses, admitted, hits_after - hits, queries_after - queries, evicted)
        return runs
    finally:
        follower.close()


@pytest.mark.parametrize("load", LOADS)
def test_on_the_vllm_server_cached_tokens_and_counters_are_vllms(server_runs, load):
    responses, admitted, hits, queries, _ = server_runs[load]
    assert [e.miss_reason for e in admitted] == expected_reasons(load)
    assert [e.num_cached_tokens for e in admitted] == [
        r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in responses]
    assert not any(e.resumed for e in admitted)
    assert sum(e.num_cached_tokens for e in admitted) == hits
    assert sum(e.num_known_tokens for e in admitted) == queries == sum(r["usage"]["prompt_tokens"]
                                                                      for r in responses)
    if load == "shared":
        assert [e.num_cached_tokens for e in admitted] == [0] + [3 * SERVER_BLOCK_SIZE] * 2
    if load == "below_block":
        assert all(e.num_matched_tokens == SERVER_BLOCK_SIZE - 8 for e in admitted[1:])
    if load == "eviction":
        assert server_runs[load][4] > 0 and all(e.evicted_ago_s > 0 for e in admitted[4:])
