"""whatif_sensitivity's ratio past the recorded rows: the law's own error where a what-if extrapolates it,
read from a real run's steps wider than any the recording ran."""
import dataclasses

import pytest
from whatif_helpers import linear_law, synthetic_recording

from batchtop.engine.bench.whatif_sensitivity import batchtop_steps, beyond_ratio, decode_ratios
from batchtop.engine.whatif.grid import prepare
from batchtop.engine.whatif.replay import replay_identity


def slower_past_four_rows(shape):
    """linear_law, its forward 1.25x on steps of more than 4 rows (a machine whose wider steps cost more
    than a 4-row recording shows)."""
    phases = linear_law(shape)
    return dataclasses.replace(phases, forward_s=phases.forward_s * (1.25 if shape.num_rows > 4 else 1.0))


def test_the_ratio_past_the_recorded_rows_is_the_law_s_error_on_the_wider_steps_alone():
    recorded = synthetic_recording(linear_law, num_requests=150, max_num_seqs=4)
    _, model = prepare(recorded)
    assert model.seen["num_rows"] == 4
    wider = synthetic_recording(slower_past_four_rows, num_requests=150, max_num_seqs=12, rate=40.0)
    steps = batchtop_steps(wider, replay_identity(wider))
    decode_rows = [s.num_rows for s, _ in steps if not s.prefill_tokens]
    # wider decode steps ran, and more narrower ones (at the law's own time), left out
    assert 0 < sum(rows > 4 for rows in decode_rows) < sum(rows <= 4 for rows in decode_rows)
    assert beyond_ratio(decode_ratios(steps, model), 4) == pytest.approx(1.25, rel=0.03)
    same = synthetic_recording(slower_past_four_rows, num_requests=150, max_num_seqs=4)
    same_ratios = decode_ratios(batchtop_steps(same, replay_identity(same)), model)
    assert beyond_ratio(same_ratios, 4) is None                             # none wider: no ratio
