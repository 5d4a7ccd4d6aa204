"""The flight recorder's ring: bounded by steps and events, honest about what it lost, atomic dumps."""
from __future__ import annotations

import os

from batchtop.telemetry import flight
from batchtop.telemetry.events import EventsDropped, FirstToken, StepFinished, StepPlanned
from batchtop.telemetry.flight import FlightRecorder
from batchtop.telemetry.recorder import read_log


def steps(recorder, first: int, last: int, per_step: int = 3) -> None:
    for step in range(first, last + 1):
        for i in range(per_step - 1):
            recorder(FirstToken(step=step, t=step + i / 10, request_id=f"r{step}-{i}", ttft_s=0.1))
        recorder(StepFinished(step=step, t=step + 0.5, num_rows=1, num_tokens=1,
                              sampled_request_ids=(f"r{step}-0",), num_running=1, num_waiting=0,
                              kv_blocks_used=2, kv_blocks_total=10, schedule_s=0, prepare_s=0, forward_s=0,
                              sample_s=0, update_s=0))


def test_keeps_the_newest_steps_and_says_how_many_events_went():
    recorder = FlightRecorder(max_steps=4)
    steps(recorder, 1, 10)
    events = recorder.events()
    assert isinstance(events[0], EventsDropped) and events[0].count == 6 * 3
    assert events[0].step == 7
    assert sorted({e.step for e in events[1:]}) == [7, 8, 9, 10]
    assert recorder.num_events == 30


def test_event_cap_bounds_the_ring_whatever_the_steps():
    recorder = FlightRecorder(max_steps=1000, max_events=10)
    steps(recorder, 1, 100)
    events = recorder.events()
    assert len(events) <= 11 and events[0].count == 300 - (len(events) - 1)


def test_nothing_lost_no_notice():
    recorder = FlightRecorder(max_steps=10)
    steps(recorder, 1, 3)
    assert not any(isinstance(e, EventsDropped) for e in recorder.events())
    assert FlightRecorder().events() == []


def test_tee_forwards_every_event_and_keeps_it():
    seen = []
    recorder = FlightRecorder(max_steps=10)
    sink = recorder.tee(seen.append)
    event = StepPlanned(step=1, t=0.0, prefill_tokens=1, recompute_tokens=0, decode_tokens=0,
                        num_prefill_rows=1, num_recompute_rows=0, num_decode_rows=0, num_padding_rows=0,
                        token_budget=8, num_running=1, num_waiting=0, kv_blocks_used=1, kv_blocks_total=10)
    sink(event)
    assert seen == [event] and recorder.events() == [event] and recorder.num_events == 1
    alone = FlightRecorder()
    alone.tee(None)(event)
    assert alone.events() == [event] and alone.num_events == 1


def test_dump_writes_a_replayable_log_once_per_news(tmp_path, capsys):
    recorder = FlightRecorder(max_steps=2, directory=str(tmp_path),
                              header=lambda: {"model": "tiny", "knobs": {"max_num_seqs": 4},
                                              "layout": "condense"})
    steps(recorder, 1, 5)
    path = recorder.dump("test", "RuntimeError: boom")
    assert path and os.path.dirname(path) == str(tmp_path) and path.endswith("-step5.jsonl")
    assert path in capsys.readouterr().err
    header, events = read_log(path)
    assert header["model"] == "tiny"
    assert header["knobs"] == {"max_num_seqs": 4}
    assert header["layout"] == "condense"
    assert header["flight_recorder"] == {"reason": "test", "error": "RuntimeError: boom", "first_step": 4,
                                         "last_step": 5, "num_events": 7}
    assert events == recorder.events()
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".partial")]
    assert recorder.dump("again") is None                # nothing new since
    steps(recorder, 6, 6)
    assert recorder.dump("again") is not None


def test_dump_budget_and_unwritable_folder(tmp_path, capsys):
    recorder = FlightRecorder(max_steps=2, directory=str(tmp_path))
    for step in range(flight.MAX_DUMPS + 3):
        steps(recorder, step + 1, step + 1)
        recorder.dump("loop")
    assert len(os.listdir(tmp_path)) == len(recorder.paths) == flight.MAX_DUMPS
    blocked = tmp_path / "file"
    blocked.write_text("")
    stuck = FlightRecorder(directory=str(blocked / "sub"))
    steps(stuck, 1, 1)
    assert stuck.dump("x") is None
    assert "could not write" in capsys.readouterr().err


def test_dump_all_reaches_every_live_recorder(tmp_path, monkeypatch):
    monkeypatch.setenv(flight.DIR_ENV_VAR, str(tmp_path))
    first, second, quiet = FlightRecorder(), FlightRecorder(), FlightRecorder()
    steps(first, 1, 2)
    steps(second, 1, 3)
    paths = flight.dump_all("exit")
    assert len(first.paths) == len(second.paths) == 1 and not quiet.paths      # nothing to say: no file
    assert set(first.paths + second.paths) <= set(paths)     # (engines of other tests may be alive too)
