"""`FleetTable`: one line per engine, sorted and filtered like k9s, a selection; only the rows that fit
are drawn. It reads `FleetRow`s (built on the engines' poll threads) and never the engines themselves.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from rich.text import Text
from textual.widgets import Static

from ..model import fmt_rate, fmt_seconds
from .rows import FleetRow

STATE_STYLE = {"live": "green", "paused": "yellow", "down": "bold red", "connecting": "bright_black"}


def _num(value, spec: str = ".0f") -> str:
    return "–" if value is None else f"{value:{spec}}"


def _rate(value) -> str:
    return "–" if value is None else fmt_rate(value)


def _ms(value) -> str:
    return "–" if value is None else fmt_seconds(value)


@dataclass(frozen=True)
class Column:
    name: str
    width: int
    key: Callable[[FleetRow, float], object]       # sortable value (None sorts last)
    cell: Callable[[FleetRow, float], str]


COLUMNS = (
    Column("engine", 16, lambda r, now: r.name, lambda r, now: r.name),
    Column("kind", 16, lambda r, now: r.kind, lambda r, now: r.kind),
    Column("data", 7, lambda r, now: r.mode, lambda r, now: r.mode or "–"),
    Column("state", 10, lambda r, now: r.state, lambda r, now: r.state),
    Column("age", 6, lambda r, now: r.age_s(now), lambda r, now: _ms(r.age_s(now))),
    Column("run", 4, lambda r, now: r.running, lambda r, now: _num(r.running)),
    Column("wait", 4, lambda r, now: r.waiting, lambda r, now: _num(r.waiting)),
    Column("KV%", 4, lambda r, now: r.kv_pct, lambda r, now: _num(r.kv_pct)),
    Column("binds", 20, lambda r, now: r.binds, lambda r, now: r.binds),
    Column("tok/s", 6, lambda r, now: r.tok_s, lambda r, now: _rate(r.tok_s)),
    Column("st/s", 5, lambda r, now: r.steps_s, lambda r, now: _rate(r.steps_s)),
    Column("pre", 4, lambda r, now: r.preemptions, lambda r, now: _num(r.preemptions)),
    Column("TTFT50", 6, lambda r, now: r.ttft_p50, lambda r, now: _ms(r.ttft_p50)),
    Column("ITL50", 6, lambda r, now: r.itl_p50, lambda r, now: _ms(r.itl_p50)),
    Column("note", 30, lambda r, now: r.reason, lambda r, now: r.reason),
)


def matches(row: FleetRow, text: str) -> bool:
    """The k9s filter: `text` in any of the row's words (name, url, kind, state, binds, note)."""
    text = text.lower()
    return any(text in str(value).lower() for value in (row.name, row.url, row.kind, row.mode, row.state,
                                                        row.binds, row.reason))


class FleetTable(Static):
    """Draws `rows` (set by the screen each tick); `on_draw(rows, t)` hears of every frame drawn."""

    def __init__(self, *args, on_draw: Callable[[list[FleetRow], float], None] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows: list[FleetRow] = []
        self.sort_column = 0
        self.sort_reverse = False
        self.filter = ""
        self.selected: str | None = None          # the selected row's name
        self.on_draw = on_draw

    def shown(self, now: float) -> list[FleetRow]:
        rows = [row for row in self.rows if not self.filter or matches(row, self.filter)]
        column = COLUMNS[self.sort_column]

        def key(row: FleetRow):
            value = column.key(row, now)
            return (value is None, value if value is not None else 0, row.name)
        rows.sort(key=key, reverse=self.sort_reverse)
        return rows

    def selected_row(self, now: float) -> FleetRow | None:
        rows = self.shown(now)
        if not rows:
            return None
        for row in rows:
            if row.name == self.selected:
                return row
        self.selected = rows[0].name
        return rows[0]

    def move(self, delta: int) -> None:
        rows = self.shown(time.monotonic())
        if not rows:
            return
        names = [row.name for row in rows]
        i = names.index(self.selected) if self.selected in names else 0
        self.selected = names[max(0, min(len(names) - 1, i + delta))]
        self.refresh()

    def render(self) -> Text:
        now = time.monotonic()
        rows = self.shown(now)
        selected = self.selected_row(now)
        text = Text()
        for i, column in enumerate(COLUMNS):
            arrow = ("▼" if self.sort_reverse else "▲") if i == self.sort_column else ""
            text.append(f"{(column.name + arrow)[:column.width]:<{column.width}} ", style="bold reverse")
        text.append("\n")
        height = max(1, (self.size.height or 40) - 1)
        start = 0
        if selected is not None and selected in rows:
            start = max(0, rows.index(selected) - height + 1)
        for row in rows[start:start + height]:
            style = "reverse" if selected is not None and row.name == selected.name else ""
            for column in COLUMNS:
                cell = column.cell(row, now)
                cell_style = STATE_STYLE.get(row.state, "") if column.name == "state" else ""
                text.append(f"{cell[:column.width]:<{column.width}} ", style=f"{style} {cell_style}".strip())
            text.append("\n")
        if not rows:
            text.append(f"no engine matches the filter {self.filter!r} (/ to change it)" if self.filter
                        else "no engines")
        if self.on_draw is not None:
            self.on_draw(rows, time.monotonic())
        return text
