"""The panels the dashboard shows over a scrape source (a stock vLLM or SGLang through `/metrics`).

`ScrapedEngines` holds what they read: the source's engines (engine -> `EngineView`, copied once per
scrape) and the engine shown; each widget reads it as `self.screen.scraped` and mutates nothing. A
figure the server does not export is drawn as "–", never as 0. Panels that need per-step events say
what fills them.
"""
from __future__ import annotations

import plotext
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Grid, Horizontal
from textual.widgets import ContentSwitcher, Static

from batchtop.telemetry.intervals import Interval

from .model import fmt_rate
from .sources.scrape import SCHEDULER_HINT, EngineView, MetricsSource
from .widgets import bar, sparkline

SCRAPE_VIEWS = ("engines", "plots", "intervals")
IDLE_REDRAW_TICKS = 10

NEEDS_EVENTS = ("{what} needs batchtop's per-step events, which /metrics does not carry.\n"
                f"To fill it: {SCHEDULER_HINT}.")


def fmt(value: float | None, spec: str = ".0f", unit: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{unit}"


def fmt_ms(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    return f"{seconds * 1000:.0f}ms" if seconds < 10 else f"{seconds:.0f}s"


def last_interval(view: EngineView | None) -> Interval | None:
    return view.intervals[-1] if view is not None and view.intervals else None


def kv_pct(view: EngineView) -> float | None:
    usage = view.latest.kv_usage
    return None if usage is None else usage * 100


class MetricsHeader(Static):
    """Two lines: state, engine and rates of the last interval; then queues, KV, prefix cache, knobs."""

    def render(self) -> Text:
        app = self.screen.scraped
        view: EngineView | None = app.engines.get(app.engine)
        state = app.source.status()
        line = Text()
        line.append(f" {state} ",
                    style="bold black on green" if state.startswith("live") else "bold white on red")
        if view is None:
            line.append("  waiting for the first scrape")
            return line
        last, latest = last_interval(view), view.latest
        keys = list(app.engines)
        count = f" ({keys.index(app.engine) + 1}/{len(keys)}, e: next)" if len(keys) > 1 else ""
        line.append(f" {view.engine}{count}", style="bold")
        if last is not None:
            line.append(f"  {fmt(last.steps_per_s, '.1f')} st/s  {fmt(last.tokens_per_step, '.1f')} tok/step"
                        f"  in {_rate(last.prompt_tok_s)} out {_rate(last.gen_tok_s)} tok/s")
        if latest.gen_throughput is not None:
            line.append(f"  (server: {fmt_rate(latest.gen_throughput)} gen tok/s)")
        line.append("\n")
        line.append(f" run {fmt(latest.running)}", style="green")
        line.append(f"  wait {fmt(latest.waiting)}", style="yellow")
        if latest.waiting_by_reason:
            reasons = ", ".join(f"{k} {v:.0f}" for k, v in sorted(latest.waiting_by_reason.items()))
            line.append(f" ({reasons})", style="yellow")
        line.append(f"  pre {fmt(view.totals.get('preemptions'))}", style="red")
        line.append(f"  KV {fmt(kv_pct(view), '3.0f', '%')}", style="magenta")
        if last is not None and last.prefix_hit_rate is not None:
            line.append(f"  prefix hit {last.prefix_hit_rate * 100:.0f}%")
        if view.num_resets:
            line.append(f"  server restarted {view.num_resets}x", style="bold red")
        line.append("  │ knobs: read-only (none in /metrics)", style="bold")
        return line


def _rate(value: float | None) -> str:
    return "–" if value is None else fmt_rate(value)


class NeedsEventsPanel(Static):
    """In place of a panel that only per-step events can fill: says what would fill it."""

    def __init__(self, what: str, **kwargs):
        super().__init__(**kwargs)
        self.what = what

    def render(self) -> Text:
        return Text(NEEDS_EVENTS.format(what=self.what), style="bright_black")


class MetricsKvPanel(Static):
    """The KV pool from the usage gauge and the pool size (vLLM's cache_config_info), with history."""

    def render(self) -> Text:
        view: EngineView | None = self.screen.scraped.shown()
        width = max(10, self.size.width)
        text = Text("KV pool ", style="bold")
        if view is None:
            return text
        latest, pct = view.latest, kv_pct(view)
        unit = "tokens" if latest.block_size == 1 else "blocks"
        text.append(f"{fmt(latest.kv_blocks_used)}/{fmt(latest.kv_blocks_total)} {unit} "
                    f"{fmt(pct, '.0f', '%')}\n")
        text.append_text(bar((pct or 0.0) / 100, width, "magenta"))
        text.append("\n")
        history = [i.kv_usage * 100 for i in view.intervals if i.kv_usage is not None]
        text.append(sparkline(history, width), style="magenta")
        if latest.block_size and latest.block_size > 1:
            text.append(f"\n{latest.block_size} tokens per block", style="bright_black")
        last = last_interval(view)
        if last is not None:
            text.append(f"\nTTFT p50 {fmt_ms(last.latency.get('ttft', (None,))[0])}"
                        f"  ITL p50 {fmt_ms(last.latency.get('itl', (None,))[0])}")
        return text


ENGINE_COLUMNS = (("engine", 22), ("run", 5), ("wait", 5), ("KV%", 5), ("blocks", 9), ("st/s", 6),
                  ("tok/st", 7), ("out/s", 7), ("admit", 6), ("retired", 8), ("preempt", 8), ("TTFT50", 8))


class EnginesTable(Static):
    """One row per engine (series told apart by their engine / model labels), then what is missing."""

    def render(self) -> Text:
        app = self.screen.scraped
        text = Text("".join(f"{name:>{w}} " if i else f"{name:<{w}} " for i,
                            (name, w) in enumerate(ENGINE_COLUMNS)),
                    style="bold reverse")
        for key, view in app.engines.items():
            last, latest = last_interval(view), view.latest
            cells = (key, fmt(latest.running), fmt(latest.waiting), fmt(kv_pct(view)),
                     f"{fmt(latest.kv_blocks_used)}/{fmt(latest.kv_blocks_total)}",
                     fmt(last.steps_per_s if last else None, ".1f"),
                     fmt(last.tokens_per_step if last else None, ".1f"),
                     _rate(last.gen_tok_s if last else None), fmt(view.totals.get("admitted")),
                     fmt(view.totals.get("retired")), fmt(view.totals.get("preemptions")),
                     fmt_ms(last.latency.get("ttft", (None,))[0] if last else None))
            row = "".join(f"{c[:w]:>{w}} " if i else f"{c[:w]:<{w}} "
                          for i, (c, (_, w)) in enumerate(zip(cells, ENGINE_COLUMNS)))
            text.append("\n" + row, style="bold" if key == app.engine else "")
        text.append("\n\nadmit, retired, preempt: since batchtop started watching.\n", style="bright_black")
        text.append(NEEDS_EVENTS.format(what="The per-request table"), style="bright_black")
        return text


def interval_line(interval: Interval, t0: float) -> Text:
    """One interval as a log line (what the scheduler did between two scrapes)."""
    text = Text(f"+{interval.t - t0:8.1f}s ", style="bright_black")
    if interval.reset:
        text.append("server restarted (counters went down): counts since its start  ", style="bold red")
    text.append(f"steps {fmt(interval.steps)} ({fmt(interval.tokens_per_step, '.1f')} tok/step)  ")
    text.append(f"admitted {fmt(interval.admitted)}  ", style="green")
    reasons = ", ".join(f"{k} {v:.0f}" for k, v in sorted(interval.retired_by_reason.items()))
    text.append(f"retired {fmt(interval.retired)}{f' ({reasons})' if reasons else ''}  ", style="bold")
    text.append(f"preempted {fmt(interval.preemptions)}  ", style="red" if interval.preemptions else "")
    text.append(f"in {_rate(interval.prompt_tok_s)} out {_rate(interval.gen_tok_s)} tok/s  ")
    text.append(f"run {fmt(interval.running)} wait {fmt(interval.waiting)}  KV "
                f"{fmt(None if interval.kv_usage is None else interval.kv_usage * 100, '.0f', '%')}")
    for name, label in (("ttft", "TTFT"), ("itl", "ITL"), ("e2e", "E2E")):
        p50, p99 = interval.latency.get(name, (None, None))
        if p50 is not None:
            text.append(f"  {label} p50 {fmt_ms(p50)} p99 {fmt_ms(p99)}", style="cyan")
    return text


class IntervalLog(Static):
    """The newest intervals of the engine shown, oldest first (in place of the event log)."""

    def render(self) -> Text:
        view: EngineView | None = self.screen.scraped.shown()
        if view is None or not view.intervals:
            return Text("intervals: one line per scrape once two scrapes are in", style="bright_black")
        rows = max(1, self.size.height)
        t0 = view.intervals[0].t - view.intervals[0].dt
        text = Text()
        for i, interval in enumerate(list(view.intervals)[-rows:]):
            if i:
                text.append("\n")
            text.append_text(interval_line(interval, t0))
        return text


# name -> (title, [(label, value of an interval)])
METRIC_PLOTS = {
    "throughput": ("tok/s", [("out", lambda i: i.gen_tok_s), ("in", lambda i: i.prompt_tok_s)]),
    "rows": ("rows", [("running", lambda i: i.running), ("waiting", lambda i: i.waiting)]),
    "kv": ("KV used %", [("kv", lambda i: None if i.kv_usage is None else i.kv_usage * 100)]),
    "latency": ("latency ms", [("ttft50", lambda i: _latency_ms(i, "ttft", 0)),
                               ("ttft99", lambda i: _latency_ms(i, "ttft", 1)),
                               ("itl50", lambda i: _latency_ms(i, "itl", 0)),
                               ("itl99", lambda i: _latency_ms(i, "itl", 1))]),
}


def _latency_ms(interval: Interval, name: str, which: int) -> float | None:
    value = interval.latency.get(name, (None, None))[which]
    return None if value is None else value * 1000


def build_metrics_plot(name: str, view: EngineView | None, window_s: float, width: int, height: int) -> str:
    title, series = METRIC_PLOTS[name]
    fig = plotext.figure
    fig.clear()
    fig.theme("simple")
    fig.plot_size(max(20, width), max(5, height))
    intervals = list(view.intervals) if view is not None else []
    end = intervals[-1].t if intervals else 0.0
    span = max(5.0, min(window_s, end - intervals[0].t)) if intervals else window_s
    shown = [i for i in intervals if i.t >= end - span]
    drawn = False
    for _, value in series:
        pairs = [(i.t - end, v) for i in shown if (v := value(i)) is not None]
        if pairs:
            fig.draw(fig.signal([x for x, _ in pairs], [y for _, y in pairs], marker="braille"))
            drawn = True
    names = " ".join(label for label, _ in series)
    fig.title(f"{title}: {names} (last {span:.0f}s)" if drawn else f"{title}: no data yet")
    fig.ruler("x").lim(-span, 0)
    return fig.build().string()


class MetricsPlot(Static):
    def __init__(self, name: str, **kwargs):
        super().__init__(**kwargs)
        self.plot_name = name

    def redraw(self, view: EngineView | None, window_s: float) -> None:
        width, height = self.size.width, self.size.height
        if width < 10 or height < 4:
            self.update("")
            return
        self.update(Text.from_ansi(build_metrics_plot(self.plot_name, view, window_s, width,
                                                      height), no_wrap=True))


class ScrapedEngines:
    """The engines of a scrape source as the panels show them, copied when a scrape came in."""

    def __init__(self, source: MetricsSource, engine: str | None = None):
        self.source = source
        self.engine = engine                 # the engine the header, KV panel, plots and log show
        self.engines: dict[str, EngineView] = {}
        self._seen_version = -1

    def shown(self) -> EngineView | None:
        return self.engines.get(self.engine)

    def update(self, ticks: int) -> bool:
        """Copy the source's engines when a scrape came in (and once a second); True: redraw."""
        version = self.source.version
        if version == self._seen_version and ticks % IDLE_REDRAW_TICKS:
            return False
        self._seen_version = version
        self.engines = self.source.snapshot()
        if self.engine not in self.engines and self.engines:
            self.engine = self._match(self.engine)
        return True

    def _match(self, wanted: str | None) -> str:
        """The engine named `wanted` (its whole key, or a key part such as "engine=1"), else the first."""
        for key in self.engines:
            if wanted and (wanted == key or wanted in key.split(" ")):
                return key
        return next(iter(self.engines))

    def next_engine(self) -> str:
        """Show the next engine; what to say about it."""
        keys = list(self.engines)
        if len(keys) < 2:
            return "one engine behind this server"
        self.engine = keys[(keys.index(self.engine) + 1) % len(keys)] if self.engine in keys else keys[0]
        return f"showing {self.engine}"


def compose_scrape_panels() -> ComposeResult:
    """The screen between its header and its status line, over a scrape source."""
    yield MetricsHeader(id="header")
    with Horizontal(id="top"):
        yield NeedsEventsPanel("The slot grid (the batch row by row)", id="slots", classes="needs-events")
        yield MetricsKvPanel(id="kv")
    yield Static(id="viewbar")
    with ContentSwitcher(initial=SCRAPE_VIEWS[0], id="views"):
        yield EnginesTable(id="engines")
        with Grid(id="plots"):
            for name in METRIC_PLOTS:
                yield MetricsPlot(name, id=f"plot-{name}", classes="plot")
        yield IntervalLog(id="intervals")
