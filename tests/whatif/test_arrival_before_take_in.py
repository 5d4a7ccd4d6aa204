"""A server receives a request while a step runs and the engine takes it in at the next step boundary:
RequestArrived says how long after the arrival (`since_arrival_s`), TTFT counts from the arrival, and a
recording's trace, its identity replay, a what-if and `diff` all count from the arrival too."""
from __future__ import annotations

import time
from dataclasses import replace

import pytest

from batchtop.engine.core.config import EngineConfig
from batchtop.engine.core.engine import Engine
from batchtop.engine.core.sampling import SamplingParams
from batchtop.engine.whatif.diff import timelines
from batchtop.engine.whatif.recording import engine_header, recording_from
from batchtop.engine.whatif.replay import constant_steps, replay_identity, run_whatif
from batchtop.telemetry import events as ev
from batchtop.telemetry.recorder import decode_event, encode_event, make_header

RECEIVED_EARLY_S = 0.03        # how long before the take-in the request arrived


@pytest.fixture(scope="module")
def recording(tiny):
    events: list = []
    config = EngineConfig(model="tiny", num_kv_blocks=32, block_size=4, max_model_len=64,
                          flight_recorder_steps=0, enable_prefix_caching=False)
    engine = Engine(config, sink=events.append, loaded=tiny)
    header = make_header("tiny", engine.knobs(),
                         engine=engine_header(engine))
    engine.add_request([7] * 6, SamplingParams(max_tokens=6, ignore_eos=True), request_id="early")
    engine.step()
    late = engine.make_request([9] * 5, SamplingParams(max_tokens=4, ignore_eos=True), request_id="late")
    time.sleep(RECEIVED_EARLY_S)         # received while a step ran; taken in at the next boundary
    engine.enqueue(late)
    while engine.has_unfinished():
        engine.step()
    return recording_from(header, events)


def _of(events, kind, request_id):
    return next(e for e in events if isinstance(e, kind) and e.request_id == request_id)


def test_the_event_says_how_long_after_its_arrival_the_engine_took_it_in(recording):
    arrived = _of(recording.events, ev.RequestArrived, "late")
    assert RECEIVED_EARLY_S <= arrived.since_arrival_s < RECEIVED_EARLY_S + 0.5
    first = _of(recording.events, ev.FirstToken, "late")
    assert first.ttft_s == pytest.approx(first.t - arrived.arrival_t, abs=2e-3)   # TTFT from the arrival
    assert first.ttft_s > first.t - arrived.t + RECEIVED_EARLY_S / 2
    # the trace and `diff` count from the arrival: diff's TTFT is the engine's own
    [late] = [r for r in recording.requests if r.request_id == "late"]
    assert late.arrival_s == pytest.approx(arrived.arrival_t - recording.t0)
    assert timelines(recording.events)["late"].split()["ttft"] / 1e9 == pytest.approx(first.ttft_s, abs=2e-3)
    # the field survives the log, and a version-3 log (no such field) reads as taken in on arrival
    assert decode_event(encode_event(arrived)).since_arrival_s == arrived.since_arrival_s
    old = encode_event(arrived).replace(f',"since_arrival_s":{arrived.since_arrival_s!r}', "")
    assert "since_arrival_s" not in old and decode_event(old, schema_version=3).since_arrival_s == 0.0


def test_the_replays_take_it_in_at_a_boundary_and_count_its_ttft_from_the_arrival(recording):
    identity = replay_identity(recording)
    assert identity.num_matching == identity.num_steps > 0
    replayed = _of(identity.events, ev.RequestArrived, "late")
    assert replayed.since_arrival_s == pytest.approx(_of(recording.events, ev.RequestArrived, "late")
                                                     .since_arrival_s, abs=1e-9)
    step_s = 0.01
    _, events = run_whatif(recording, {}, constant_steps(step_s))
    arrived, first = _of(events, ev.RequestArrived, "late"), _of(events, ev.FirstToken, "late")
    [late] = [r for r in recording.requests if r.request_id == "late"]
    assert arrived.arrival_t == pytest.approx(late.arrival_s) and arrived.t >= late.arrival_s
    assert arrived.since_arrival_s < step_s + 1e-9         # taken in at the first boundary after it
    assert first.ttft_s == pytest.approx(first.t - late.arrival_s)


def test_a_what_if_takes_a_request_in_after_its_recorded_input_path(recording):
    """A server's request reaches the engine its input path (RequestArrived.input_s) after its arrival: a
    what-if takes it in no earlier than that, and still counts its TTFT from the arrival."""
    input_s, step_s = 0.25, 0.01
    late = next(e for e in recording.events if isinstance(e, ev.RequestArrived) and e.request_id == "late")
    served = [replace(e, input_s=input_s) if e is late else e for e in recording.events]
    again = recording_from(recording.header, [decode_event(encode_event(e)) for e in served])
    [item] = [r for r in again.requests if r.request_id == "late"]
    assert item.input_s == input_s and item.entry_s == pytest.approx(item.arrival_s + input_s)
    _, events = run_whatif(again, {}, constant_steps(step_s))
    arrived, first = _of(events, ev.RequestArrived, "late"), _of(events, ev.FirstToken, "late")
    assert item.entry_s <= arrived.t < item.entry_s + step_s + 1e-9       # the first boundary after its entry
    assert arrived.input_s == input_s and arrived.arrival_t == pytest.approx(item.arrival_s)
    assert first.ttft_s == pytest.approx(first.t - item.arrival_s) and first.ttft_s > input_s
    _, without = run_whatif(recording, {}, constant_steps(step_s))
    assert _of(without, ev.RequestArrived, "late").t < item.entry_s - step_s    # the input path made the wait
    # a version-4 log (no input_s) reads as a request handed to the engine on arrival
    old = encode_event(arrived).replace(f',"input_s":{input_s!r}', "")
    assert "input_s" not in old and decode_event(old, schema_version=4).input_s == 0.0
