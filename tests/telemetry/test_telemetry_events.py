import json
import math

import pytest
from telemetry_samples import one_of_each

from batchtop.telemetry.events import EVENT_TYPES, StepFinished, event_from_dict
from batchtop.telemetry.recorder import decode_event, encode_event


def test_samples_cover_every_kind():
    assert {type(e).__name__ for e in one_of_each()} == set(EVENT_TYPES)


@pytest.mark.parametrize("event", one_of_each(), ids=lambda e: type(e).__name__)
def test_round_trip_through_json(event):
    text = json.dumps(event.to_dict())
    back = event_from_dict(json.loads(text))
    assert back == event
    assert type(back) is type(event)
    assert back.to_dict() == event.to_dict()


def test_tuple_field_comes_back_as_tuple():
    e = StepFinished(step=1, t=0.5, num_rows=2, num_tokens=2, sampled_request_ids=("a", "b"), num_running=2,
                     num_waiting=0, kv_blocks_used=1, kv_blocks_total=8, schedule_s=0.0,
                     prepare_s=0.0, forward_s=0.0, sample_s=0.0, update_s=0.0)
    back = event_from_dict(json.loads(json.dumps(e.to_dict())))
    assert back.sampled_request_ids == ("a", "b")
    hash(back)      # still a frozen, hashable record


def test_float_times_survive_exactly():
    e = StepFinished(step=1, t=math.pi * 1e5, num_rows=0, num_tokens=0, sampled_request_ids=(), num_running=0,
                     num_waiting=0, kv_blocks_used=0, kv_blocks_total=0, schedule_s=1 / 3, prepare_s=0.1,
                     forward_s=0.2, sample_s=0.3, update_s=1e-9)
    assert event_from_dict(json.loads(json.dumps(e.to_dict()))) == e


def test_unknown_kind_and_missing_field_raise():
    with pytest.raises(ValueError, match="unknown event kind"):
        event_from_dict({"kind": "Nope", "step": 0, "t": 0.0})
    with pytest.raises(ValueError, match="lacks field"):
        event_from_dict({"kind": "EventsDropped", "step": 0, "t": 0.0})


@pytest.mark.parametrize("event", one_of_each(), ids=lambda e: type(e).__name__)
def test_wire_format_round_trip(event):
    line = encode_event(event)
    assert "\n" not in line and line.isascii()
    assert decode_event(line) == event
    assert decode_event(line.encode()) == event


def test_decode_event_rejects_non_objects():
    with pytest.raises(ValueError, match="JSON object"):
        decode_event("[1, 2]")
    with pytest.raises(ValueError):
        decode_event('{"kind": "EnginePaused", "step": 1')
