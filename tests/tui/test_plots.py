"""Plots: rates over a sliding window, latency over a time window, knob markers with values, lines."""
from __future__ import annotations

import re

from batchtop.telemetry.events import FirstToken, KnobChanged, RequestArrived, StepFinished
from batchtop.tui.model import HISTORY_BUCKET_S, LATENCY_WINDOW_S, DashboardModel
from batchtop.tui.plots import PLOTS, RATE_SLIDE_S, build_plot, plot_series, sliding_mean


def plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def step(k: int, t: float, sampled: tuple[str, ...]) -> StepFinished:
    return StepFinished(step=k, t=t, num_rows=len(sampled), num_tokens=len(sampled),
                        sampled_request_ids=sampled, num_running=len(sampled), num_waiting=0,
                        kv_blocks_used=1, kv_blocks_total=8, schedule_s=0.0, prepare_s=0.0, forward_s=0.0,
                        sample_s=0.0, update_s=0.0)


def test_sliding_mean_averages_the_last_values():
    assert sliding_mean([4.0, 0.0, 2.0, 6.0], 2) == [4.0, 2.0, 1.0, 4.0]
    assert sliding_mean([1.0, 2.0], 1) == [1.0, 2.0]


def test_throughput_is_a_rate_over_the_sliding_window_not_per_bucket_spikes():
    model = DashboardModel()
    ids = tuple(f"r{i}" for i in range(10))
    # 10 tokens at the start of every other bucket: per bucket the rate jumps 20 tok/s <-> 0
    events = [step(k, k * 2 * HISTORY_BUCKET_S + 0.01, ids) for k in range(12)]
    model.feed(events)
    model.advance(events[-1].t + 1.0)
    (_, _, out), = [s for s in plot_series(PLOTS["throughput"], list(model.history), model.history[-1].t)
                    if s[0] == "out"]
    steady = out[2:-2]
    assert round(RATE_SLIDE_S / HISTORY_BUCKET_S) == 2
    assert steady and all(abs(v - 10 / RATE_SLIDE_S) < 1e-9 for v in steady)   # 10 tokens per second
    assert max(p.out_tok_s for p in model.history) == 20.0                     # what the raw buckets say


def test_latency_percentiles_cover_only_the_recent_window():
    model = DashboardModel()
    model.feed([RequestArrived(step=0, t=0.0, request_id="old", num_prompt_tokens=1,
                               max_tokens=1, priority=0),
                FirstToken(step=1, t=0.1, request_id="old", ttft_s=5.0)])
    t = LATENCY_WINDOW_S + 1.0
    model.feed([RequestArrived(step=2, t=t, request_id="new", num_prompt_tokens=1, max_tokens=1, priority=0),
                FirstToken(step=3, t=t + 0.1, request_id="new", ttft_s=0.25)])
    model.advance(t + 1.0)
    early = [p for p in model.history if p.t < 1.0]
    late = model.history[-1]
    assert early[-1].ttft_p50 == 5.0
    assert late.ttft_p50 == late.ttft_p99 == 0.25                  # the old sample left the window


def test_knob_change_is_marked_with_its_new_value_and_axes_have_units():
    model = DashboardModel(knobs={"max_num_seqs": 8})
    ids = ("a", "b")
    model.feed([step(k, k * 0.25, ids) for k in range(1, 40)])
    model.feed([KnobChanged(step=40, t=10.0, name="max_num_seqs", old=8, new=16, source="tui")])
    model.feed([step(k, k * 0.25, ids) for k in range(41, 80)])
    text = plain(build_plot("throughput", model, 60.0, 100, 20))
    assert "seqs=16" in text
    assert "tok/s" in text and "seconds before now" in text and "1 s sliding window" in text
    # drawn as lines: 40 points over ~85 columns; dots alone would mark about 40 of them
    columns = {i for line in text.splitlines() for i, ch in enumerate(line) if "\u2801" <= ch <= "\u28ff"}
    assert len(columns) >= 75
