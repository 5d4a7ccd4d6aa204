"""Plots over time, drawn by plotext into a string and shown in a Static.

plotext keeps one global figure, so plots are built one after another on the UI
thread. x is seconds before the newest history point; each series is a line.
Throughput is a rate over a sliding window (RATE_SLIDE_S, named in the title), latency
percentiles are over the model's LATENCY_WINDOW_S; a red vertical line marks every knob
change inside the window, labelled with the knob's new value. A second run (a recording replayed
beside the main one) is drawn on the same axes, its lines of • against the main run's braille, each
series in the main run's colour for it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import plotext
from rich.text import Text
from textual.widgets import Static

from batchtop.telemetry.protocol.knob import SCHEDULER_KNOBS

from .model import HISTORY_BUCKET_S, LATENCY_WINDOW_S, DashboardModel, HistoryPoint

PLOT_WINDOWS_S = (30.0, 60.0, 300.0, 600.0)
RATE_SLIDE_S = 1.0              # throughput: tokens over the last second at each point
SERIES_COLORS = (12, 10, 9, 14)    # a plot's series in order (plotext's first colours), the same in both runs
RUN_MARKERS = ("braille", "•")     # the main run's lines, then the run beside it


@dataclass(frozen=True)
class Beside:
    """A second run drawn on the same axes: its model, and `shift` added to a time of the main run to
    get the same moment of this one (both count from their first event)."""
    model: DashboardModel
    shift: float


@dataclass(frozen=True)
class PlotSpec:
    title: str
    short: str                  # the title where the long one does not fit
    unit: str                   # the y axis label
    series: tuple[tuple[str, object], ...]   # (label, value of a point or None)
    slide: bool = False         # a rate: averaged over RATE_SLIDE_S


PLOTS: dict[str, PlotSpec] = {
    "throughput": PlotSpec(f"throughput over a {RATE_SLIDE_S:g} s sliding window",
                           f"tok/s, {RATE_SLIDE_S:g} s window", "tok/s",
                           (("out", lambda p: p.out_tok_s), ("in", lambda p: p.in_tok_s)), slide=True),
    "rows": PlotSpec("requests", "rows", "rows",
                     (("running", lambda p: p.running), ("waiting", lambda p: p.waiting))),
    "kv": PlotSpec("KV pool in use and prefix-cache hit rate (10 s window)", "KV %, hit %", "%",
                   (("kv", lambda p: p.kv_pct), ("hits", lambda p: p.hit_tok_pct),
                    ("req-hits", lambda p: p.hit_req_pct))),
    "latency": PlotSpec(f"latency percentiles over {LATENCY_WINDOW_S:g} s",
                        f"ms, {LATENCY_WINDOW_S:g} s window", "ms",
                        (("ttft p50", lambda p: _ms(p.ttft_p50)), ("ttft p99", lambda p: _ms(p.ttft_p99)),
                         ("tpot p50", lambda p: _ms(p.tpot_p50)), ("tpot p99", lambda p: _ms(p.tpot_p99)))),
}


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000.0


def sliding_mean(values: list[float], width: int) -> list[float]:
    """Each value averaged with the `width - 1` before it (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= width:
            total -= values[i - width]
        out.append(total / min(i + 1, width))
    return out


def plot_series(spec: PlotSpec, points: list[HistoryPoint],
                end: float) -> list[tuple[str, list[float], list[float]]]:
    """(label, xs, ys) per series with data; x is seconds before `end`."""
    out = []
    width = max(1, round(RATE_SLIDE_S / HISTORY_BUCKET_S))
    for label, value in spec.series:
        pairs = [(p.t - end, v) for p in points if (v := value(p)) is not None]
        if not pairs:
            continue
        xs, ys = [x for x, _ in pairs], [y for _, y in pairs]
        out.append((label, xs, sliding_mean(ys, width) if spec.slide else ys))
    return out


def _scheduler_label(name: str) -> str:
    knob = SCHEDULER_KNOBS.get(name)
    return knob.label if knob is not None else name


def build_plot(name: str, model: DashboardModel, window_s: float, width: int, height: int,
               knob_label: Callable[[str], str] = _scheduler_label, beside: Beside | None = None) -> str:
    """The plot `name` over the last `window_s` seconds of history, as an ANSI string; a knob change is
    marked with `knob_label(name)` (the source description's labels). `beside`: a second run drawn on
    the same axes with its own marker, each series in the colour of the main run's."""
    spec = PLOTS[name]
    fig = plotext.figure
    fig.clear()
    fig.theme("simple")
    fig.plot_size(max(20, width), max(5, height))
    history = model.history
    end = history[-1].t if history else 0.0
    # A run younger than the window is drawn over its own span, not squeezed to the right.
    span = max(5.0, min(window_s, end - history[0].t)) if history else window_s
    roomy = height >= 12            # room for axis labels and a legend; else the title carries them
    runs = [(model, end, RUN_MARKERS[0], "A " if beside else "")]
    if beside is not None:
        runs.append((beside.model, end + beside.shift, RUN_MARKERS[1], "B "))
    drawn = [_draw_run(fig, spec, run_model, run_end, span, marker, labelled=roomy and i == 0)
             for i, (run_model, run_end, marker, _) in enumerate(runs)]
    series, top = drawn[0][0], max(run_top for _, run_top in drawn)
    for (run_model, run_end, _, tag), (run_series, _) in zip(runs, drawn):
        for mark in run_model.knob_marks:
            x = mark.t - run_end
            if -span <= x <= 0:
                fig.line(x, orientation="v", pixel="red")
                if run_series:
                    fig.draw(fig.text(x, top, f" {tag}{knob_label(mark.name)}={mark.new}"))
    names = "" if roomy else ": " + " ".join(label.replace(" ", "") for label, _, _ in series)
    title = f"{spec.title} (last {span:.0f} s)"
    if not roomy or len(title) > width - 8:
        title = f"{spec.short}{names} ({span:.0f} s)"
    fig.title(title if any(run_series for run_series, _ in drawn) else f"{spec.short}: no data yet")
    if roomy:
        fig.label(spec.unit, axis="y")
        fig.label("seconds before now", axis="x")
    fig.ruler("x").lim(-span, 0)
    return fig.build().string()


def _draw_run(fig, spec: PlotSpec, model: DashboardModel, end: float, span: float, marker: str,
              labelled: bool) -> tuple[list, float]:
    """One run's series as lines (series i in SERIES_COLORS[i]); (the series drawn, their top value)."""
    points = [p for p in model.history if p.t >= end - span]
    series = plot_series(spec, points, end)
    top = 0.0
    for label, xs, ys in series:
        color = SERIES_COLORS[[name for name, _ in spec.series].index(label)]
        signal = fig.signal(xs, ys, marker=plotext.marker(marker, color))
        signal.lines()
        if labelled:
            signal.label(label)
        fig.draw(signal)
        top = max(top, max(ys))
    return series, top


class PlotPanel(Static):
    """One plot; `redraw()` rebuilds it (the dashboard calls it at a low rate, plotting is not free)."""

    def __init__(self, name: str, **kwargs):
        super().__init__(**kwargs)
        self.plot_name = name

    _last: tuple[DashboardModel, float, Beside | None] | None = None

    def on_resize(self) -> None:
        if self._last is not None:
            self.redraw(*self._last)

    def redraw(self, model: DashboardModel, window_s: float, beside: Beside | None = None) -> None:
        self._last = (model, window_s, beside)
        width, height = self.size.width, self.size.height
        if width < 10 or height < 4:
            self.update("")
            return
        plot = build_plot(self.plot_name, model, window_s, width, height, self.screen.description.label,
                          beside)
        self.update(Text.from_ansi(plot, no_wrap=True))
