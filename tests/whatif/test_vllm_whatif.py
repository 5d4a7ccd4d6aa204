"""`batchtop whatif` over a recording made inside vLLM: batchtop's class inside vLLM 0.32's real
scheduler under the harness makes the recording (a small pool that preempts, aborts, requests that
stop early), and the same harness process replays it: as recorded (identity, step for step), and
with max_num_seqs lowered. One vLLM import for the module. The missing-environment error needs none."""
from __future__ import annotations

import dataclasses
import json
import random

import pytest
from command_helpers import error_lines
from whatif_helpers import cached_at_admission, linear_law, synthetic_recording

from batchtop.engine.bench import whatif_sensitivity
from batchtop.engine.whatif import vllm_replay
from batchtop.engine.whatif.diff import diff_events
from batchtop.engine.whatif.grid import format_table, run_of, write_runs
from batchtop.engine.whatif.recording import read_recording
from batchtop.engine.whatif.tune import tune
from batchtop.telemetry import events as ev
from batchtop.telemetry.recorder import encode_event
from batchtop.telemetry.slowdown import Slowdown
from batchtop.tui.cli import main

LIMITS = {"max_num_seqs": 8, "max_num_batched_tokens": 96, "num_blocks": 33, "block_size": 16}
LAW = {"law": {"prefill_tokens": 6e-5, "decode_rows": 5e-4, "context_tokens": 2e-6}, "intercept_s": 3e-3}


def trace(n: int = 70, seed: int = 5) -> list[dict]:
    rng = random.Random(seed)
    t, rows = 0.0, []
    for i in range(n):
        t += rng.expovariate(30.0)
        max_tokens = rng.randint(4, 40)
        row = {"request_id": f"r{i}", "arrival_s": t, "num_prompt_tokens": rng.randint(8, 120),
               "max_tokens": max_tokens, "output_len": max_tokens}
        roll = rng.random()
        if roll < 0.25:
            row["output_len"] = rng.randint(1, max_tokens - 1)      # ends on a stop token
        elif roll < 0.32:
            row["abort_s"] = t + rng.uniform(0.0, 0.3)
        rows.append(row)
    return rows


def write(path, header, events) -> str:
    with open(path, "w") as f:
        f.write(json.dumps(header) + "\n")
        f.writelines(encode_event(e) + "\n" for e in events)
    return str(path)


def harness_process(version: str) -> vllm_replay.HarnessProcess:
    env = vllm_replay.PROJECT_ROOT / vllm_replay.VLLM_ENVS[version]
    if (env / "UNAVAILABLE").exists():
        pytest.skip(f"no vLLM {version} here: {(env / 'UNAVAILABLE').read_text().strip()}")
    if not (env / "bin" / "python").exists():
        pytest.skip(f"no vLLM {version} environment at {env} (make setup builds it)")
    return vllm_replay.HarnessProcess(version)


@pytest.fixture(scope="module")
def harness():
    with harness_process("0.32") as process:
        yield process


@pytest.fixture
def commands_share_the_harness(harness, monkeypatch):
    """The commands open a harness process of their own (one vLLM import each: 15-25 s on a 2-core host);
    with this they take the module's (`test_the_command_records_...` opens its own once)."""
    class Shared:
        def __init__(self, version: str):
            assert version == harness.version

        def __enter__(self) -> vllm_replay.HarnessProcess:
            return harness

        def __exit__(self, *exc) -> None:
            pass
    monkeypatch.setattr(vllm_replay, "HarnessProcess", Shared)
    monkeypatch.setattr(whatif_sensitivity, "HarnessProcess", Shared)


def recorded_in_harness(harness, folder, step_time, requests: list[dict]):
    result = harness.run({"trace": requests, "limits": LIMITS, "scheduler": "batchtop", "events": True,
                          "step_time": step_time})
    return read_recording(write(folder / "vllm.jsonl", result["header"],
                                [ev.event_from_dict(e) for e in result["events"]]))


@pytest.fixture(scope="module")
def made(harness, tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm-whatif")
    rec = recorded_in_harness(harness, folder, LAW, trace())
    return rec, vllm_replay.whatif_vllm(rec, {"max_num_seqs": [2]}, harness, keep_events=True), folder


def test_the_identity_replay_through_the_harness_schedules_every_recorded_step(made):
    rec, what, _ = made
    kinds = {type(e) for e in rec.events}
    assert {ev.RequestPreempted, ev.PrefillChunk, ev.RequestRetired} <= kinds
    assert {r.reason for r in rec.requests} >= {"stop", "length", "abort"}
    assert rec.setup.vllm["version"] == "0.32" and rec.setup.assumed == ()
    assert what.identity.num_steps > 100
    assert what.identity.first_mismatch is None and what.identity.match_share == 1.0


def prefix_trace() -> list[dict]:
    """trace()'s arrivals with prompts of 4 shared prefixes (1-4 blocks of 16) and tails of their own."""
    rng = random.Random(7)
    prefixes = [[rng.randrange(10, 30_000) for _ in range(16 * rng.randint(1, 4))] for _ in range(4)]
    requests = trace(60, seed=9)
    for row in requests:
        tail = [rng.randrange(10, 30_000) for _ in range(rng.randint(0, 30))]
        row["prompt_token_ids"] = rng.choice(prefixes) + tail
        del row["num_prompt_tokens"]
    return requests


def test_prompts_that_shared_prefixes_in_vllm_share_them_in_its_replay(harness, tmp_path):
    """vLLM caching prefixes: the arrivals name each prompt's full blocks by vLLM's hashes, and the
    replay's made-up prompts share what those share, so vLLM's prefix cache hits as it did: every step
    as recorded, each admission with the recorded cached tokens (a prompt of its own would hit
    nothing and change the schedule)."""
    result = harness.run({"trace": prefix_trace(), "limits": {**LIMITS, "enable_prefix_caching": True},
                          "scheduler": "batchtop", "events": True, "step_time": LAW})
    rec = read_recording(write(tmp_path / "vllm-prefixes.jsonl", result["header"],
                               [ev.event_from_dict(e) for e in result["events"]]))
    assert rec.setup.enable_prefix_caching and rec.setup.assumed == ()
    assert sum(n for _, n in cached_at_admission(rec.events)) >= 16 * 20
    assert all(len(r.prompt_blocks) == r.num_prompt_tokens // 16 for r in rec.requests)
    identity, _ = vllm_replay.identity_through_harness(rec, harness)
    assert identity.first_mismatch is None and identity.match_share == 1.0
    assert cached_at_admission(identity.events) == cached_at_admission(rec.events)
    unnamed = [dataclasses.replace(e, prompt_blocks=()) if isinstance(e, ev.RequestArrived) else e
               for e in rec.events]
    alone, _ = vllm_replay.identity_through_harness(read_recording(
        write(tmp_path / "unnamed.jsonl", result["header"], unnamed)), harness)
    # only a preempted request's own blocks hit again
    assert alone.match_share < 1.0
    recorded = sum(n for _, n in cached_at_admission(rec.events))
    assert sum(n for _, n in cached_at_admission(alone.events)) < recorded / 10


@pytest.mark.parametrize(("scheduling", "join_at"), [("sync", 45), ("sync", 361), ("async", 48),
                                                     ("async", 361)])
def test_a_vllm_recording_joined_mid_run_replays_from_its_snapshot(harness, tmp_path, scheduling, join_at):
    """A recorder that joins vLLM while it runs starts with the class's snapshot and holds no arrival
    for the requests then in flight (here running, preempted and waiting ones at every join).
    Every harness run starts from them in vLLM's scheduler as the snapshot had them (the running
    ones in vLLM's order with their rows, computed tokens, output and KV blocks, the queue in its
    order): the identity replay plans every step as recorded (left out, it does not), and every
    what-if run serves them to their recorded lengths (at max_num_seqs=2, below the rows running at
    the start: the cap binds as they finish). Under async scheduling the snapshot falls while a step
    is in flight (planned before it, its outcome after): every run schedules that step again first,
    its rows' tokens as the outcome names them."""
    limits = {**LIMITS, "async_scheduling": scheduling == "async"}
    result = harness.run({"trace": trace(), "limits": limits, "scheduler": "batchtop", "events": True,
                          "step_time": LAW, "snapshot_before_step": join_at})
    events = [ev.event_from_dict(e) for e in result["events"]]
    joined_at = next(k for k, e in enumerate(events) if isinstance(e, ev.EngineSnapshot))
    rec = read_recording(write(tmp_path / "joined.jsonl", result["header"], events[joined_at:]))
    assert {item.status for item in rec.in_flight} == {"running", "preempted", "waiting"}
    assert rec.unseen == ()
    in_flight = {item.request.request_id: item.num_in_flight_tokens for item in rec.in_flight
                 if item.num_in_flight_tokens}
    if scheduling == "async":
        # the first outcome after the snapshot is a step whose plan came before it, of every running row
        first = next(e for e in rec.events if isinstance(e, ev.StepFinished))
        assert not any(isinstance(e, ev.StepPlanned) and e.step == first.step for e in rec.events)
        assert set(in_flight) == set(first.sampled_request_ids) == {
            item.request.request_id for item in rec.in_flight if item.status == "running"}
        assert "a step of" in rec.replay_words()[0]
    else:
        assert in_flight == {}
    identity, _ = vllm_replay.identity_through_harness(rec, harness)
    assert identity.first_mismatch is None and identity.match_share == 1.0
    alone = harness.run({**vllm_replay._job(rec, vllm_replay.recorded_table(rec), as_scheduled=True),
                         "joined": []})
    assert vllm_replay.identity_of(rec, None, vllm_replay._events(alone)).match_share < 1.0
    what = vllm_replay.whatif_vllm(rec, {"max_num_seqs": [2]}, harness, keep_events=True)
    assert "requests were in flight when the recording began" in format_table(what)

    def served(events) -> dict[str, int]:
        """The in-flight requests that ended by their output, with its length."""
        joined = {item.request.request_id for item in rec.in_flight}
        return {e.request_id: e.num_output_tokens for e in events
                if isinstance(e, ev.RequestRetired) and e.request_id in joined and e.reason != "abort"}
    assert len(served(rec.events)) >= 6
    assert all(served(run.events) == served(rec.events) for run in what.runs)


def test_an_async_vllm_recording_replays_its_timeline_and_the_fit_recovers_the_law(harness, tmp_path):
    """Under async scheduling vLLM plans a step while the one before runs. Each step's phases are the
    scheduler's own time on it (its schedule() and update) and the time it waited for that step's
    output after its last call: the phases of the steps add up to the run's time, one step after the
    other, so the identity replay follows the recorded timeline and the fit recovers the harness's law.
    (Timed from the end of its own schedule() instead, a step also counted the step before it: the
    fit's held-out error was 20%, the identity replay matched 2% of the steps.)"""
    result = harness.run({"trace": trace(), "limits": {**LIMITS, "async_scheduling": True},
                          "scheduler": "batchtop", "events": True, "step_time": LAW})
    rec = read_recording(write(tmp_path / "async.jsonl", result["header"],
                               [ev.event_from_dict(e) for e in result["events"]]))
    steps = sorted(rec.steps, key=lambda e: e.step)
    phases = sum(e.schedule_s + e.forward_s + e.update_s for e in steps)
    assert phases == pytest.approx(sum(step["step_s"] for step in result["steps"]), rel=1e-9)
    assert phases == pytest.approx(steps[-1].t - rec.t0, rel=0.02)
    what = vllm_replay.whatif_vllm(rec, {"max_num_seqs": [2]}, harness)
    assert what.identity.match_share == 1.0
    assert what.model.forward.heldout_mape < 0.02
    recorded, fitted, _ = what.runs
    assert fitted.summary.span_s == pytest.approx(recorded.summary.span_s, rel=0.01)


@pytest.mark.parametrize(("scheduling", "join_at"), [("sync", 40), ("sync", 90), ("sync", 120),
                                                     ("async", 90)])
def test_a_vllm_recording_joined_mid_run_shares_prefixes_as_vllm_did(harness, tmp_path, scheduling, join_at):
    """Joined while vLLM caches shared prefixes: the snapshot names each request's prompt blocks, how
    many blocks the cache gave it at admission and vLLM's free queue (cached blocks by name, in the
    order vLLM hands them out). The harness shares those blocks among the requests in flight, caches
    the free queue's blocks under the hashes vLLM gives the made-up prompts, and holds the row of a
    request that finished just before the snapshot until vLLM's worker would free it (before step
    90): every step as recorded, each admission with the recorded cached tokens. Under async scheduling
    (before step 90) the step in flight at the snapshot carries a prompt's chunk: scheduled again, its
    blocks come from the free queue before the snapshot's cached blocks are laid on it."""
    limits = {**LIMITS, "enable_prefix_caching": True, "async_scheduling": scheduling == "async"}
    result = harness.run({"trace": prefix_trace(), "limits": limits,
                          "scheduler": "batchtop", "events": True, "step_time": LAW,
                          "snapshot_before_step": join_at})
    events = [ev.event_from_dict(e) for e in result["events"]]
    joined_at = next(k for k, e in enumerate(events) if isinstance(e, ev.EngineSnapshot))
    snapshot = events[joined_at]
    assert snapshot.kv_blocks_cached >= 7 and snapshot.free_blocks.count("") < len(snapshot.free_blocks)
    rec = read_recording(write(tmp_path / "joined.jsonl", result["header"], events[joined_at:]))
    chunked = [item for item in rec.in_flight if item.num_in_flight_tokens > 1]
    assert bool(chunked) == (scheduling == "async")
    assert not any("admissions took" in words for words in rec.replay_words())
    identity, _ = vllm_replay.identity_through_harness(rec, harness)
    assert identity.first_mismatch is None and identity.match_share == 1.0
    recorded = cached_at_admission(rec.events)
    assert cached_at_admission(identity.events) == recorded and sum(n for _, n in recorded) > 0


def test_a_chats_next_turn_takes_the_last_answer_from_vllms_cache_in_the_replay_too(harness, tmp_path):
    """Three turns of a chat through vLLM's scheduler in the harness, each sending the conversation so far
    (the harness's made-up answer with it) and a new message: vLLM's cache gives each later turn the
    last answer's blocks. The replay makes up the earlier turns' prompt tails and answers as the later
    prompts name those blocks (the first prompt, shorter than a block, too): each turn takes the
    recorded tokens from the cache, every step as recorded."""
    sampled_token = 7       # the harness's made-up answer token (engine/vllm/harness.py's SAMPLED_TOKEN)
    rng = random.Random(4)
    conversation, turns = [rng.randrange(10, 30_000) for _ in range(10)], []   # not one whole block
    for turn in range(3):
        turns.append({"request_id": f"turn{turn}", "arrival_s": float(turn),
                      "prompt_token_ids": list(conversation), "max_tokens": 24, "output_len": 24})
        conversation += [sampled_token] * 24 + [rng.randrange(10, 30_000) for _ in range(9)]
    result = harness.run({"trace": turns, "limits": {**LIMITS, "enable_prefix_caching": True},
                          "scheduler": "batchtop", "events": True, "step_time": LAW})
    rec = read_recording(write(tmp_path / "chat.jsonl", result["header"],
                               [ev.event_from_dict(e) for e in result["events"]]))
    recorded = cached_at_admission(rec.events)
    assert [n for _, n in recorded] == [0, 32, 64] and rec.replay_words() == []
    assert set(rec.continued_blocks) == {"turn0", "turn1"}
    identity, _ = vllm_replay.identity_through_harness(rec, harness)
    assert identity.first_mismatch is None and identity.match_share == 1.0
    assert cached_at_admission(identity.events) == recorded


def test_on_vllm_033_async_recordings_replay_whole_and_joined_with_the_step_in_flight(tmp_path):
    """The release production runs (0.33, async scheduling by default on GPUs), in its own interpreter:
    a whole async recording replays step for step and its fit recovers the harness's law; recordings
    joined while a step was in flight (one with shared prefixes, a prompt's chunk in that step) replay
    every step as recorded, each admission with the recorded cached tokens."""
    with harness_process("0.33") as harness:
        limits = {**LIMITS, "async_scheduling": True}
        whole = harness.run({"trace": trace(), "limits": limits, "scheduler": "batchtop", "events": True,
                             "step_time": LAW})
        rec = read_recording(write(tmp_path / "whole.jsonl", whole["header"],
                                   [ev.event_from_dict(e) for e in whole["events"]]))
        assert rec.setup.vllm["version"] == "0.33"
        what = vllm_replay.whatif_vllm(rec, {}, harness)
        assert what.identity.match_share == 1.0 and what.model.forward.heldout_mape < 0.02
        for requests, join_at, prefix in ((trace(), 48, False), (prefix_trace(), 90, True)):
            result = harness.run({"trace": requests, "limits": {**limits, "enable_prefix_caching": prefix},
                                  "scheduler": "batchtop", "events": True, "step_time": LAW,
                                  "snapshot_before_step": join_at})
            events = [ev.event_from_dict(e) for e in result["events"]]
            joined_at = next(k for k, e in enumerate(events) if isinstance(e, ev.EngineSnapshot))
            rec = read_recording(write(tmp_path / "joined.jsonl", result["header"], events[joined_at:]))
            in_flight = [item.num_in_flight_tokens for item in rec.in_flight if item.num_in_flight_tokens]
            assert in_flight and (max(in_flight) > 1) == prefix
            identity, _ = vllm_replay.identity_through_harness(rec, harness)
            assert identity.first_mismatch is None and identity.match_share == 1.0
            assert cached_at_admission(identity.events) == cached_at_admission(rec.events)


def test_a_request_arrives_when_vllms_request_says_and_is_taken_in_at_a_step_boundary(made):
    """RequestArrived comes when the scheduler sees the request, at a step boundary; its `arrival_t` is
    vLLM's `arrival_time` (here the trace's), which TTFT counts from."""
    rec, what, _ = made
    arrivals = {r["request_id"]: r["arrival_s"] for r in trace()}
    arrived = [e for e in rec.events if isinstance(e, ev.RequestArrived)]
    assert sorted(e.request_id for e in arrived) == sorted(arrivals)
    first = arrived[0]
    for e in arrived:
        since_first = arrivals[e.request_id] - arrivals[first.request_id]
        assert e.arrival_t - first.arrival_t == pytest.approx(since_first, abs=1e-9)
    assert sum(e.since_arrival_s > 1e-4 for e in arrived) > len(arrived) / 2     # most came while a step ran
    first_token = {e.request_id: e for e in rec.events if isinstance(e, ev.FirstToken)}
    for e in arrived:
        if e.request_id in first_token:
            token = first_token[e.request_id]
            assert token.t - token.ttft_s == pytest.approx(e.arrival_t, abs=1e-9)
    # the identity replay takes each request in where the recording did, not at its arrival
    assert what.identity.first_mismatch is None


def test_the_fit_recovers_the_harness_law_and_a_lower_max_num_seqs_runs_fewer(made):
    rec, what, folder = made
    assert what.model.forward.heldout_mape < 0.02
    recorded, fitted, lowered = what.runs
    assert lowered.knobs == {"max_num_seqs": 2}
    most = {run.label: max(e.num_running for e in run.events if isinstance(e, ev.StepFinished))
            for run in what.runs}
    assert most["max_num_seqs=2"] <= 2 < most["recorded"]
    assert lowered.summary.ttft.p99 > recorded.summary.ttft.p99
    # the fitted law on the recorded knobs lands near the recording itself
    assert fitted.summary.span_s == pytest.approx(recorded.summary.span_s, rel=0.05)
    # --record: the what-if run is a vLLM recording again, under its own knobs
    (path,) = write_runs(what, str(folder / "what.jsonl"))
    again = read_recording(path)
    assert again.setup.vllm["version"] == "0.32" and again.setup.knobs["max_num_seqs"] == 2


def test_a_run_summarised_in_the_harness_reads_as_its_events_and_splits_waits_by_reason(made, harness):
    """Without --record a predicted run comes back as the harness's summary of its events, not the events:
    the same row, figure for figure; vLLM's waits are split by what stopped admission."""
    rec, what, _ = made
    with_events = what.runs[2]
    summarised = vllm_replay.predict_through_harness(rec, what.model, harness, {"max_num_seqs": 2})
    assert summarised.events is None and with_events.events
    assert {**summarised.row(), "compute_s": 0} == {**with_events.row(), "compute_s": 0}
    waits = summarised.row()["wait_s_by_reason"]
    others = [seconds for reason, seconds in waits.items() if reason != "max_num_seqs"]
    assert waits["max_num_seqs"] > max(others, default=0)
    recorded = what.runs[0].summary.wait_s_by_reason
    assert recorded and sum(recorded.values()) < sum(waits.values())


def test_the_command_records_a_vllm_what_if_only_when_asked_and_its_figures_do_not_change(made, capsys,
                                                                                           request):
    """`batchtop whatif` on a vLLM recording: with --record the run's events come back and are written as
    a vLLM recording; without, its summary; the table's figures are the same either way. The first
    command opens its own harness process, as from the shell; the second takes the module's."""
    rec, _, folder = made
    out = folder / "cli.jsonl"
    rows = []
    for extra in ([], ["--record", str(out)]):
        if extra:
            request.getfixturevalue("commands_share_the_harness")
        assert main(["whatif", rec.path, "--set", "max_num_seqs=2", "--json", *extra]) == 0
        report = json.loads(capsys.readouterr().out)
        rows.append({**report["runs"][2], "compute_s": 0})
        assert report["recorded_to"] == ([str(out)] if extra else [])
    assert rows[0] == rows[1] and rows[0]["wait_s_by_reason"]["max_num_seqs"] > 0
    again = read_recording(str(out))
    assert again.setup.vllm["version"] == "0.32" and again.setup.knobs["max_num_seqs"] == 2


def test_tune_over_a_vllm_recording_picks_what_the_harness_grid_shows_best(made, harness):
    """`tune` on a recording made inside vLLM runs vLLM's scheduler through the harness: its choice is the
    value a brute-force what-if grid through the same harness shows best within the SLO."""
    rec, _, _ = made
    values = [2, 3, 4, 6, 8]
    grid = vllm_replay.whatif_vllm(rec, {"max_num_seqs": values}, harness).runs[2:]
    ttft_p99 = sorted(run.summary.ttft.p99 for run in grid)
    slo = {"ttft_p99": (ttft_p99[1] + ttft_p99[2]) / 2}     # two of the five miss it
    meeting = [run for run in grid if run.summary.ttft.p99 <= slo["ttft_p99"]]
    assert 0 < len(meeting) < len(grid)
    brute = max(meeting, key=lambda run: run.summary.throughput_out_tok_s)
    result = tune(rec, {"max_num_seqs": values}, slo, harness=harness)
    assert result.best.knobs == brute.knobs
    assert result.best.summary.throughput_out_tok_s == brute.summary.throughput_out_tok_s
    assert result.heldout_mape < 0.02


def two_bursts(gap_s: float = 30.0) -> tuple[list[dict], float]:
    """A trace of two bursts `gap_s` apart (the engine idle between them), and when the second begins."""
    first, second = trace(30, seed=7), trace(40, seed=8)
    start = first[-1]["arrival_s"] + gap_s
    for row in second:
        row["request_id"] = "b" + row["request_id"]
        row["arrival_s"] += start
        if "abort_s" in row:
            row["abort_s"] += start
    return first + second, start


def test_a_recording_joined_while_vllm_was_idle_replays_step_for_step(harness, tmp_path):
    """A recorder that joins a vLLM that has served before holds steps numbered from where the server had
    got to; its replay numbers them from 1. The identity replay and diff compare the k-th step with the
    k-th: every step scheduled as recorded, no divergence, no request in flight at the join."""
    rows, second_s = two_bursts()
    whole = recorded_in_harness(harness, tmp_path, LAW, rows)
    join_t = whole.t0 + second_s - 1.0
    assert all(e.t < join_t - 5.0 for e in whole.events if e.t < join_t)      # idle before the join
    joined = write(tmp_path / "joined.jsonl", whole.header, [e for e in whole.events if e.t >= join_t])
    rec = read_recording(joined)
    assert min(e.step for e in rec.events if isinstance(e, ev.StepPlanned)) > 50
    assert len(rec.requests) == 40 and rec.in_flight == ()
    what = vllm_replay.whatif_vllm(rec, {"max_num_seqs": [2]}, harness, keep_events=True)
    assert what.identity.num_steps > 50
    assert what.identity.first_mismatch is None and what.identity.match_share == 1.0
    assert diff_events(rec.events, what.identity.events).first_divergence is None
    lowered = diff_events(rec.events, what.runs[2].events)       # numbered from 1 too
    assert lowered.first_divergence > min(e.step for e in rec.events if isinstance(e, ev.StepPlanned))


def slow_stretch(start_s: float, end_s: float, factor: float) -> dict:
    """A recorded slowdown table: every step `factor` times slower between `start_s` and `end_s`."""
    starts = [i * 0.01 for i in range(400)]
    load = [factor if start_s <= t < end_s else 1.0 for t in starts]
    return Slowdown({1: 1.0}, tuple(starts), tuple(load), sum(load) / len(load)).to_dict()


def test_a_slow_stretch_inside_vllm_stays_where_it_was_and_the_median_token_gap_holds(harness, tmp_path):
    """The recording's machine was 6x slower for a stretch: the fit finds it there, and the prediction
    at the recorded knobs keeps the median token gap (the mean slowdown over every step would stretch
    every step, the median one too) and the throughput."""
    rec = recorded_in_harness(harness, tmp_path, {**LAW, "slowdown": slow_stretch(0.6, 1.4, 6.0)},
                              trace(90, seed=8))
    what = vllm_replay.whatif_vllm(rec, {}, harness)
    rng = random.Random(0)
    assert what.model.slowdown.draw(rng, 4, 0.3) == pytest.approx(1.0, rel=0.2)
    assert what.model.slowdown.draw(rng, 4, 1.0) == pytest.approx(6.0, rel=0.2)
    recorded, fitted = (run.summary for run in what.runs)
    assert what.model.mean_slowdown > 1.2    # a law times the mean would miss the median gap by as much
    assert fitted.itl.p50 == pytest.approx(recorded.itl.p50, rel=0.1)
    assert fitted.throughput_out_tok_s == pytest.approx(recorded.throughput_out_tok_s, rel=0.1)


@pytest.fixture
def inside_vllm(tmp_path):
    rec = synthetic_recording(linear_law, num_requests=20)

    def recorded_by(device: str) -> str:
        inside = dataclasses.replace(rec, header={**rec.header, "device": device})
        return write(tmp_path / "vllm.jsonl", inside.header, inside.events)

    return recorded_by


def test_a_vllm_recording_without_its_environment_is_refused_in_one_line(inside_vllm, monkeypatch, capsys):
    monkeypatch.setitem(vllm_replay.VLLM_ENVS, "0.32", ".venv-vllm-not-here")
    assert main(["whatif", inside_vllm("vllm 0.32.1"), "--set", "max_num_seqs=2"]) == 2
    (err,) = error_lines(capsys.readouterr().err)
    assert "vLLM 0.32" in err and ".venv-vllm-not-here is not installed" in err
    assert main(["whatif", inside_vllm("vllm 0.29.0"), "--set", "max_num_seqs=2"]) == 2
    assert "replays vLLM 0.32 and 0.33 only" in capsys.readouterr().err
    assert main(["whatif", inside_vllm("vllm 0.32.1"), "--set", "batching_mode=static"]) == 2
    assert "not a knob of vLLM's scheduler" in capsys.readouterr().err
    tune = ["tune", inside_vllm("vllm 0.32.1"), "--slo", "ttft_p99=1s", "--knob", "max_num_seqs=1..4"]
    assert main(tune) == 2
    assert ".venv-vllm-not-here is not installed" in capsys.readouterr().err


def test_step_time_scales_the_law_vllms_scheduler_runs_on(made, capsys, commands_share_the_harness):
    """`--step-time 2` on a vLLM recording: the harness's law carries every forward coefficient doubled
    (the overheads and the gap as fitted), and the run's first step takes twice the forward time."""
    rec, result, folder = made
    plain, doubled = vllm_replay.law_spec(result.model.fresh()), vllm_replay.law_spec(result.model.fresh(2.0))
    assert doubled["intercept_s"] == pytest.approx(2 * plain["intercept_s"])
    assert doubled["law"] == pytest.approx({k: 2 * v for k, v in plain["law"].items()})
    assert doubled["overhead"] == plain["overhead"] and doubled["slowdown"] == plain["slowdown"]
    out = folder / "scaled.jsonl"
    assert main(["whatif", rec.path, "--set", "max_num_seqs=2", "--step-time", "1,2", "--json",
                 "--record", str(out)]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [r["run"] for r in runs[2:]] == ["as recorded (fitted) @2x", "max_num_seqs=2",
                                            "max_num_seqs=2 @2x"]
    assert runs[4]["span_s"] > runs[3]["span_s"]
    slow = read_recording(str(folder / "scaled.max_num_seqs=2-step_time=2.jsonl")).steps[0]
    fast = read_recording(str(folder / "scaled.max_num_seqs=2.jsonl")).steps[0]
    assert slow.forward_s == pytest.approx(2 * fast.forward_s) and slow.forward_s > 0


def test_a_vllm_check_is_priced_again_through_the_harness_and_reads_a_slower_real_runs_steps(
        made, harness, tmp_path, commands_share_the_harness):
    """whatif_sensitivity on a vLLM check's files: the round's recording priced again through vLLM's
    scheduler gives, at 1x, the what-if's own prediction and, at 1.5x, a longer run; a real run made on
    a law 1.25x the recording's reads a step ratio of 1.25; the section is the vLLM check's."""
    rec, what, _ = made
    round_path = write(tmp_path / "round1.jsonl", rec.header, rec.events)
    slower = {"law": {k: 1.25 * v for k, v in LAW["law"].items()}, "intercept_s": 1.25 * LAW["intercept_s"]}
    real = recorded_in_harness(harness, tmp_path, slower, trace())
    (tmp_path / "vllm.jsonl").rename(tmp_path / f"round1-max_num_seqs={LIMITS['max_num_seqs']}.jsonl")
    point = {"knobs": {"max_num_seqs": LIMITS["max_num_seqs"]},
             "measured": [run_of("real", {}, real.events).row()]}
    saved = {"command": "python -m vllm.entrypoints.openai.api_server --max-num-seqs 8",
             "rounds": [{"path": round_path}], "points": [point]}

    result = whatif_sensitivity.analyse(saved, (1.0, 1.5), seeds=1)
    [scaled] = result["points"]
    [same], [slow] = scaled["scaled"][1.0], scaled["scaled"][1.5]
    expected = vllm_replay.predict_through_harness(rec, what.model, harness, point["knobs"]).row()
    for key in ("ttft_p50_s", "itl_p50_s", "output_tok_s", "preemptions", "steps"):
        assert same[key] == expected[key]
    assert slow["span_s"] > same["span_s"] and slow["itl_p50_s"] > same["itl_p50_s"]
    [ratio] = scaled["step_ratio"]
    assert ratio == pytest.approx(1.25, rel=0.03)
    args = whatif_sensitivity.make_parser().parse_args(["points.json"])
    table = whatif_sensitivity.report(args, saved, result)
    assert table.startswith("## Sensitivity to step time: vLLM 0.32\n")
