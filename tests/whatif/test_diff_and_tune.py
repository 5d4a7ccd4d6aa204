"""diff's decomposition adds up exactly per request (preempted and aborted ones too); tune picks what a
brute-force what-if grid shows best."""
import pytest
from whatif_helpers import linear_law, synthetic_recording

from batchtop.engine.whatif.diff import PARTS, diff_events
from batchtop.engine.whatif.grid import points, predict
from batchtop.engine.whatif.replay import fit_steps, replay_identity
from batchtop.engine.whatif.tune import meets, parse_knob_range, parse_slo, tune


@pytest.fixture(scope="module")
def small_pool():
    """A run whose pool is too small for its rows: preemptions, and aborts."""
    return synthetic_recording(linear_law, num_requests=100, num_kv_blocks=30, max_num_seqs=8,
                               abort_share=0.1)


def test_the_decomposition_adds_up_exactly_per_request(small_pool):
    model = fit_steps(small_pool, replay_identity(small_pool))
    other = predict(small_pool, model, {"max_num_seqs": 2, "max_num_batched_tokens": 32})
    result = diff_events(small_pool.events, other.events)
    assert result.matched_by == "by id"
    assert len(result.deltas) == len(small_pool.requests)
    assert all(d.residual == 0 for d in result.deltas)
    for d in result.deltas:
        assert d.delta["e2e"] == sum(d.delta[p] for p in PARTS)
    assert any(d.preempted[0] > 0 for d in result.deltas)            # preempted requests are in it
    assert any("abort" in d.reasons for d in result.deltas)          # and aborted ones
    assert result.first_divergence is not None
    summary = result.summary()
    assert summary["gained"] + summary["lost"] + summary["unchanged"] == len(result.deltas)


def test_a_run_against_itself_differs_nowhere(small_pool):
    result = diff_events(small_pool.events, small_pool.events)
    assert result.first_divergence is None
    assert all(v == 0 for d in result.deltas for v in d.delta.values() if v is not None)


def test_runs_matched_by_arrival_order_when_the_ids_differ(small_pool):
    renamed = [_renamed(e) for e in small_pool.events]
    result = diff_events(small_pool.events, renamed)
    assert result.matched_by == "by arrival order and prompt length"
    assert result.first_divergence is None and all(d.residual == 0 for d in result.deltas)


def test_different_traces_are_refused(small_pool):
    other = synthetic_recording(linear_law, num_requests=100, seed=5)
    with pytest.raises(ValueError, match="different traces"):
        diff_events(small_pool.events, other.events)


def _renamed(e):
    import dataclasses
    if hasattr(e, "request_id"):
        e = dataclasses.replace(e, request_id="x" + e.request_id)
    if hasattr(e, "sampled_request_ids"):
        e = dataclasses.replace(e, sampled_request_ids=tuple("x" + r for r in e.sampled_request_ids))
    if hasattr(e, "request_ids"):
        e = dataclasses.replace(e, request_ids=tuple("x" + r for r in e.request_ids))
    return e


def test_tune_picks_what_the_brute_force_grid_shows_best():
    rec = synthetic_recording(linear_law, num_requests=80, rate=60.0, max_num_seqs=4)
    slo = parse_slo(["ttft_p99=300ms"])
    grid = parse_knob_range(["max_num_seqs=1..12", "max_num_batched_tokens=32,64"], 32)
    assert grid["max_num_seqs"] == list(range(1, 13))
    result = tune(rec, grid, slo)
    model = fit_steps(rec, replay_identity(rec))
    brute = [predict(rec, model, changed) for changed in points(grid)]
    feasible = [run for run in brute if meets(run, slo)]
    assert feasible and len(feasible) < len(brute)          # the SLO rules some values out
    best = max(feasible, key=lambda run: run.summary.throughput_out_tok_s)
    assert result.best.knobs == best.knobs
    assert result.best.summary.throughput_out_tok_s == best.summary.throughput_out_tok_s


def test_tune_with_a_step_time_margin_picks_what_meets_the_slo_at_each_scale():
    """`--step-time 1,1.5`: the best value at 1x misses the SLO at 1.5x, so the pick is the best of those
    that meet it at both, as the brute-force grid at both scales shows."""
    rec = synthetic_recording(linear_law, num_requests=80, rate=60.0, max_num_seqs=4)
    grid = parse_knob_range(["max_num_seqs=1..8"], 32)
    model = fit_steps(rec, replay_identity(rec))
    at = {scale: [predict(rec, model, changed, step_scale=scale) for changed in points(grid)]
          for scale in (1.0, 1.5)}
    loose = parse_slo(["itl_p99=10ms"])              # more rows: more tok/s, and longer gaps between tokens
    best_at_1x = tune(rec, grid, loose).best
    i = next(i for i, run in enumerate(at[1.0]) if run.knobs == best_at_1x.knobs)
    bound = (at[1.0][i].summary.itl.p99 + at[1.5][i].summary.itl.p99) / 2     # met at 1x, missed at 1.5x
    slo = {"itl_p99": bound}
    result = tune(rec, grid, slo, (1.0, 1.5))
    robust = [one for one, slow in zip(at[1.0], at[1.5]) if meets(one, slo) and meets(slow, slo)]
    assert robust, "the margin leaves no value"
    best = max(robust, key=lambda run: run.summary.throughput_out_tok_s)
    assert result.best.knobs == best.knobs != best_at_1x.knobs and result.best.step_scale == 1.0
    assert len(result.runs) == 2 * len(at[1.0])


def test_a_range_past_sixty_four_values_is_a_geometric_grid():
    values = parse_knob_range(["max_num_seqs=1..256"], 256)["max_num_seqs"]
    assert values[0] == 1 and values[-1] == 256 and len(values) <= 64
