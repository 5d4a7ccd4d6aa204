"""The /metrics parser and the per-interval derivations, on vLLM (scraped) and SGLang (built) expositions."""
from __future__ import annotations

import pytest
from expositions import sglang_exposition, two_engines, vllm_fixture, without

from batchtop.telemetry.exposition import Histogram, detect_flavour, parse_exposition
from batchtop.telemetry.intervals import derive

ENGINE = "smollm2 engine=0"


def test_vllm_snapshot_reads_gauges_pool_and_counters():
    snapshot = parse_exposition(vllm_fixture("busy"), t=1.0).engines[ENGINE]
    assert (snapshot.running, snapshot.waiting) == (2, 10)
    assert snapshot.waiting_by_reason == {"capacity": 10, "deferred": 0}
    assert snapshot.kv_usage == pytest.approx(0.8)
    assert (snapshot.kv_blocks_total, snapshot.block_size, snapshot.kv_blocks_used) == (6, 128, 5)
    assert snapshot.counters["generation_tokens"] == 13
    # a histogram, though its name ends in _total
    assert snapshot.histograms["step_tokens"].count == 7
    assert snapshot.finished == {"stop": 0, "length": 0, "abort": 0, "error": 0, "repetition": 0}


def test_vllm_interval_over_a_drained_load():
    busy, drained = parse_exposition(vllm_fixture("busy"),
                                     1.0), parse_exposition(vllm_fixture("drained"), 21.0)
    interval = derive(busy.engines[ENGINE], drained.engines[ENGINE], t=21.0, dt=20.0)
    assert not interval.reset
    assert interval.steps == 193 - 7
    assert interval.tokens_per_step == pytest.approx((2584 - 373) / (193 - 7))
    assert interval.admitted == 12 - 2
    assert interval.retired == 12 and interval.retired_by_reason == {"length": 12}
    assert interval.generation_tokens == 384 - 13
    assert interval.gen_tok_s == pytest.approx((384 - 13) / 20)
    assert interval.preemptions == 0 and interval.prefix_hit_rate == 0
    assert (interval.running, interval.waiting, interval.kv_blocks_used) == (0, 0, 0)
    ttft50, ttft99 = interval.latency["ttft"]
    assert 0 < ttft50 <= ttft99


def test_counter_reset_is_detected_not_a_negative_rate():
    drained, busy = parse_exposition(vllm_fixture("drained"),
                                     1.0), parse_exposition(vllm_fixture("busy"), 2.0)
    interval = derive(drained.engines[ENGINE], busy.engines[ENGINE], t=2.0, dt=1.0)   # the server restarted
    assert interval.reset
    assert interval.generation_tokens == 13 and interval.steps == 7 and interval.admitted == 2
    assert interval.retired == 0
    for value in (interval.steps, interval.admitted, interval.retired, interval.generation_tokens,
                  interval.prompt_tokens, interval.preemptions):
        assert value >= 0


def test_missing_series_stay_unknown():
    text = without(vllm_fixture("busy"), "vllm:iteration_tokens_total", "vllm:cache_config_info",
                   "vllm:num_requests_waiting", "vllm:num_preemptions")
    earlier = parse_exposition(text, 1.0).engines[ENGINE]
    later = parse_exposition(without(vllm_fixture("drained"), "vllm:iteration_tokens_total",
                                     "vllm:num_requests_waiting", "vllm:num_preemptions"),
                                     2.0).engines[ENGINE]
    assert earlier.waiting is None and earlier.waiting_by_reason == {} and earlier.kv_blocks_total is None
    assert earlier.kv_blocks_used is None and earlier.kv_usage == pytest.approx(0.8)
    interval = derive(earlier, later, t=2.0, dt=1.0)
    assert interval.steps is None and interval.tokens_per_step is None and interval.preemptions is None
    assert interval.waiting is None
    assert interval.retired == 12                                   # what is there is still read


def test_several_engines_one_snapshot_each_pool_joined_by_engine():
    scrape = parse_exposition(two_engines(vllm_fixture("busy")), 1.0)
    assert sorted(scrape.engines) == ["smollm2 engine=0", "smollm2 engine=1"]
    for snapshot in scrape.engines.values():
        assert snapshot.running == 2 and snapshot.kv_blocks_total == 6


def test_sglang_names_map_onto_the_same_view():
    text = sglang_exposition()
    assert detect_flavour(text) == "sglang"
    scrape = parse_exposition(text, 1.0)
    assert scrape.flavour == "sglang" and list(scrape.engines) == ["qwen"]
    snapshot = scrape.engines["qwen"]
    assert (snapshot.running, snapshot.waiting) == (3, 5)                  # tp_rank 1's copy is dropped
    assert (snapshot.kv_usage, snapshot.kv_blocks_total, snapshot.block_size) == (0.25, 40000, 1)
    assert snapshot.kv_blocks_used == 10000 and snapshot.gen_throughput == 123
    later = parse_exposition(sglang_exposition(requests=14, aborted=2, generation_tokens=900,
                                               prompt_tokens=1400, cached_tokens=300, retracted=5,
                                               ttft=(0.15, 0.3, 0.3, 2.5, 0.5, 0.5)),
                             3.0).engines["qwen"]
    interval = derive(snapshot, later, t=3.0, dt=2.0)
    assert interval.retired == 4 and interval.retired_by_reason == {"abort": 1}
    assert interval.preemptions == 3
    assert interval.gen_tok_s == 200 and interval.prompt_tok_s == 200
    assert interval.prefix_hit_rate == pytest.approx(100 / 400)
    assert interval.admitted == 2 and interval.latency["ttft"][0] == pytest.approx(0.5)
    assert interval.steps is None                                   # SGLang exports no per-step histogram


def test_sglang_restart_resets():
    earlier = parse_exposition(sglang_exposition(requests=50), 1.0).engines["qwen"]
    later = parse_exposition(sglang_exposition(requests=3), 2.0).engines["qwen"]
    interval = derive(earlier, later, t=2.0, dt=1.0)
    assert interval.reset and interval.retired == 3


def test_neither_flavour_and_not_prometheus():
    assert detect_flavour("# TYPE up gauge\nup 1\n") is None
    assert parse_exposition("up 1\n", 1.0).engines == {}
    with pytest.raises(ValueError):
        detect_flavour("<html><body>hello</body></html>\n")


def test_histogram_quantile_interpolates_within_buckets():
    h = Histogram(((1.0, 0), (2.0, 10), (4.0, 20), (float("inf"), 20)), count=20, sum=50)
    assert h.quantile(0.5) == pytest.approx(2.0)
    assert h.quantile(0.75) == pytest.approx(3.0)
    assert Histogram(((1.0, 0), (float("inf"), 5)), 5, 10).quantile(0.99) == 1.0     # in +Inf: the last bound
    assert Histogram((), 0, 0).quantile(0.5) is None
