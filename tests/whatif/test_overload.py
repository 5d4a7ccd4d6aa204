"""Under overload (a queue that grows through the run) a what-if at the recorded knobs keeps the recorded
TTFT: on a synthetic recording whose machine was twice as slow for a stretch (the fit finds the stretch
where it was, not spread over the run), and on the seeded tiny-model recording."""
import dataclasses
import random
import statistics

import pytest
from whatif_helpers import linear_law, synthetic_recording

from batchtop.engine.whatif.grid import predict, run_of
from batchtop.engine.whatif.replay import fit_steps, replay_identity
from batchtop.telemetry import events as ev


def slowed_stretch(shape):
    """linear_law, its forward twice as slow between 1 and 2 s."""
    phases = linear_law(shape)
    slowed = 2.0 if 1.0 <= shape.start_s < 2.0 else 1.0
    return dataclasses.replace(phases, forward_s=phases.forward_s * slowed)


def max_waiting(rec) -> int:
    return max(e.num_waiting for e in rec.events if isinstance(e, ev.StepFinished))


def test_a_slow_stretch_stays_where_it_was_and_the_overload_replay_keeps_the_ttft():
    rec = synthetic_recording(slowed_stretch, num_requests=150, rate=60.0, max_num_seqs=2, abort_share=0.0)
    assert max_waiting(rec) >= 30
    model = fit_steps(rec, replay_identity(rec))
    rng = random.Random(0)
    assert model.slowdown.draw(rng, 2, 0.5) == pytest.approx(1.0, rel=0.05)
    assert model.slowdown.draw(rng, 2, 1.5) == pytest.approx(2.0, rel=0.05)
    recorded = run_of("recorded", {}, rec.events).summary
    predicted = predict(rec, model, {}).summary
    assert predicted.ttft.p50 == pytest.approx(recorded.ttft.p50, rel=0.05)
    assert predicted.ttft.p99 == pytest.approx(recorded.ttft.p99, rel=0.05)
    assert predicted.throughput_out_tok_s == pytest.approx(recorded.throughput_out_tok_s, rel=0.02)


def test_the_overload_replay_of_the_tiny_recording_keeps_its_ttft(recording):
    """Measured steps on a shared machine (priority, a static stretch, knob changes): the median over five
    seeded draws within a factor of 2 (TTFT p50; +74% seen with the machine's load average at 10) and
    throughput within 15%."""
    assert max_waiting(recording) >= 20
    model = fit_steps(recording, replay_identity(recording))
    recorded = run_of("recorded", {}, recording.events).summary
    runs = [predict(recording, dataclasses.replace(model, seed=seed), {}).summary for seed in range(5)]
    assert statistics.median(r.ttft.p50 for r in runs) == pytest.approx(recorded.ttft.p50, rel=1.0)
    assert statistics.median(r.throughput_out_tok_s for r in runs) == pytest.approx(
        recorded.throughput_out_tok_s, rel=0.15)
