"""The step-time fit recovers a known law from a recording's own timings, picks its law by held-out error,
and flags steps beyond the recorded shapes; a what-if at the recorded knobs then reproduces the run."""
import dataclasses
import math
import random

import pytest
from whatif_helpers import linear_law, synthetic_recording

from batchtop.engine.whatif.grid import predict, run_of
from batchtop.engine.whatif.replay import fit_steps, replay_identity
from batchtop.engine.whatif.steptime import (
    LAWS,
    PRODUCTS,
    ROWS_MIN_PARTS,
    ROWS_PRIOR_STEPS,
    RUN_PARTS,
    fit_law,
    fit_slowdown,
    parts_per_rows,
    tiled,
)
from batchtop.engine.whatif.virtual import StepShape
from batchtop.kernels import cpu
from batchtop.telemetry.weights import weight_macs


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
    shapes = [StepShape(r, 8 * r, r, r, 40 * r, 0) for r in range(1, 60)]
    times = [1e-3 + 50e-6 * s.prefill_tokens + 50e-6 * s.decode_rows for s in shapes]   # one token law
    law = fit_law(shapes, times)
    assert law.heldout_mape < 1e-6
    assert law.name in ("tokens", "prefill+decode")


def test_a_cost_concave_in_rows_is_fitted_by_a_log_law_that_extrapolates():
    """Decode steps of 1 to 4 rows whose cost is concave in the rows (as a CPU's matmul: 5.1, 6.7, 7.8 ms
    at 1, 2, 4 rows): a log law wins by held-out error (by more than its standard error) and prices 8 rows
    near the truth, where the best linear law, its slope set by 1 to 4 rows, overshoots by more than 15%."""
    def truth(rows):
        return 4e-3 + 1.2e-3 * math.log2(1 + rows)
    shapes = [StepShape(r, 0, r, r, 60 * r, 0) for r in (1, 2, 3, 4) for _ in range(30)]
    noise = random.Random(0)        # +-2% per step (a pattern that repeated with the folds would give
    times = [truth(s.decode_rows) * (1 + noise.uniform(-0.02, 0.02)) for s in shapes]   # each its own offset)
    law = fit_law(shapes, times)
    assert "log-decode" in law.name
    eight = StepShape(8, 0, 8, 8, 480, 0)
    assert law.predict(eight) == pytest.approx(truth(8), rel=0.05)
    linear = fit_law(shapes, times, {name: names for name, names in LAWS.items() if "log" not in name})
    assert linear.predict(eight) > 1.15 * truth(8)


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


def test_steps_at_a_row_count_the_recording_ran_a_handful_of_times_are_flagged(synthetic):
    """Every row count of the run at max_num_seqs=6 was recorded often enough to be timed; one recorded
    fewer than ROWS_PRIOR_STEPS times is named with its count, and its factor stays near the law's 1."""
    model = fit_steps(synthetic, replay_identity(synthetic))
    assert all(n >= ROWS_PRIOR_STEPS for rows, n in model.rows_recorded.items() if rows >= 2)
    assert all(model.rows_parts[rows] >= ROWS_MIN_PARTS for rows in model.rows_recorded if rows >= 2)
    rare = dataclasses.replace(model, rows_recorded={**model.rows_recorded, 2: 3}).fresh()
    run = predict(synthetic, rare, {"max_num_seqs": 2})
    assert run.extrapolation is not None
    assert "row counts the recording ran fewer than 20 times or in fewer than 3 of 20 equal parts" \
        in run.extrapolation
    assert f"(2 rows: 3 recorded, in {model.rows_parts[2]} of 20)" in run.extrapolation
    assert "beyond the recorded shapes" not in run.extrapolation
    # 60 steps of 4 rows as the law says, 3 of 2 rows twice as slow: their factor stays near 1
    shapes = [StepShape(2 if i % 20 == 10 else 4, 0, 4, 4, 40, 0, i * 0.01) for i in range(60)]
    measured = [(2.0 if s.num_rows == 2 else 1.0) * model.forward.predict(s) for s in shapes]
    assert 1.0 < fit_slowdown(shapes, measured, model.forward).by_rows[2] < 1.2


def test_a_row_count_the_recording_ran_only_as_its_queue_drained_is_flagged(synthetic):
    """A recording at 4 rows under a queue runs 2 rows only as it drains: 25 steps of 2 rows, more than
    ROWS_PRIOR_STEPS but all in the last half second (one moment's load), flag a what-if at 2 rows."""
    shapes = [StepShape(4, 0, 4, 4, 40, 0, i * 0.02) for i in range(400)]
    shapes += [StepShape(2, 0, 2, 2, 20, 0, 8.0 + i * 0.02) for i in range(25)]
    parts = parts_per_rows(shapes)
    assert parts[4] >= RUN_PARTS - 1 and parts[2] < ROWS_MIN_PARTS
    model = fit_steps(synthetic, replay_identity(synthetic))
    drained = dataclasses.replace(model, rows_parts={**model.rows_parts, 2: parts[2]}).fresh()
    run = predict(synthetic, drained, {"max_num_seqs": 2})
    assert run.extrapolation is not None
    assert f"(2 rows: {model.rows_recorded[2]} recorded, in {parts[2]} of 20)" in run.extrapolation
    assert predict(synthetic, model.fresh(), {"max_num_seqs": 2}).extrapolation is None


def four_row_steps(forward_ms, seed: int, noise: float = 0.1, shortest_prompt: int = 8):
    """A recording at 4 rows: one step in ten a prompt of `shortest_prompt` to 60 tokens beside 0 to 3
    decode rows, the rest decode steps of 4 rows (one in ten of 1 to 3); each step's forward time
    `forward_ms(shape)`, +-`noise`. Its shapes and times."""
    rng = random.Random(seed)
    shapes, times = [], []
    for _ in range(600):
        if rng.random() < 0.1:
            prompt, decode = rng.randint(shortest_prompt, 60), rng.randint(0, 3)
            shape = StepShape(decode + 1, prompt, decode, decode + 1, 200, prompt * prompt // 2)
        else:
            rows = 4 if rng.random() < 0.9 else rng.randint(1, 3)
            shape = StepShape(rows, 0, rows, rows, 100 * rows, 0)
        shapes.append(shape)
        times.append(forward_ms(shape) * 1e-3 * (1 + rng.uniform(-noise, noise)))
    return shapes, times


def test_of_laws_the_recording_cannot_tell_apart_the_simplest_is_chosen():
    """A recording at 4 rows on a CPU whose products are compute-bound: prefill steps cost 10 ms + 2.2 ms a
    token, decode steps 13, 15, 17.5 and 19.5 ms at 1 to 4 rows (mostly 4), +-15% noise. Every law fits
    them within a standard error of the lowest held-out error, which is not the one-feature law's; that
    law ("tokens") is chosen, and prices a 16-row decode step as the products do (45 ms)."""
    decode_ms = {1: 13.0, 2: 15.0, 3: 17.5, 4: 19.5}
    shapes, times = four_row_steps(lambda shape: 10 + 2.2 * (shape.prefill_tokens + shape.decode_rows)
                                   if shape.prefill_tokens else decode_ms[shape.num_rows], seed=3, noise=0.15)
    law = fit_law(shapes, times)                  # no weight_macs: the laws without PRODUCTS
    lowest = min((fit_law(shapes, times, {name: names}) for name, names in LAWS.items()
                  if PRODUCTS not in names), key=lambda fitted: fitted.heldout_mape)
    assert law.name == "tokens" and lowest.name != "tokens" and lowest.heldout_mape < law.heldout_mape
    sixteen = StepShape(16, 0, 16, 16, 1600, 0)
    assert law.predict(sixteen) == pytest.approx(10e-3 + 16 * 2.2e-3, rel=0.1)


def test_a_head_row_priced_at_the_model_s_head_share_extrapolates_to_more_rows():
    """A recording at 4 rows of a model whose LM head is 0.27 of a token's products through the layers
    (SmolLM2-135M's shapes): a prompt token costs 1.75 ms, a sampled row 1.75 + 0.47 ms, plus 10 ms a step.
    Its steps have 1 to 4 head rows, so no law with a free price per head row can measure that
    price; "products" takes it from the model and prices a 16-row decode step within 3%, where "tokens"
    (one price for a prompt token and a decode row) falls more than 10% short."""
    per_token, per_head_row = 106_168_320, 28_311_552
    shapes, times = four_row_steps(lambda shape: 10 + 1.75 * (shape.prefill_tokens + shape.decode_rows)
                                   + 1.75 * per_head_row / per_token * shape.head_rows, seed=5)
    law = fit_law(shapes, times, weight_macs=(per_token, per_head_row))
    assert law.name == "products" and law.names == ("num_tokens", "head_rows")
    assert law.coef[2] == pytest.approx(law.coef[1] * per_head_row / per_token)
    sixteen = StepShape(16, 0, 16, 16, 1600, 0)
    truth = (10 + 16 * 1.75 * (1 + per_head_row / per_token)) * 1e-3
    assert law.predict(sixteen) == pytest.approx(truth, rel=0.03)
    assert fit_law(shapes, times, {"tokens": LAWS["tokens"]}).predict(sixteen) < 0.9 * truth


@pytest.mark.parametrize("per_tile_ms, per_row_ms", [(1.75, 0.0), (1.0, 0.75)])
def test_products_priced_per_tile_and_per_row_follow_the_tiles_staircase(per_tile_ms, per_row_ms):
    """A recording at 4 rows of an engine whose products run in tiles of 4 rows: a tile costs its pass
    over the weights whatever rows it holds, and each of its rows its multiply-adds (this AVX2 host's
    kernels, SmolLM2's products alone: 8.2, 9.6, 12.0, 14.0 ms at 1 to 4 rows, 19.7 at 5); here 4 ms +
    `per_tile_ms` a tile's token (0.27 of it a tile's head row) + `per_row_ms` a token (and its head row),
    a tile with no price per row too. The recording's prompt steps show the staircase, so the law priced
    per tile and per row wins on held-out error and prices decode steps of 1 to 32 rows within 3%;
    fitted on rows as they are, "products" prices a step one row into a new tile (5, 9, 13 rows) more
    than 10% short."""
    per_token, per_head_row = 106_168_320, 28_311_552
    share = per_head_row / per_token

    def forward_ms(shape):
        tokens, head_rows = shape.prefill_tokens + shape.decode_rows, shape.head_rows
        return (4 + per_tile_ms * (tiled(tokens, 4) + share * tiled(head_rows, 4))
                + per_row_ms * (tokens + share * head_rows))

    shapes, times = four_row_steps(forward_ms, seed=7, shortest_prompt=5)
    law = fit_law(shapes, times, weight_macs=(per_token, per_head_row), tile_rows=4)
    plain = fit_law(shapes, times, {"products": LAWS["products"]}, weight_macs=(per_token, per_head_row))
    assert (law.name, law.tile_rows) == ("products per tile of 4 and per row", 4)
    assert law.names == ("num_tokens_in_tiles", "head_rows_in_tiles", "num_tokens", "head_rows")
    assert law.heldout_mape < plain.heldout_mape
    for rows in (1, 2, 3, 5, 8, 9, 13, 16, 32):
        decode = StepShape(rows, 0, rows, rows, 100 * rows, 0)
        assert law.predict(decode) == pytest.approx(forward_ms(decode) * 1e-3, rel=0.03), rows
        if rows in (5, 9, 13):
            assert plain.predict(decode) < 0.9 * forward_ms(decode) * 1e-3, rows
    assert "us x num_tokens in tiles of 4" in law.describe()


def test_a_recording_names_its_model_s_weight_products_and_each_step_its_head_rows(recording, tiny):
    """The header's engine entry carries the tiny model's multiply-adds (73,728 a token through its layers,
    3,145,728 a sampled row through its head); each replayed step counts the rows that sampled, which are
    the recorded step's sampled requests; the fit then weighs "products" among its laws."""
    assert recording.setup.weight_macs == weight_macs(tiny.model.config) == (73_728, 3_145_728)
    assert recording.setup.to_dict()["weight_macs"] == [73_728, 3_145_728]
    # and, where the engine's products run on the packed kernels, the rows of their tiles
    tile_rows = cpu.product_tile_rows() if cpu.products_pay() else None
    assert recording.setup.product_tile_rows == tile_rows
    assert recording.setup.to_dict().get("product_tile_rows") == tile_rows
    identity = replay_identity(recording)
    sampled = {e.step: len(e.sampled_request_ids) for e in recording.steps}
    steps = [e.step for e in recording.steps]
    shapes = identity.engine.shapes
    assert len(shapes) == len(steps) and any(s.prefill_tokens and s.head_rows < s.num_rows for s in shapes)
    assert [s.head_rows for s in shapes] == [sampled[step] for step in steps]
    with_products = fit_law(shapes, [e.forward_s for e in recording.steps], {"products": LAWS["products"]},
                            weight_macs=recording.setup.weight_macs)
    assert with_products.names == ("num_tokens", "head_rows")
    assert with_products.coef[2] == pytest.approx(with_products.coef[1] * 3_145_728 / 73_728)
