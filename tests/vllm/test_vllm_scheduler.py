"""batchtop's scheduler class inside a real vLLM: events, exact counts, preemptions, live knobs, pause."""
from __future__ import annotations

import asyncio
import re
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import openai
import pytest
from vllm_helpers import AUTH, EVENTS_API_KEY, MAX_NUM_SEQS, NUM_GPU_BLOCKS, PORT

from batchtop.telemetry import events as ev

sys.path.append(str(Path(__file__).resolve().parents[1] / "tui"))      # tui_helpers: screen text

PROMPTS = ["The capital of France is", "Write a haiku about the sea:", "Count from one to ten:",
           "def fibonacci(n):", "Three tips for writing clear code:", "The planets of the solar system are",
           "Once upon a time,", "A hash table works by"]


def metric(base_url: str, name: str) -> float:
    """The sum of one metric's samples in vLLM's /metrics."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    series = rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$"
    return sum(float(m.group(1)) for m in re.finditer(series, text, re.M))


# About 110 tokens: with a few dozen more generated, a request holds two blocks of the pool's five
LONG_PROMPTS = [f"{i}: " + "The history of the city is long and " * 13 for i in range(8)]


async def _completions(n: int, max_tokens: int, *, ignore_eos: bool, port: int = PORT, prompts=PROMPTS):
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    async with client:
        return await asyncio.gather(*[
            client.completions.create(model="smollm2", prompt=prompts[i % len(prompts)],
                                      max_tokens=max_tokens, temperature=0,
                                      extra_body={"ignore_eos": ignore_eos}, timeout=600)
            for i in range(n)])


def set_knob(events_url: str, name: str, value) -> httpx.Response:
    return httpx.post(f"{events_url}/v1/knobs", json={"name": name, "value": value}, headers=AUTH, timeout=10)


def run_load(n: int, max_tokens: int, *, ignore_eos: bool = False, port: int = PORT, prompts=PROMPTS):
    return asyncio.run(_completions(n, max_tokens, ignore_eos=ignore_eos, port=port, prompts=prompts))


def engine_ids(events, responses) -> dict[str, str]:
    """vLLM's engine-side id of each response (the API's id plus a suffix)."""
    arrived = [e.request_id for e in events if isinstance(e, ev.RequestArrived)]
    return {r.id: next(a for a in arrived if a.startswith(r.id)) for r in responses}


def computed_tokens(events, request_id: str) -> int:
    """Tokens computed for one request, from the events alone: its prefill chunks, plus one for each
    step it sampled in without a prefill chunk (a decode row)."""
    chunk_steps = {e.step for e in events if isinstance(e, ev.PrefillChunk) and e.request_id == request_id}
    prefill = sum(e.num_tokens for e in events if isinstance(e, ev.PrefillChunk)
                  and e.request_id == request_id)
    decode = sum(1 for e in events if isinstance(e, ev.StepFinished) and request_id in e.sampled_request_ids
                 and e.step not in chunk_steps)
    return prefill + decode


def test_every_request_arrives_is_admitted_and_retires_with_its_usage(vllm_server, follower):
    started = time.monotonic()                  # the engine's event times are this machine's monotonic clock
    responses = run_load(12, 48)
    ids = engine_ids(follower.wait_for(lambda evs: sum(isinstance(e, ev.RequestArrived) and e.t > started
                                                       for e in evs) >= 12), responses)
    events = follower.wait_for(lambda evs: {e.request_id for e in evs if isinstance(e, ev.RequestRetired)}
                               >= set(ids.values()))
    mine = defaultdict(lambda: defaultdict(list))
    for e in events:
        if getattr(e, "request_id", None) in ids.values():
            mine[type(e)][e.request_id].append(e)
    for response in responses:
        rid = ids[response.id]
        assert len(mine[ev.RequestArrived][rid]) == 1
        assert mine[ev.RequestAdmitted][rid], f"{rid} never admitted"
        (retired,) = mine[ev.RequestRetired][rid]
        assert retired.reason == response.choices[0].finish_reason
        assert retired.num_output_tokens == response.usage.completion_tokens
        assert retired.num_prompt_tokens == response.usage.prompt_tokens
        (first,) = mine[ev.FirstToken][rid]
        # the arrival is vLLM's (its API server took the request before the scheduler saw it): the one
        # its TTFT counts from
        (arrived,) = mine[ev.RequestArrived][rid]
        assert arrived.since_arrival_s > 0
        assert arrived.arrival_t == pytest.approx(first.t - first.ttft_s, abs=0.005)
        recomputed = sum(p.tokens_to_recompute for p in mine[ev.RequestPreempted][rid])
        cache_hits = sum(a.num_computed_tokens for a in mine[ev.RequestAdmitted][rid])
        # every known token is computed once but the last sampled one; a preemption recomputes, a
        # prefix-cache hit at admission skips
        assert computed_tokens(events,
                               rid) == (response.usage.prompt_tokens + response.usage.completion_tokens - 1
                                                + recomputed - cache_hits)
    steps = [e for e in events if isinstance(e, ev.StepFinished) and e.t > started]
    planned = [e for e in events if isinstance(e, ev.StepPlanned) and e.t > started]
    every_step = list(range(steps[0].step, steps[-1].step + 1))
    assert [e.step for e in steps] == [e.step for e in planned] == every_step
    # the rows' split adds up to what vLLM scheduled (its SchedulerOutput.total_num_scheduled_tokens)
    assert sum(e.prefill_tokens + e.decode_tokens for e in planned) == sum(e.num_tokens for e in steps)
    assert sum(computed_tokens(events, rid) for rid in ids.values()) == sum(e.num_tokens for e in steps)


def test_preemptions_match_vllms_count_and_the_pool_drains(vllm_server, follower):
    base_url = vllm_server[0].url
    started = time.monotonic()                  # the server is idle: no preemption before the load
    before = metric(base_url, "vllm:num_preemptions_total")
    # two blocks each, five in the pool
    responses = run_load(MAX_NUM_SEQS, 48, ignore_eos=True, prompts=LONG_PROMPTS)
    assert all(r.usage.completion_tokens == 48 for r in responses)
    ids = set(engine_ids(follower.collect(), responses).values())
    events = follower.wait_for(
        lambda evs: {e.request_id for e in evs if isinstance(e, ev.RequestRetired)} >= ids)
    preempted = [e for e in events if isinstance(e, ev.RequestPreempted) and e.t > started]
    assert len(preempted) == metric(base_url, "vllm:num_preemptions_total") - before > 0
    assert all(p.blocks_freed >= 1 and p.tokens_to_recompute > 0 for p in preempted if p.request_id in ids)
    finished = [e for e in events if isinstance(e, ev.StepFinished)]
    assert finished[-1].kv_blocks_total == NUM_GPU_BLOCKS - 1
    assert max(e.kv_blocks_used for e in finished) == NUM_GPU_BLOCKS - 1      # the pool ran full
    assert finished[-1].kv_blocks_used == 0 and finished[-1].num_running == 0


def test_max_num_seqs_lowered_live_binds_and_a_value_above_the_start_is_refused(vllm_server, follower):
    """(test_vllm_knobs_live.py turns it under load and reads vLLM's /metrics while the load goes on.)"""
    events_url = vllm_server[1]
    refused = set_knob(events_url, "max_num_seqs", MAX_NUM_SEQS + 1)
    assert refused.status_code == 400 and "started with" in refused.json()["error"]["message"]
    assert httpx.get(f"{events_url}/v1/knobs", headers=AUTH).json()["knobs"]["max_num_seqs"] == MAX_NUM_SEQS
    base_url = vllm_server[0].url
    deadline = time.monotonic() + 120        # nothing left running by another test: the cap binds new rows
    while time.monotonic() < deadline and (metric(base_url, "vllm:num_requests_running")
                                           or metric(base_url, "vllm:num_requests_waiting")):
        time.sleep(0.2)
    try:
        accepted = set_knob(events_url, "max_num_seqs", 2)
        assert accepted.status_code == 200, accepted.text
        responses = run_load(6, 24)
        assert len(responses) == 6
        events = follower.wait_for(lambda evs: any(isinstance(e, ev.KnobChanged) and e.new == 2 for e in evs))
        change = next(e for e in reversed(events) if isinstance(e, ev.KnobChanged) and e.new == 2)
        after = [e for e in events if isinstance(e, ev.StepPlanned) and e.t > change.t]
        assert after and max(e.num_running for e in after) <= 2
        assert any(isinstance(e, ev.CommandRefused) and "max_num_seqs" in e.command for e in events)
    finally:
        set_knob(events_url, "max_num_seqs", MAX_NUM_SEQS)


def test_pause_holds_every_step_and_resume_completes_every_request(vllm_server, follower):
    events_url = vllm_server[1]
    assert httpx.post(f"{events_url}/v1/pause", headers=AUTH).json() == {"paused": True}

    async def paused_load():
        task = asyncio.ensure_future(_completions(4, 16, ignore_eos=True))
        # the requests arrive; nothing may be computed
        await asyncio.sleep(3.0)
        held = follower.collect()
        assert httpx.post(f"{events_url}/v1/resume", headers=AUTH).status_code == 200
        return held, await task

    started = time.monotonic()
    try:
        held, responses = asyncio.run(paused_load())
    finally:
        httpx.post(f"{events_url}/v1/resume", headers=AUTH)
    arrived = [e for e in held if isinstance(e, ev.RequestArrived) and e.t > started]
    assert len(arrived) == 4, "the requests reached vLLM's scheduler while it was paused"
    assert any(isinstance(e, ev.EnginePaused) and e.t > started for e in held)
    assert not [e for e in held if isinstance(e, (ev.StepPlanned, ev.RequestAdmitted)) and e.t > started]
    assert all(r.usage.completion_tokens == 16 for r in responses)
    # the responses are back; their retirements reach the event stream a moment later
    def resumed_and_retired(evs):
        resumed = any(isinstance(e, ev.EngineResumed) and e.t > started for e in evs)
        return resumed and sum(isinstance(e, ev.RequestRetired) and e.t > started for e in evs) >= 4
    follower.wait_for(resumed_and_retired)


def test_greedy_outputs_are_those_of_vllm_without_batchtop(vllm_server, stock_vllm):
    for prompt in PROMPTS[:4]:
        ours, theirs = (
            openai.OpenAI(base_url=f"{url}/v1", api_key="none").completions.create(
                model="smollm2", prompt=prompt, max_tokens=24, temperature=0, logprobs=0)
            for url in (vllm_server[0].url, stock_vllm[1]))
        assert ours.choices[0].text == theirs.choices[0].text
        assert ours.choices[0].logprobs.tokens == theirs.choices[0].logprobs.tokens


def test_the_dashboard_shows_vllms_running_requests_and_kv_level(vllm_server):
    from tui_helpers import screen_text

    from batchtop.tui.app import BatchtopApp
    from batchtop.tui.sources.remote import RemoteSource
    events_url = vllm_server[1]

    async def drive():
        app = BatchtopApp(source_factory=lambda: RemoteSource(events_url, EVENTS_API_KEY, from_step=None),
                          loading_what=events_url, tick_s=None)
        async with app.run_test(size=(120, 40)) as pilot:
            load = asyncio.ensure_future(_completions(MAX_NUM_SEQS, 64, ignore_eos=True))
            busiest, screen = (0, 0), ""
            deadline = time.monotonic() + 300
            while not load.done() and time.monotonic() < deadline:
                await pilot.pause(0.2)
                app.tick()
                seen = (app.model.num_running, app.model.kv_used)
                if seen > busiest:
                    busiest, screen = seen, screen_text(app)
            await load
            app.source.close()
            return busiest, screen

    (num_running, kv_used), screen = asyncio.run(drive())
    assert num_running >= 2 and kv_used >= 2
    assert f"run {num_running}" in screen
    assert f"KV pool {kv_used}/{NUM_GPU_BLOCKS - 1} blocks" in screen
    assert "vllm 0.32" in screen and "mirrored from vLLM's input batch" in screen


def test_a_running_vllm_is_never_left_behind(vllm_server):
    server = vllm_server[0]
    assert server.group_alive() and server.process.poll() is None
    assert Counter(httpx.get(f"{server.url}/health").status_code for _ in range(2)) == Counter({200: 2})


def test_a_late_subscriber_gets_a_snapshot_equal_to_the_events_folded_from_the_start(vllm_server, follower):
    """Mid-load, a client that joins live makes vLLM's scheduler publish an EngineSnapshot (its own
    state); the events folded from the first step on hold exactly that state at that point."""
    from vllm_helpers import EventFollower

    from batchtop.telemetry.state import BatchState
    events_url = vllm_server[1]

    async def load_and_join():
        # load until the late client has its snapshot: vLLM's scheduler publishes it before its next step,
        # and an idle vLLM takes none (a fast machine could serve a single burst before the join). Each
        # client sends one request after another, of its own length, so requests are running at any step.
        joined = asyncio.Event()

        async def clients():
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="none", max_retries=0)

            async def one_after_another(i: int):
                while not joined.is_set():
                    await client.completions.create(model="smollm2", prompt=PROMPTS[i % len(PROMPTS)],
                                                    max_tokens=40 + 9 * i, temperature=0,
                                                    extra_body={"ignore_eos": True}, timeout=600)
            async with client:
                await asyncio.gather(*[one_after_another(i) for i in range(MAX_NUM_SEQS)])
        task = asyncio.ensure_future(clients())
        await asyncio.sleep(0)
        started_steps = len([e for e in follower.collect() if isinstance(e, ev.StepFinished)])
        await asyncio.to_thread(follower.wait_for, lambda evs: sum(isinstance(e, ev.StepFinished)
                                                                   for e in evs) > started_steps + 30, 300)
        late = EventFollower(events_url, from_step=None, api_key=EVENTS_API_KEY)
        try:
            await asyncio.to_thread(late.wait_for,
                                    lambda evs: any(isinstance(e, ev.EngineSnapshot) for e in evs))
        finally:
            joined.set()
            late.close()
        await task

    started = time.monotonic()
    asyncio.run(load_and_join())
    events = follower.wait_for(
        lambda evs: any(isinstance(e, ev.EngineSnapshot) and e.t > started for e in evs))
    folded = BatchState()
    for event in events:
        if isinstance(event, ev.EngineSnapshot) and event.t > started:
            snapshot = event
            break
        folded.feed([event])
    expected = {rid: (status, slot, computed, output, blocks) for rid, status, slot, computed,
                output, blocks in zip(
        snapshot.request_ids, snapshot.statuses, snapshot.slots, snapshot.num_computed_tokens,
        snapshot.num_output_tokens, snapshot.num_blocks)}
    assert any(status == "running" for status, *_ in expected.values())
    assert folded.keys() == expected
