"""The view model folded from the fixture log, and replay navigation (no UI)."""
from __future__ import annotations

import pytest
from tui_helpers import FIXTURE_LOG

from batchtop.engine.core.config import EngineConfig
from batchtop.engine.core.engine import Engine
from batchtop.engine.core.loop import EngineLoop
from batchtop.engine.core.sampling import SamplingParams
from batchtop.telemetry.bus import EventBus
from batchtop.telemetry.events import (
    EngineSnapshot,
    EventsDropped,
    KnobChanged,
    PrefillChunk,
    RequestAdmitted,
    RequestArrived,
    RequestPreempted,
    RequestRetired,
    RequestRetracted,
    RowMoved,
    StepFinished,
    StepPlanned,
)
from batchtop.telemetry.recorder import read_log
from batchtop.telemetry.state import BatchState
from batchtop.tui.model import DashboardModel
from batchtop.tui.sources import ReplaySource
from batchtop.tui.sources.engine import EngineSource


def fold(events) -> DashboardModel:
    header, _ = read_log(FIXTURE_LOG)
    model = DashboardModel(knobs=dict(header["knobs"]))
    model.feed(list(events))
    return model


def test_fixture_folds_to_a_drained_engine():
    _, events = read_log(FIXTURE_LOG)
    model = fold(events)
    assert model.step == events[-1].step
    assert not model.live, "every request retired by the end of the log"
    assert {r.state for r in model.retired.values()} == {"length", "abort"}
    assert all(slot is None for slot in model.slots)
    assert model.knobs["max_num_seqs"] == 4 and len(model.knob_marks) == 1
    assert model.history and model.kv_used == 0


def test_a_finished_request_counts_every_token_it_computed():
    """Computed tokens are state (a preemption sets them to 0): at the end every known token but the
    last sampled one, preempted or not. The last decode row comes in the step the request retires in
    (RequestRetired before that step's StepFinished)."""
    _, events = read_log(FIXTURE_LOG)
    preempted = {e.request_id for e in events if isinstance(e, (RequestPreempted, RequestRetracted))}
    done = [r for r in fold(events).retired.values() if r.state == "length"]
    assert done and preempted & {r.request_id for r in done}
    for r in done:
        assert r.num_computed_tokens == r.num_prompt_tokens + r.num_output_tokens - 1, r.request_id


def test_running_requests_match_the_slots_at_every_step():
    _, events = read_log(FIXTURE_LOG)
    model = fold([])
    for event in events:
        model.feed([event])
        if type(event) is StepFinished:
            running = {r.request_id for r in model.live.values() if r.state == "running"}
            assert running == {rid for rid in model.slots if rid is not None}
            assert len(running) == event.num_running
            for rid in running:
                assert model.slots[model.live[rid].slot] == rid


def test_slot_kinds_mark_admission_move_and_hole():
    model = DashboardModel(knobs={"max_num_seqs": 4})
    model.feed([RequestArrived(step=1, t=0.0, request_id="a", num_prompt_tokens=10, max_tokens=5, priority=0),
                RequestArrived(step=1, t=0.0, request_id="b", num_prompt_tokens=10, max_tokens=5, priority=0),
                RequestAdmitted(step=1, t=0.1, request_id="a", slot=0, num_computed_tokens=0, resumed=False),
                RequestAdmitted(step=1, t=0.1, request_id="b", slot=1, num_computed_tokens=0, resumed=False),
                StepFinished(step=1, t=0.2, num_rows=2, num_tokens=20,
                             sampled_request_ids=("a", "b"), num_running=2, num_waiting=0, kv_blocks_used=2,
                             kv_blocks_total=10, schedule_s=0, prepare_s=0, forward_s=0,
                             sample_s=0, update_s=0)])
    assert [model.slot_kind(i)[0] for i in range(4)] == ["admitted", "admitted", "free", "free"]
    model.feed([StepFinished(step=2, t=0.3, num_rows=2, num_tokens=2,
                             sampled_request_ids=("a", "b"), num_running=2, num_waiting=0, kv_blocks_used=2,
                             kv_blocks_total=10, schedule_s=0, prepare_s=0, forward_s=0,
                             sample_s=0, update_s=0)])
    assert [model.slot_kind(i)[0] for i in range(3)] == ["decode", "decode", "free"]
    model.feed([RequestRetired(step=2, t=0.35, request_id="a", reason="stop", slot=0, num_prompt_tokens=10,
                               num_output_tokens=2)])
    assert model.slot_kind(0)[0] == "hole"
    model.feed([RowMoved(step=3, t=0.4, request_id="b", from_slot=1, to_slot=0, num_bytes=128),
                StepPlanned(step=3, t=0.4, prefill_tokens=0, recompute_tokens=0, decode_tokens=1,
                            num_prefill_rows=0, num_recompute_rows=0, num_decode_rows=1, num_padding_rows=0,
                            token_budget=64, num_running=1, num_waiting=0, kv_blocks_used=1,
                            kv_blocks_total=10)])
    assert model.slot_kind(0) == ("moved", "b") and model.slot_kind(1)[0] == "free"
    assert model.live["b"].slot == 0


def test_knob_changes_update_knobs_and_marks():
    model = DashboardModel(knobs={"max_num_seqs": 8})
    model.feed([KnobChanged(step=5, t=1.0, name="max_num_seqs", old=8, new=16, source="tui")])
    assert model.knobs["max_num_seqs"] == 16
    assert model.knob_marks[-1].name == "max_num_seqs" and "8 → 16" in model.message


def replay(**kwargs) -> ReplaySource:
    return ReplaySource.from_file(FIXTURE_LOG, clock=lambda: 0.0, paused=True, **kwargs)


def test_replay_step_forward_and_back_land_on_step_ends():
    source = replay()
    source.step_once()
    poll = source.poll()
    assert type(poll.events[-1]) is StepFinished and poll.events[-1].step == 1
    source.step_once()
    assert source.poll().events[-1].step == 2
    source.step_back()
    poll = source.poll()
    assert poll.reset and type(poll.events[-1]) is StepFinished and poll.events[-1].step == 1


def test_replay_seek_and_playback_with_a_moving_clock():
    now = [0.0]
    source = ReplaySource.from_file(FIXTURE_LOG, clock=lambda: now[0], paused=True)
    source.seek(50)
    poll = source.poll()
    assert poll.events[-1].step == 50 and source.current_step == 50
    source.seek(10)
    poll = source.poll()
    assert poll.reset and poll.events[-1].step == 10
    source.toggle_pause()                     # play at 1x
    now[0] = 0.5
    played = source.poll().events
    assert played and all(e.t <= poll.events[-1].t + 0.5 for e in played)
    source.change_speed(True)
    assert source.speed == 2.0
    now[0] = 1000.0
    source.poll()
    assert source.at_end and source.paused
    assert source.set_knob("max_num_seqs", 3) and source.abort("r1")      # read-only: refused


def test_replay_hands_out_big_jumps_in_bounded_polls():
    source = replay(max_events_per_poll=50)
    source.seek(10**9)
    sizes = []
    while True:
        events = source.poll().events
        if not events:
            break
        sizes.append(len(events))
    assert max(sizes) == 50 and sum(sizes) == len(source.events)


def live_view(model: DashboardModel) -> dict:
    return {r.request_id: (r.state, r.slot, r.num_computed_tokens, r.num_output_tokens, r.num_blocks)
            for r in model.live.values()}


def folded_view(state: BatchState) -> dict:
    return {rid: (r.status, r.slot, r.num_computed_tokens, r.num_output_tokens, r.num_blocks)
            for rid, r in state.requests.items() if r.status != "padding"}


def test_the_model_holds_exact_tokens_and_blocks_per_request():
    _, events = read_log(FIXTURE_LOG)
    assert any(isinstance(e, PrefillChunk) and e.recompute for e in events), "the log has recomputes"
    model, state = fold([]), BatchState()
    for event in events:
        model.feed([event])
        state.feed([event])
        if type(event) is StepFinished:
            assert live_view(model) == folded_view(state), f"step {event.step}"


def test_a_snapshot_after_a_drop_resynchronises_the_model():
    _, events = read_log(FIXTURE_LOG)
    cut = next(i for i, e in enumerate(events) if type(e) is StepFinished and e.step == 40)
    truth = BatchState()
    truth.feed(events[:cut + 1])
    model = fold(events[:cut // 2])
    model.feed([EventsDropped(step=40, t=events[cut].t, count=cut - cut // 2)])
    reqs = list(truth.requests.items())
    model.feed([EngineSnapshot(
        step=40, t=events[cut].t, cause="drop", request_ids=tuple(rid for rid, _ in reqs),
        statuses=tuple(r.status for _, r in reqs), slots=tuple(r.slot for _, r in reqs),
        num_prompt_tokens=tuple(r.num_prompt_tokens for _, r in reqs),
        num_output_tokens=tuple(r.num_output_tokens for _, r in reqs),
        num_computed_tokens=tuple(r.num_computed_tokens for _, r in reqs),
        num_blocks=tuple(r.num_blocks for _, r in reqs), max_tokens=tuple(r.max_tokens for _, r in reqs),
        kv_blocks_used=sum(r.num_blocks for _, r in reqs), kv_blocks_total=24)])
    assert live_view(model) == folded_view(truth)
    for event in events[cut + 1:]:
        model.feed([event])
        truth.feed([event])
        if type(event) is StepFinished:
            assert live_view(model) == folded_view(truth), f"step {event.step}"
    assert "snapshot" in model.message or not model.live


def test_waiting_time_by_reason_and_the_admission_line():
    _, events = read_log(FIXTURE_LOG)
    model = fold([])
    seen_blocked = set()
    for event in events:
        model.feed([event])
        if type(event) is StepFinished and model.admission is not None:
            seen_blocked.add(model.admission.reason)
            assert model.num_waiting > 0
    assert {"max_num_seqs", "preemption"} <= seen_blocked
    admitted = [e for e in events if isinstance(e, RequestAdmitted)]
    for rid in {e.request_id for e in admitted}:
        req = model.request(rid)
        total = sum(s for e in admitted if e.request_id == rid for s in e.wait_s)
        assert sum(model.waited(req, events[-1].t).values()) == pytest.approx(total)


def test_the_engine_source_asks_for_a_snapshot_on_subscribe_and_after_a_drop():
    bus = EventBus()
    engine = Engine(EngineConfig(model="tiny", max_num_seqs=4, num_kv_blocks=64), sink=bus.publish)
    loop = EngineLoop(engine).start()
    try:
        for i in range(6):
            loop.add_request(list(range(100, 110 + i)), SamplingParams(max_tokens=400, ignore_eos=True))
        loop.call(lambda: None)
        loop.pause()
        src = EngineSource(loop, bus, subscription_maxlen=4)    # joins mid-run, with a tiny buffer
        loop.call(lambda: None)
        snapshots = [e for e in src.poll().events if isinstance(e, EngineSnapshot)]
        assert [s.cause for s in snapshots] == ["subscribe"]
        assert sorted(snapshots[0].statuses) == ["running"] * 4 + ["waiting"] * 2
        steps = loop.call(lambda: engine.step_count)
        for _ in range(5):
            loop.step_once()
        while loop.call(lambda: engine.step_count) < steps + 5:
            pass
        events = src.poll().events
        assert isinstance(events[0], EventsDropped)          # 5 steps overflow 4 slots
        loop.call(lambda: None)
        assert [e.cause for e in src.poll().events if isinstance(e, EngineSnapshot)] == ["drop"]
    finally:
        loop.stop()
