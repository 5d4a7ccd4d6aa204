"""Identity replay: a tiny-model recording re-scheduled by the same scheduler on the recorded step times
plans the recorded step at every step, under chunked prefill, both preemption modes, aborts, priority,
static batching and live knob changes."""
from batchtop.engine.whatif.grid import format_table, whatif
from batchtop.engine.whatif.recording import recording_from
from batchtop.engine.whatif.replay import replay_identity, signatures
from batchtop.telemetry import events as ev


def test_identity_replay_plans_every_recorded_step(recording):
    kinds = {type(e) for e in recording.events}
    assert {ev.RequestPreempted, ev.RequestRetracted, ev.PaddingReleased, ev.KnobChanged} <= kinds
    assert any(isinstance(e, ev.PrefillChunk) and e.num_computed_tokens < e.num_known_tokens
               for e in recording.events)
    assert {r.reason for r in recording.requests} >= {"abort", "length"}
    assert len({r.priority for r in recording.requests}) > 1
    identity = replay_identity(recording)
    assert identity.num_steps >= 120
    assert identity.first_mismatch is None
    assert identity.match_share == 1.0
    assert signatures(identity.events) == signatures(recording.events)


def test_a_different_knob_changes_the_schedule_and_the_comparison_sees_it(recording):
    changed = [e for e in recording.events if not isinstance(e, ev.KnobChanged)]
    rec = type(recording)(recording.path, recording.header, changed, recording.t0, recording.requests,
                          recording.setup, [])
    identity = replay_identity(rec)
    assert identity.first_mismatch is not None and identity.match_share < 1.0


def test_a_recording_joined_mid_run_names_the_requests_in_flight_at_its_start(recording):
    """A recorder that joins a busy engine holds no arrival for the requests already running or waiting:
    they are named, counted in the what-if's output, and a whole recording has none."""
    join = 40
    arrived_before = {e.request_id for e in recording.events
                      if isinstance(e, ev.RequestArrived) and e.step < join}
    joined = [e for e in recording.events if e.step >= join]
    named_after = {e.request_id for e in joined if hasattr(e, "request_id")}
    rec = recording_from(recording.header, joined)
    assert set(rec.in_flight) == arrived_before & named_after and len(rec.in_flight) >= 3
    assert not set(rec.in_flight) & {r.request_id for r in rec.requests}
    assert recording.in_flight == ()
    table = format_table(whatif(rec, {}))
    assert f"{len(rec.in_flight)} requests were in flight when the recording began" in table
    assert whatif(recording, {}).to_dict()["in_flight_at_start"] == 0
