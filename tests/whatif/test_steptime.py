"""The step-time fit recovers a known law from a recording's own timings, picks its law by held-out error,
and flags steps beyond the recorded shapes; a what-if at the recorded knobs then reproduces the run."""
import pytest
from whatif_helpers import linear_law, synthetic_recording

from batchtop.engine.whatif.grid import predict, run_of
from batchtop.engine.whatif.replay import fit_steps, replay_identity
from batchtop.engine.whatif.steptime import fit_law
from batchtop.engine.whatif.virtual import StepShape


@pytest.fixture(scope="module")
def synthetic():
    return synthetic_recording(linear_law, num_requests=150, max_num_seqs=6)


def test_the_fit_recovers_a_known_law_within_two_percent(synthetic):
    identity = replay_identity(synthetic)
    assert identity.match_share == 1.0
    model = fit_steps(synthetic, identity)
    law = model.forward
    assert law.heldout_mape < 0.02
    coef = dict(zip(("intercept", *law.names), law.coef))
    for name, true in (("intercept", 2e-3), ("prefill_tokens", 30e-6), ("decode_rows", 400e-6),
                       ("context_tokens", 2e-6)):
        assert coef[name] == pytest.approx(true, rel=0.02), name
    for shape in identity.engine.shapes:
        assert model(shape).forward_s == pytest.approx(linear_law(shape).forward_s, rel=0.02)
    assert model.overhead["prepare_s"][1] == pytest.approx(1e-5, rel=0.02)


def test_the_gap_law_between_steps_is_recovered(synthetic):
    gap = fit_steps(synthetic, replay_identity(synthetic)).gap
    for fitted, true in zip(gap.coef, (150e-6, 250e-6, 60e-6)):
        assert fitted == pytest.approx(true, rel=0.02)


def test_the_law_is_chosen_by_held_out_error_not_by_its_size():
    shapes = [StepShape(r, 8 * r, r, 40 * r, 0) for r in range(1, 60)]
    times = [1e-3 + 50e-6 * s.prefill_tokens + 50e-6 * s.decode_rows for s in shapes]   # one token law
    law = fit_law(shapes, times)
    assert law.heldout_mape < 1e-6
    assert law.name in ("tokens", "prefill+decode")


def test_a_what_if_at_the_recorded_knobs_reproduces_the_run(synthetic):
    identity = replay_identity(synthetic)
    model = fit_steps(synthetic, identity)
    recorded = run_of("recorded", {}, synthetic.events).summary
    predicted = predict(synthetic, model, {}).summary
    assert predicted.num_steps == recorded.num_steps
    assert predicted.throughput_out_tok_s == pytest.approx(recorded.throughput_out_tok_s, rel=0.02)
    assert predicted.ttft.p50 == pytest.approx(recorded.ttft.p50, rel=0.02)


def test_steps_beyond_the_recorded_shapes_are_counted_as_extrapolated(synthetic):
    model = fit_steps(synthetic, replay_identity(synthetic))
    run = predict(synthetic, model, {"max_num_seqs": 24})
    assert run.extrapolation is not None and "extrapolated" in run.extrapolation
    assert "num_rows" in run.extrapolation or "decode_rows" in run.extrapolation
    assert predict(synthetic, model, {"max_num_seqs": 6}).extrapolation is None
