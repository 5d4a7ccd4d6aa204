"""Panels that draw the view model: header, slot grid, KV pool, request timeline.

Each widget reads `self.screen.model` (a DashboardModel) in `render()`; the dashboard screen calls
`refresh()` on the visible ones once per tick. Nothing here mutates the model.
"""
from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from batchtop.telemetry.protocol.knob import SCHEDULER_KNOBS

from .model import SLOT_KINDS, DashboardModel, fmt_rate, fmt_seconds

HEADER_KNOBS = tuple(SCHEDULER_KNOBS)        # the knobs every source has, in the header's second line

SPARK = " ▁▂▃▄▅▆▇█"


def bar(fraction: float, width: int, style: str = "green") -> Text:
    """A horizontal gauge `width` cells wide, filled to `fraction` (clipped to 0..1)."""
    width = max(1, width)
    fraction = min(max(fraction, 0.0), 1.0)
    filled = round(fraction * width)
    text = Text("█" * filled, style=style)
    text.append("░" * (width - filled), style="bright_black")
    return text


def sparkline(values: list[float], width: int, top: float = 100.0) -> str:
    """The newest `width` values as block glyphs scaled to `top`."""
    values = values[-width:] if width > 0 else []
    if top <= 0:
        top = max(values, default=1.0) or 1.0
    return "".join(SPARK[min(8, max(0, round(v / top * 8)))] for v in values)


class HeaderBar(Static):
    """Three lines: engine identity and state; throughput, queues, KV, budget and knobs; what binds
    admission now."""

    def render(self) -> Text:
        dash = self.screen
        model: DashboardModel = dash.model
        source = dash.source
        meta = source.meta
        knobs = model.knobs
        rates = model.rates.rates(dash.now())
        state = source.status()
        style = "bold black on yellow" if "paused" in state else "bold black on green"
        line = Text()
        line.append(f" {state} ", style=style)
        if source.recording:
            line.append(" ● REC ", style="bold white on red")
        line.append(f" step {model.step}", style="bold cyan")
        line.append(f"  {rates.steps_per_s:.1f} st/s  in {fmt_rate(rates.prefill_tok_per_s)}"
                    f" out {fmt_rate(rates.output_tok_per_s)} tok/s  ")
        line.append(f"{meta.get('model') or '?'}", style="bold")
        modes = [knobs.get("batching_mode") or meta.get("batching_mode"),
                 meta.get("layout") or knobs.get("layout"),
                 knobs.get("preemption_mode") or meta.get("preemption_mode")]
        line.append(f" {meta.get('device') or ''} " + "/".join(mode or "?" for mode in modes))
        if meta.get("kernels"):
            line.append(f"  {meta['kernels']}", style="bold red")
        line.append("\n")
        line.append(f" run {model.num_running}", style="green")
        line.append(f"  wait {model.num_waiting}", style="yellow")
        line.append(f"  pre {model.num_preempted}", style="red")
        line.append(f"  KV {model.kv_pct:3.0f}%", style="magenta")
        line.append(f"  budget {model.budget_pct:3.0f}%")
        if model.graph_padding_seen and rates.padded_token_share is not None:
            line.append(f"  graph pad {100 * rates.padded_token_share:3.0f}%", style="cyan")
        line.append("  │ " + " ".join(f"{SCHEDULER_KNOBS[name].label} {knobs.get(name, '?')}"
                                     for name in HEADER_KNOBS), style="bold")
        if "load_rate" in knobs:
            line.append(f" load {knobs['load_rate']:g}/s {knobs.get('length_dist', '')}", style="bold")
        if model.num_dropped:
            line.append(f"  dropped {model.num_dropped}", style="bold red")
        line.append("\n")
        blocked = model.admission
        if blocked is not None and model.num_waiting:
            line.append(" admission blocked: ", style="bold yellow")
            line.append(blocked.describe())
        elif model.num_waiting:
            line.append(" admission: decided at the next step", style="bright_black")
        else:
            line.append(" admission open: nobody waits", style="bright_black")
        return line


class SlotGrid(Static):
    """One cell per batch slot (up to max_num_seqs, more if events used more), with a legend."""

    def wanted_height(self, width: int) -> int:
        """Lines needed at `width`: title, grid rows (two-column cells when they fit), legend."""
        num_slots = self.screen.model.num_grid_slots()
        per_row = max(1, (width - 2) // 2)
        return 1 + max(1, -(-num_slots // per_row)) + self._legend(width - 2, self._kinds()).count("\n") + 1

    def _kinds(self) -> list[str]:
        """The legend's kinds: graph padding only once a step was padded (never on the CPU)."""
        return [kind for kind in SLOT_KINDS if kind != "graph" or self.screen.model.graph_padding_seen]

    def render(self) -> Text:
        model: DashboardModel = self.screen.model
        width = max(8, self.size.width)
        num_slots = model.num_grid_slots()
        legend = self._legend(width, self._kinds())
        rows_free = max(1, self.size.height - legend.count("\n") - 2)
        cell = 2 if num_slots * 2 <= width * rows_free else 1
        per_row = max(1, width // cell)
        is_mirror = self.screen.source.meta.get("slots") == "mirrored"
        mirrored = " (mirrored from vLLM's input batch)" if is_mirror else ""
        text = Text(f"batch{mirrored} {model.num_occupied_span}/{num_slots} slots"
                    f"  padding {model.num_padding_rows}", style="bold")
        if model.graph_padding_seen:
            text.append(f"  graph +{model.num_graph_padding_rows}", style="bold cyan")
        text.append("\n")
        for slot in range(num_slots):
            kind, _ = model.slot_kind(slot)
            glyph, style, _, _ = SLOT_KINDS[kind]
            text.append(glyph + (" " if cell == 2 else ""), style=style)
            if (slot + 1) % per_row == 0 and slot + 1 < num_slots:
                text.append("\n")
        text.append("\n")
        text.append_text(Text.from_markup(legend))
        return text

    @staticmethod
    def _legend(width: int, kinds: list[str]) -> str:
        """Short labels, wrapped to `width`; the help screen has the long ones."""
        lines, line, used = [], [], 0
        for glyph, style, label, _ in (SLOT_KINDS[kind] for kind in kinds):
            size = len(label) + 2
            if line and used + size > width:
                lines.append(" ".join(line))
                line, used = [], 0
            line.append(f"[{style}]{glyph}[/]{label}")
            used += size
        lines.append(" ".join(line))
        return "\n".join(lines)


def split_bar(used: int, cached: int, total: int, width: int) -> Text:
    """The pool as one bar: used (held by requests), cached (free, holding a prefix), free."""
    if total <= 0:
        return Text("·" * width, style="bright_black")
    n_used = round(width * used / total)
    n_cached = min(width - n_used, round(width * cached / total))
    text = Text("█" * n_used, style="magenta")
    text.append("▒" * n_cached, style="blue")
    text.append("·" * (width - n_used - n_cached), style="bright_black")
    return text


def cache_section(model: DashboardModel, width: int, rows: int) -> Text | None:
    """The prefix cache: hit rates, the most shared prefixes, the recent evictions (None before any
    request queried it)."""
    cache = model.cache
    if not cache.num_queried_tokens or rows < 2:
        return None
    now = model.last_t or 0.0
    tok, req = cache.hit_rates(now)
    total = cache.num_cached_tokens / cache.num_queried_tokens
    text = Text("\nprefix cache ", style="bold")
    window = f"{tok * 100:.0f}% tok {req * 100:.0f}% req (10 s), " if tok is not None else ""
    text.append(f"{window}{total * 100:.0f}% of all tokens; {cache.num_evicted_blocks} evicted")
    top = [p for p in cache.top_prefixes(max(0, rows - 3)) if p.num_sharing]
    if top:
        text.append(f"\n{'prefix':<12} {'reqs':>5} {'saved':>7} {'blocks':>6} {'last':>6}",
                    style="bright_black")
        for p in top:
            text.append(f"\n{p.prefix_id:<12} {p.num_sharing:>5} {p.tokens_saved:>7} {p.num_blocks:>6} "
                        f"{fmt_seconds(max(0.0, now - p.last_use_t)):>6}")
    if cache.evictions:
        last = cache.evictions[-1]
        prefixes = ", ".join(last.prefix_ids[:3]) + (" …" if len(last.prefix_ids) > 3 else "")
        text.append(f"\nevicted {last.num_blocks} at step {last.step}: {prefixes}"[: width + 1], style="blue")
    return text


class KvPanel(Static):
    """The KV pool: gauge, history sparkline, blocks held per running request."""

    def render(self) -> Text:
        model: DashboardModel = self.screen.model
        width = max(10, self.size.width)
        text = Text("KV pool ", style="bold")
        text.append(f"{model.kv_used}/{model.kv_total} blocks {model.kv_pct:.0f}%")
        if model.kv_cached:
            text.append(f" +{model.kv_cached} cached", style="blue")
        text.append("\n")
        text.append_text(split_bar(model.kv_used, model.kv_cached, model.kv_total, width))
        text.append("\n")
        text.append(sparkline([p.kv_pct for p in model.history], width), style="magenta")
        text.append("\nbudget ", style="bold")
        text.append(f"{model.budget_used}/{model.token_budget} tok\n")
        text.append_text(bar(model.budget_pct / 100, width, "cyan"))
        rows = max(0, self.size.height - 6)
        cache_lines = cache_section(model, width, rows // 2)
        if cache_lines:
            text.append_text(cache_lines)
            rows -= cache_lines.plain.count("\n")
        blocks = model.running_blocks()
        if blocks and rows:
            text.append("\nblocks per running request", style="bold")
            top = max(b for _, b in blocks) or 1
            for request_id, num_blocks in blocks[:rows - 1]:
                label = f"\n{request_id[:8]:>8} {num_blocks:>4} "
                text.append(label)
                text.append_text(bar(num_blocks / top, width - len(label) + 1, "magenta"))
        return text


class TimelineView(Static):
    """The selected request's life: arrived, admitted, chunks, first token, preempted, retired."""

    def render(self) -> Text:
        dash = self.screen
        model: DashboardModel = dash.model
        request_id = dash.selected_request
        req = model.request(request_id) if request_id else None
        if req is None:
            return Text("timeline: select a request in the table (↑/↓, enter)", style="bright_black")
        now = dash.now() or 0.0
        text = Text(f"{req.request_id}", style="bold")
        text.append(f"  {req.state}  slot {req.slot if req.slot >= 0 else '-'}  out {req.num_output_tokens}"
                    f"  TTFT {fmt_seconds(req.ttft_s)}  age {fmt_seconds(req.age_s(now))}"
                    f"  preempted {req.num_preemptions}x\n")
        t0 = req.arrival_t if req.arrival_t is not None else (req.timeline[0][1] if req.timeline else 0.0)
        entries = list(req.timeline)[-max(1, self.size.height - 1):]
        for step, t, what in entries:
            text.append(f"{step:>6} +{t - t0:7.3f}s ", style="bright_black")
            text.append(f"{what}\n", style=_timeline_style(what))
        return text


def _timeline_style(what: str) -> str:
    if what.startswith(("preempted", "retracted")):
        return "red"
    if what.startswith(("admitted", "resumed")):
        return "green"
    if what.startswith("retired"):
        return "bold"
    if what.startswith("first token"):
        return "cyan"
    return ""
