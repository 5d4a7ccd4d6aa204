import pytest

from batchtop.telemetry.events import (
    EventsDropped, FirstToken, PrefillChunk, RequestArrived, RequestPreempted, RequestRetired,
    RequestRetracted, StepFinished,
)
from batchtop.telemetry.metrics import Distribution, Metrics, percentile, summarize
from batchtop.telemetry.rates import WindowedRates
from telemetry_samples import STATIC_LENGTHS, static_batch

approx = pytest.approx


def step(k, t, sampled, num_rows=2, num_tokens=10):
    return StepFinished(k, t, num_rows, num_tokens, tuple(sampled), 0, 0, 0, 0, 0, 0, 0, 0, 0)


def small_run():
    """Four requests over five steps; every expected figure is worked out by hand in the tests."""
    return [
        RequestArrived(0, 0.0, "a", 10, 3, 0),
        RequestArrived(0, 1.0, "b", 20, 3, 0),
        RequestArrived(0, 1.0, "c", 30, 3, 0),
        step(1, 1.0, ["a"]), FirstToken(1, 1.0, "a", 1.0),
        step(2, 1.5, ["a", "b"]), FirstToken(2, 1.5, "b", 0.5),
        RequestPreempted(3, 2.0, "b", 0, 1, 21, "kv pool dry"),
        step(3, 2.5, ["a"]), RequestRetired(3, 2.5, "a", "stop", 0, 10, 3),
        RequestArrived(3, 2.5, "d", 40, 3, 0),
        RequestRetracted(4, 3.0, "c", 1, 1, 5, 0.5),
        step(4, 4.0, ["b", "c"]), FirstToken(4, 4.0, "c", 3.0),
        RequestRetired(4, 4.0, "c", "stop", 1, 30, 1),
        step(5, 4.5, ["b", "d"]), FirstToken(5, 4.5, "d", 2.0),
        RequestRetired(5, 4.5, "b", "length", 0, 20, 3),
    ]


def test_static_batch_utilisation_from_the_reference():
    s = summarize(static_batch())
    assert s.num_steps == 1024
    assert s.row_steps_total == 8192
    assert s.row_steps_useful == sum(STATIC_LENGTHS) == 1968
    assert round(s.batch_utilisation, 3) == 0.240
    assert s.num_output_tokens == 1968
    assert s.finished_by_reason == {"length": 8}
    assert s.ttft.p50 == approx(0.01)
    assert s.tpot.mean == approx(0.01) and s.itl.max == approx(0.01)


def test_latency_percentiles_on_a_known_case():
    s = summarize(small_run())
    # TTFT samples 1.0, 0.5, 3.0, 2.0
    assert s.ttft == Distribution(4, approx(1.625), approx(1.5), approx(2.7), approx(2.97), 0.5, 3.0)
    # TPOT: a (2.5 - 1.0)/2 = 0.75, b (4.5 - 1.5)/2 = 1.5; c has one token, d is unfinished
    assert s.tpot.count == 2
    assert (s.tpot.p50, s.tpot.p90, s.tpot.p99) == (approx(1.125), approx(1.425), approx(1.4925))
    # ITL: a 0.5, 1.0; b 2.5, 0.5 (the preemption wait is part of the gap)
    assert s.itl.count == 4
    assert (s.itl.mean, s.itl.p50, s.itl.p90, s.itl.p99) == (
        approx(1.125), approx(0.75), approx(2.05), approx(2.455))
    assert sorted([2.5, 3.5, 3.0]) == [s.e2e.min, s.e2e.p50, s.e2e.max]


def test_counts_throughput_and_recompute_tax():
    s = summarize(small_run())
    assert s.span_s == 4.5
    assert s.num_steps == 5
    assert (s.row_steps_total, s.row_steps_useful) == (10, 8)
    assert s.batch_utilisation == 0.8
    assert s.num_prompt_tokens == 100
    assert s.throughput_in_tok_s == approx(100 / 4.5)
    assert s.throughput_out_tok_s == approx(8 / 4.5)
    assert (s.num_preemptions, s.num_retractions) == (1, 1)
    assert (s.tokens_recomputed, s.tokens_computed) == (26, 50)
    assert s.recompute_tax == approx(0.52)
    assert s.finished_by_reason == {"stop": 2, "length": 1}
    assert (s.num_arrived, s.num_finished) == (4, 3)
    assert s.num_events_dropped == 0


def test_prompt_tokens_fall_back_to_retired_when_arrival_unseen():
    s = summarize([FirstToken(1, 1.0, "x", 0.1), RequestRetired(2, 2.0, "x", "stop", 0, 7, 2),
                   RequestRetired(2, 2.0, "y", "abort", -1, 9, 0)])
    assert s.num_prompt_tokens == 7      # y never got a first token: its prompt was not served


def test_feeding_in_batches_equals_feeding_at_once():
    events = small_run()
    m = Metrics()
    for i in range(0, len(events), 3):
        m.feed(events[i:i + 3])
    assert m.summary() == summarize(events)


def test_empty_stream_and_dropped_events():
    s = summarize([])
    assert s.batch_utilisation is None and s.throughput_out_tok_s is None
    assert s.ttft == Distribution(0) and s.recompute_tax is None
    assert summarize([EventsDropped(3, 1.0, 15), EventsDropped(9, 2.0, 5)]).num_events_dropped == 20


def test_percentile_linear_interpolation():
    xs = [1.0, 2.0, 3.0, 4.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 90) == approx(3.7)
    assert percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_windowed_rates():
    w = WindowedRates(window_s=10.0)
    # 20 steps one second apart, 4 of 8 rows sampling, one 16-token prefill chunk per step
    for k in range(1, 21):
        w.feed([step(k, float(k), ["a", "b", "c", "d"], num_rows=8, num_tokens=20),
                PrefillChunk(k, float(k), "p", 16, 16, 16)])
    r = w.rates()                    # now = 20: steps 11..20 are in the window
    assert r.span_s == 10.0
    assert r.steps_per_s == approx(1.0)
    assert r.output_tok_per_s == approx(4.0)
    assert r.prefill_tok_per_s == approx(16.0)
    assert r.tokens_per_s == approx(20.0)
    assert r.batch_utilisation == approx(0.5)
    assert w.rates(now=25.0).output_tok_per_s == approx(2.0)    # idle for 5 s: half the window
    assert w.rates(now=40.0).output_tok_per_s == 0.0
    assert w.rates(now=40.0).batch_utilisation is None


def test_windowed_rates_young_run_uses_elapsed_time():
    w = WindowedRates(window_s=10.0)
    w.feed([step(1, 100.0, ["a"]), step(2, 102.0, ["a"]),
            RequestRetired(2, 102.0, "a", "stop", 0, 1, 2)])
    r = w.rates()
    assert r.span_s == 2.0
    assert r.output_tok_per_s == approx(1.0)    # both tokens over 2 s elapsed
    assert r.finished_per_s == approx(0.5)
    assert WindowedRates().rates().steps_per_s == 0.0
