"""vLLM's prefix cache through batchtop's class: at each admission the cached tokens and the reason for
the rest, the blocks vLLM evicted, the pool split; checked against vLLM's own numbers. The three loads
of prefix_loads.py (a shared prefix, a prefix just below one block, more prefixes than the pool holds)
on the real vLLM 0.32 server of the session (conftest.py: a pool of 5 usable blocks of 128 tokens) with vLLM's
`usage.prompt_tokens_details.cached_tokens` and its `vllm:prefix_cache_*` counters. The same loads under
the harness, on every vLLM version here: test_vllm_harness.py."""
from __future__ import annotations

import itertools
import random
import time

import httpx
import pytest
from prefix_loads import LOADS, expected_reasons, loads
from test_vllm_scheduler import metric
from vllm_helpers import EVENTS_API_KEY, PORT, EventFollower

from batchtop.telemetry import events as ev

SERVER_BLOCK_SIZE = 128            # vLLM's CPU build
SEEDS = itertools.count(2)



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
    """Each load, one request at a time: (responses, admissions, hits delta, queries delta, evictions).
    The server lives for the whole session: a second set-up of this fixture sends prompts of a new seed,
    which it has never cached."""
    follower = EventFollower(vllm_server[1], api_key=EVENTS_API_KEY)
    try:
        runs = {}
        for name, prompts in loads(SERVER_BLOCK_SIZE, seed=next(SEEDS)).items():
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


@pytest.fixture(scope="module")
def harness():
    """vLLM 0.32's scheduler on a virtual clock, in the server's environment: the replays of this file."""
    from batchtop.engine.whatif import vllm_replay

    with vllm_replay.HarnessProcess("0.32") as process:
        yield process


def test_a_recording_joined_on_the_vllm_server_replays_its_prefix_hits_through_the_harness(vllm_server,
                                                                                         harness):
    """Two requests that share a block-long prefix run on the real vLLM when a recorder joins live (the
    class's snapshot first); two more with that prefix come after and hit it. The recording replays
    through vLLM's own scheduler in the harness from that snapshot: every step as recorded, each
    admission with the cached tokens vLLM gave it (the prompts made up from the blocks' names)."""
    import threading

    from vllm_helpers import AUTH

    from batchtop.engine.bench.whatif_vllm import vllm_header
    from batchtop.engine.whatif import vllm_replay
    from batchtop.engine.whatif.recording import recording_from

    events_url = vllm_server[1]
    rng = random.Random(next(SEEDS))
    prefix = [rng.randrange(1000, 30_000) for _ in range(SERVER_BLOCK_SIZE)]

    def prompt() -> list[int]:
        return prefix + [rng.randrange(1000, 30_000) for _ in range(rng.randint(8, 40))]

    def send(prompts, max_tokens) -> list[threading.Thread]:
        threads = [threading.Thread(target=lambda p=p: httpx.post(
            f"http://127.0.0.1:{PORT}/v1/completions", timeout=300,
            json={"model": "smollm2", "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                  "ignore_eos": True}).raise_for_status()) for p in prompts]
        for thread in threads:
            thread.start()
        return threads

    # long enough to still run when the recorder joins on a busy machine (vLLM publishes the snapshot at
    # its next schedule(), none while idle); prompt and output stay within 2 blocks each
    first = send([prompt(), prompt()], 80)
    # both running by the server's own gauge: a follower's events lag on a loaded host (one read them after
    # both had finished, and the recorder joined an idle server)
    deadline = time.monotonic() + 120
    while metric(f"http://127.0.0.1:{PORT}", "vllm:num_requests_running") < 2:
        assert time.monotonic() < deadline, "the two requests never ran together"
        time.sleep(0.05)
    recorder = EventFollower(events_url, from_step=None, api_key=EVENTS_API_KEY)
    # the later requests go only once the recorder holds its snapshot: sent before, they would
    # be in it and the recording would have no arrivals of its own
    recorder.wait_for(lambda evs: any(isinstance(e, ev.EngineSnapshot) for e in evs), timeout=60)
    state = httpx.get(f"{events_url}/v1/knobs", headers=AUTH, timeout=30).json()
    later = send([prompt(), prompt()], 4)
    for thread in first + later:
        thread.join(300)
    events = recorder.wait_for(lambda evs: sum(isinstance(e, ev.RequestRetired) for e in evs) >= 4)
    recorder.close()
    rec = recording_from(vllm_header(state), events)
    assert isinstance(rec.events[0], ev.EngineSnapshot) and rec.setup.enable_prefix_caching
    assert [item.status for item in rec.in_flight] == ["running", "running"] and len(rec.requests) == 2
    hits = admissions(rec.events)
    assert [n for _, n in hits] == [SERVER_BLOCK_SIZE, SERVER_BLOCK_SIZE]
    assert rec.setup.vllm["version"] == "0.32"
    identity, _ = vllm_replay.identity_through_harness(rec, harness)
    assert identity.first_mismatch is None and identity.match_share == 1.0
    assert admissions(identity.events) == hits


def test_a_chat_on_the_vllm_server_replays_its_hits_on_the_last_answer_through_the_harness(vllm_server,
                                                                                         harness):
    """Three turns of a chat on the real vLLM, each sending the conversation so far (vLLM's own greedy
    answer token ids with it) and a new message: vLLM's cache gives each later turn the blocks of the
    last answer, which no earlier prompt names. Recorded live, the replay through vLLM's scheduler makes
    up the earlier turns' prompt tails and answers as the later prompts name those blocks: every step as
    recorded, each turn with the cached tokens vLLM gave it."""
    from vllm_helpers import AUTH

    from batchtop.engine.bench.whatif_vllm import vllm_header
    from batchtop.engine.whatif import vllm_replay
    from batchtop.engine.whatif.recording import recording_from

    events_url = vllm_server[1]
    rng = random.Random(next(SEEDS))
    recorder = EventFollower(events_url, from_step=None, api_key=EVENTS_API_KEY)
    try:
        deadline = time.monotonic() + 60      # the stream's hello: the recorder holds every event after it
        while not recorder.source.connected and time.monotonic() < deadline:
            time.sleep(0.05)
        state = httpx.get(f"{events_url}/v1/knobs", headers=AUTH, timeout=30).json()
        conversation, cached_tokens = [rng.randrange(1000, 30_000) for _ in range(100)], []
        for _ in range(3):
            response = httpx.post(f"http://127.0.0.1:{PORT}/v1/completions", timeout=300, json={
                "model": "smollm2", "prompt": conversation, "max_tokens": 64, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            response.raise_for_status()
            choice, usage = response.json()["choices"][0], response.json()["usage"]
            cached_tokens.append(usage["prompt_tokens_details"]["cached_tokens"])
            conversation += choice["token_ids"] + [rng.randrange(1000, 30_000) for _ in range(30)]
        events = recorder.wait_for(lambda evs: sum(isinstance(e, ev.RequestRetired) for e in evs) >= 3)
    finally:
        recorder.close()
    rec = recording_from(vllm_header(state), events)
    assert cached_tokens == [0, SERVER_BLOCK_SIZE, 2 * SERVER_BLOCK_SIZE]
    assert [n for _, n in admissions(rec.events)] == cached_tokens and rec.replay_words() == []
    assert len(rec.continued_blocks) == 2
    identity, _ = vllm_replay.identity_through_harness(rec, harness)
    assert identity.first_mismatch is None and identity.match_share == 1.0
    assert admissions(identity.events) == admissions(rec.events)


def admissions(events) -> list[tuple[str, int]]:
    return [(e.request_id, e.num_cached_tokens) for e in events if isinstance(e, ev.RequestAdmitted)]
