"""The what-if speed benchmark's arithmetic: the spread over repeats, the share of the recorded time, a
harness law priced over step shapes, a process's CPU time read from /proc."""
from __future__ import annotations

import os
import time

import pytest

from batchtop.engine.bench.whatif_speed import law_seconds, median_range, process_cpu_s, share_of
from batchtop.engine.whatif.virtual import StepShape


def test_median_range_is_the_median_and_the_range():
    assert median_range([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    assert median_range([1.0, 2.0]) == (1.5, 1.0, 2.0)


def test_the_share_is_of_the_recorded_wall_time():
    assert share_of([0.5, 1.0, 2.0], 100.0) == pytest.approx((0.01, 0.005, 0.02))


def test_a_law_prices_every_step_with_its_intercept():
    spec = {"law": {"prefill_tokens": 1e-3, "decode_rows": 2e-3, "num_rows": 0.0}, "intercept_s": 0.5}
    shapes = [StepShape(1, 10, 0, 1, 10, 100), StepShape(3, 0, 3, 3, 40, 0)]
    assert law_seconds(spec, shapes) == pytest.approx(0.5 + 0.010 + 0.5 + 0.006)
    assert law_seconds(spec, []) == 0.0


def test_process_cpu_time_grows_with_work():
    before = process_cpu_s(os.getpid())
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    assert process_cpu_s(os.getpid()) >= before + 0.02
