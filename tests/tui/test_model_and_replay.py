"""The view model folded from the fixture log, and replay navigation (no UI)."""
from __future__ import annotations

from batchtop.telemetry.events import (
    KnobChanged, RequestAdmitted, RequestArrived, RequestRetired, RowMoved, StepFinished, StepPlanned,
)
from batchtop.telemetry.recorder import read_log
from batchtop.tui.model import DashboardModel
from batchtop.tui.sources import ReplaySource

from tui_helpers import FIXTURE_LOG


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
    model.feed([RequestArrived(1, 0.0, "a", 10, 5, 0), RequestArrived(1, 0.0, "b", 10, 5, 0),
                RequestAdmitted(1, 0.1, "a", 0, 0, False), RequestAdmitted(1, 0.1, "b", 1, 0, False),
                StepFinished(1, 0.2, 2, 20, ("a", "b"), 2, 0, 2, 10, 0, 0, 0, 0, 0)])
    assert [model.slot_kind(i)[0] for i in range(4)] == ["admitted", "admitted", "free", "free"]
    model.feed([StepFinished(2, 0.3, 2, 2, ("a", "b"), 2, 0, 2, 10, 0, 0, 0, 0, 0)])
    assert [model.slot_kind(i)[0] for i in range(3)] == ["decode", "decode", "free"]
    model.feed([RequestRetired(2, 0.35, "a", "stop", 0, 10, 2)])
    assert model.slot_kind(0)[0] == "hole"
    model.feed([RowMoved(3, 0.4, "b", 1, 0, 128), StepPlanned(3, 0.4, 0, 1, 0, 1, 0, 64, 1, 0, 1, 10)])
    assert model.slot_kind(0) == ("moved", "b") and model.slot_kind(1)[0] == "free"
    assert model.live["b"].slot == 0


def test_knob_changes_update_knobs_and_marks():
    model = DashboardModel(knobs={"max_num_seqs": 8})
    model.feed([KnobChanged(5, 1.0, "max_num_seqs", 8, 16, "tui")])
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
