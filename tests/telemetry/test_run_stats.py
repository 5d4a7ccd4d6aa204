import dataclasses

import pytest
from telemetry_samples import STATIC_LENGTHS, static_batch

from batchtop.telemetry.events import (
    EventsDropped,
    FirstToken,
    PrefillChunk,
    RequestArrived,
    RequestPreempted,
    RequestRetired,
    RequestRetracted,
    StepFinished,
)
from batchtop.telemetry.rates import WindowedRates
from batchtop.telemetry.run_stats import Distribution, Metrics, MetricsSummary, percentile, summarize

approx = pytest.approx


def step(k, t, sampled, num_rows=2, num_tokens=10):
    return StepFinished(step=k, t=t, num_rows=num_rows, num_tokens=num_tokens,
                        sampled_request_ids=tuple(sampled), num_running=0, num_waiting=0, kv_blocks_used=0,
                        kv_blocks_total=0, schedule_s=0, prepare_s=0, forward_s=0, sample_s=0, update_s=0)


def small_run():
    """Four requests over five steps; every expected figure is worked out by hand in the tests."""
    return [
        RequestArrived(step=0, t=0.0, request_id="a", num_prompt_tokens=10, max_tokens=3, priority=0),
        RequestArrived(step=0, t=1.0, request_id="b", num_prompt_tokens=20, max_tokens=3, priority=0),
        RequestArrived(step=0, t=1.0, request_id="c", num_prompt_tokens=30, max_tokens=3, priority=0),
        step(1, 1.0, ["a"]), FirstToken(step=1, t=1.0, request_id="a", ttft_s=1.0),
        step(2, 1.5, ["a", "b"]), FirstToken(step=2, t=1.5, request_id="b", ttft_s=0.5),
        RequestPreempted(step=3, t=2.0, request_id="b", slot=0, blocks_freed=1, tokens_to_recompute=21,
                         reason="kv pool dry"),
        step(3, 2.5, ["a"]), RequestRetired(step=3, t=2.5, request_id="a", reason="stop", slot=0,
                                            num_prompt_tokens=10, num_output_tokens=3),
        RequestArrived(step=3, t=2.5, request_id="d", num_prompt_tokens=40, max_tokens=3, priority=0),
        RequestRetracted(step=4, t=3.0, request_id="c", slot=1, blocks_freed=1, tokens_to_recompute=5,
                         new_token_ratio=0.5),
        step(4, 4.0, ["b", "c"]), FirstToken(step=4, t=4.0, request_id="c", ttft_s=3.0),
        RequestRetired(step=4, t=4.0, request_id="c", reason="stop", slot=1, num_prompt_tokens=30,
                       num_output_tokens=1),
        step(5, 4.5, ["b", "d"]), FirstToken(step=5, t=4.5, request_id="d", ttft_s=2.0),
        RequestRetired(step=5, t=4.5, request_id="b", reason="length", slot=0, num_prompt_tokens=20,
                       num_output_tokens=3),
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
    s = summarize([FirstToken(step=1, t=1.0, request_id="x", ttft_s=0.1),
                   RequestRetired(step=2, t=2.0, request_id="x", reason="stop", slot=0, num_prompt_tokens=7,
                                  num_output_tokens=2),
                   RequestRetired(step=2, t=2.0, request_id="y", reason="abort", slot=-1, num_prompt_tokens=9,
                                  num_output_tokens=0)])
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
    dropped = [EventsDropped(step=3, t=1.0, count=15), EventsDropped(step=9, t=2.0, count=5)]
    assert summarize(dropped).num_events_dropped == 20


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
                PrefillChunk(step=k, t=float(k), request_id="p", num_tokens=16, num_computed_tokens=16,
                             num_known_tokens=16)])
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
            RequestRetired(step=2, t=102.0, request_id="a", reason="stop", slot=0, num_prompt_tokens=1,
                           num_output_tokens=2)])
    r = w.rates()
    assert r.span_s == 2.0
    assert r.output_tok_per_s == approx(1.0)    # both tokens over 2 s elapsed
    assert r.finished_per_s == approx(0.5)
    assert WindowedRates().rates().steps_per_s == 0.0


def test_peak_kv_is_the_fullest_step_and_a_summary_survives_its_dict():
    events = small_run()
    pools = {1: (3, 8), 2: (7, 8), 3: (5, 10), 4: (0, 0), 5: (2, 8)}      # step: (used, total); 0: no pool
    events = [dataclasses.replace(e, kv_blocks_used=pools[e.step][0], kv_blocks_total=pools[e.step][1])
              if isinstance(e, StepFinished) else e for e in events]
    s = summarize(events)
    assert s.peak_kv == 7 / 8
    assert summarize(small_run()).peak_kv is None          # no step knew its pool
    assert MetricsSummary.from_dict(s.to_dict()) == s
