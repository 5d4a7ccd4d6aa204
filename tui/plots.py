"""Plots over time, drawn by plotext into a string and shown in a Static.

plotext keeps one global figure, so plots are built one after another on the UI
thread. x is seconds relative to the newest history point (negative = past); a
vertical line marks every knob change inside the window.
"""
from __future__ import annotations

import plotext
from rich.text import Text
from textual.widgets import Static

from .model import DashboardModel, HistoryPoint

PLOT_WINDOWS_S = (30.0, 60.0, 300.0, 600.0)

# name -> (title, [(label, value of a point)])
PLOTS: dict[str, tuple[str, list[tuple[str, object]]]] = {
    "throughput": ("tok/s", [("out", lambda p: p.out_tok_s), ("in", lambda p: p.in_tok_s)]),
    "rows": ("rows", [("running", lambda p: p.running), ("waiting", lambda p: p.waiting)]),
    "kv": ("KV used %", [("kv", lambda p: p.kv_pct)]),
    "latency": ("latency ms", [("ttft50", lambda p: _ms(p.ttft_p50)), ("ttft99", lambda p: _ms(p.ttft_p99)),
                               ("tpot50", lambda p: _ms(p.tpot_p50)), ("tpot99", lambda p: _ms(p.tpot_p99))]),
}


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000.0


def build_plot(name: str, model: DashboardModel, window_s: float, width: int, height: int) -> str:
    """The plot `name` over the last `window_s` seconds of history, as an ANSI string."""
    title, series = PLOTS[name]
    fig = plotext.figure
    fig.clear()
    fig.theme("simple")
    fig.plot_size(max(20, width), max(5, height))
    history = model.history
    end = history[-1].t if history else 0.0
    # A run younger than the window is drawn over its own span, not squeezed to the right.
    span = max(5.0, min(window_s, end - history[0].t)) if history else window_s
    points: list[HistoryPoint] = [p for p in history if p.t >= end - span]
    drawn = False
    for label, value in series:
        pairs = [(p.t - end, v) for p in points if (v := value(p)) is not None]
        if len(pairs) < 1:
            continue
        signal = fig.signal([x for x, _ in pairs], [y for _, y in pairs], marker="braille")
        fig.draw(signal)
        drawn = True
    for mark in model.knob_marks:
        x = mark.t - end
        if -span <= x <= 0:
            fig.line(x, orientation="v", pixel="red")
    names = " ".join(label for label, _ in series)
    fig.title(f"{title}: {names} (last {span:.0f}s)" if drawn else f"{title}: no data yet")
    fig.ruler("x").lim(-span, 0)
    return fig.build().string()


class PlotPanel(Static):
    """One plot; `redraw()` rebuilds it (the app calls it at a low rate, plotting is not free)."""

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
        self.update(Text.from_ansi(build_plot(self.plot_name, model, window_s, width, height), no_wrap=True))
