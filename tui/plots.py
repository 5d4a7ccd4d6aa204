"""Plots over time, drawn by plotext into a string and shown in a Static.

plotext keeps one global figure, so plots are built one after another on the UI
thread. x is seconds before the newest history point; each series is a line.
Throughput is a rate over a sliding window (RATE_SLIDE_S, named in the title), latency
percentiles are over the model's LATENCY_WINDOW_S; a red vertical line marks every knob
change inside the window, labelled with the knob's new value.
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
               knob_label: Callable[[str], str] = _scheduler_label) -> str:
    """The plot `name` over the last `window_s` seconds of history, as an ANSI string; a knob change is
    marked with `knob_label(name)` (the source description's labels)."""
    spec = PLOTS[name]
    fig = plotext.figure
    fig.clear()
    fig.theme("simple")
    fig.plot_size(max(20, width), max(5, height))
    history = model.history
    end = history[-1].t if history else 0.0
    # A run younger than the window is drawn over its own span, not squeezed to the right.
    span = max(5.0, min(window_s, end - history[0].t)) if history else window_s
    points = [p for p in history if p.t >= end - span]
    series = plot_series(spec, points, end)
    roomy = height >= 12            # room for axis labels and a legend; else the title carries them
    top = 0.0
    for label, xs, ys in series:
        signal = fig.signal(xs, ys, marker="braille")
        signal.lines()
        if roomy:
            signal.label(label)
        fig.draw(signal)
        top = max(top, max(ys))
    for mark in model.knob_marks:
        x = mark.t - end
        if -span <= x <= 0:
            fig.line(x, orientation="v", pixel="red")
            if series:
                fig.draw(fig.text(x, top, f" {knob_label(mark.name)}={mark.new}"))
    names = "" if roomy else ": " + " ".join(label.replace(" ", "") for label, _, _ in series)
    title = f"{spec.title} (last {span:.0f} s)"
    if not roomy or len(title) > width - 8:
        title = f"{spec.short}{names} ({span:.0f} s)"
    fig.title(title if series else f"{spec.short}: no data yet")
    if roomy:
        fig.label(spec.unit, axis="y")
        fig.label("seconds before now", axis="x")
    fig.ruler("x").lim(-span, 0)
    return fig.build().string()


class PlotPanel(Static):
    """One plot; `redraw()` rebuilds it (the dashboard calls it at a low rate, plotting is not free)."""

    def __init__(self, name: str, **kwargs):
        super().__init__(**kwargs)
        self.plot_name = name

    _last: tuple[DashboardModel, float] | None = None

    def on_resize(self) -> None:
        if self._last is not None:
            self.redraw(*self._last)

    def redraw(self, model: DashboardModel, window_s: float) -> None:
        self._last = (model, window_s)
        width, height = self.size.width, self.size.height
        if width < 10 or height < 4:
            self.update("")
            return
        plot = build_plot(self.plot_name, model, window_s, width, height, self.screen.description.label)
        self.update(Text.from_ansi(plot, no_wrap=True))
