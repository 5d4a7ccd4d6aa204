"""The request table (htop-like, sortable, a selection) and the filterable event log.

Both draw only the rows that fit, so their cost per tick is bounded by the screen,
not by how many requests or events the model holds.
"""
from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.widgets import Static

from batchtop.telemetry.events import BatchRebuilt, Event, StepFinished, StepPlanned

from .model import SHORT_MISSES, SHORT_REASONS, DashboardModel, RequestView, fmt_seconds

STATE_ORDER = {"running": 0, "preempted": 1, "waiting": 2}
STATE_STYLE = {"running": "green", "preempted": "red", "waiting": "yellow", "abort": "bright_red"}
STEP_KINDS = (StepPlanned, StepFinished, BatchRebuilt)


def _natural(request_id: str) -> tuple:
    return (len(request_id), request_id)


@dataclass(frozen=True)
class Column:
    name: str
    width: int
    key: object            # RequestView, now, DashboardModel -> sortable value

    def sort_key(self, req: RequestView, now: float, model: DashboardModel):
        value = self.key(req, now, model)
        return (value is None, value if value is not None else 0)


def _waited(req: RequestView, now: float, model: DashboardModel) -> float | None:
    total = sum(model.waited(req, now).values())
    return total or None


def waited_cell(req: RequestView, now: float, model: DashboardModel) -> str:
    """Queue time and the reason it was mostly for: "2.3s kv"."""
    waited = model.waited(req, now)
    total = sum(waited.values())
    if total < 0.0005:
        return "-"
    main = max(waited, key=waited.get)
    return f"{fmt_seconds(total)} {SHORT_REASONS.get(main, main)}"


def cached_cell(req: RequestView) -> str:
    """Cached tokens and the miss reason, short: "384 part"."""
    miss = SHORT_MISSES.get(req.miss_reason, req.miss_reason)
    return f"{req.num_cached_tokens} {miss}".strip()


COLUMNS = (
    Column("id", 8, lambda r, now, m: _natural(r.request_id)),
    Column("state", 9, lambda r, now, m: (STATE_ORDER.get(r.state, 3), r.state)),
    Column("slot", 4, lambda r, now, m: r.slot if r.slot >= 0 else None),
    Column("prompt", 6, lambda r, now, m: r.num_prompt_tokens),
    Column("comp", 6, lambda r, now, m: r.num_computed_tokens),
    Column("cached", 10, lambda r, now, m: r.num_cached_tokens),
    Column("out", 5, lambda r, now, m: r.num_output_tokens),
    Column("kv", 4, lambda r, now, m: r.kv_blocks()),
    Column("waited", 13, _waited),
    Column("ttft", 6, lambda r, now, m: r.ttft_s),
    Column("age", 6, lambda r, now, m: r.age_s(now)),
    Column("pre", 3, lambda r, now, m: r.num_preemptions),
)


def cell_values(req: RequestView, now: float, model: DashboardModel) -> list[str]:
    kv = req.kv_blocks()
    return [
        req.request_id, req.state, str(req.slot) if req.slot >= 0 else "-",
        "-" if req.num_prompt_tokens is None else str(req.num_prompt_tokens),
        str(req.num_computed_tokens), cached_cell(req), str(req.num_output_tokens),
        "-" if kv is None else str(kv),
        waited_cell(req, now, model), fmt_seconds(req.ttft_s), fmt_seconds(req.age_s(now)),
        str(req.num_preemptions),
    ]


class RequestTable(Static):
    """Requests sorted by `sort_column`; `selected` is a request id that survives re-sorting."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.sort_column = 1                 # state: running first, like htop's busiest first
        self.sort_reverse = False
        self.show_finished = True
        self.selected: str | None = None
        self._top = 0
        self._ids: list[str] = []

    def sorted_requests(self) -> list[RequestView]:
        dash = self.screen
        model: DashboardModel = dash.model
        now = dash.now() or 0.0
        column = COLUMNS[self.sort_column]
        rows = model.requests(self.show_finished)
        tie = COLUMNS[0]
        rows.sort(key=lambda r: (column.sort_key(r, now, model), tie.sort_key(r, now, model)),
                  reverse=self.sort_reverse)
        return rows

    def move(self, delta: int) -> None:
        """Move the selection by `delta` rows (clamped)."""
        ids = self._ids or [r.request_id for r in self.sorted_requests()]
        if not ids:
            return
        index = ids.index(self.selected) if self.selected in ids else -1
        self.selected = ids[min(max(index + delta, 0), len(ids) - 1)]
        self.refresh()

    def render(self) -> Text:
        dash = self.screen
        model: DashboardModel = dash.model
        now = dash.now() or 0.0
        rows = self.sorted_requests()
        self._ids = [r.request_id for r in rows]
        if self.selected not in self._ids:
            self.selected = self._ids[0] if self._ids else None
        text = Text()
        for i, column in enumerate(COLUMNS):
            arrow = ("▼" if self.sort_reverse else "▲") if i == self.sort_column else ""
            name = column.name + arrow
            label = name.rjust(column.width) if i > 1 else name.ljust(column.width)
            text.append(label + " ", style="bold reverse" if i == self.sort_column else "bold")
        text.append(f"  {len(model.live)} live, {len(model.retired)} done\n", style="bright_black")
        visible = max(1, self.size.height - 1)
        index = self._ids.index(self.selected) if self.selected in self._ids else 0
        if index < self._top:
            self._top = index
        elif index >= self._top + visible:
            self._top = index - visible + 1
        self._top = max(0, min(self._top, max(0, len(rows) - visible)))
        for req in rows[self._top:self._top + visible]:
            values = cell_values(req, now, model)
            line = Text()
            for i, (column, value) in enumerate(zip(COLUMNS, values)):
                value = value[:column.width]
                line.append((value.ljust(column.width) if i <= 1 else value.rjust(column.width)) + " ",
                            style=STATE_STYLE.get(req.state, "") if i == 1 else "")
            if req.request_id == self.selected:
                line.stylize("reverse")
            text.append_text(line)
            text.append("\n")
        text.no_wrap = True
        return text


def event_line(event: Event) -> str:
    """`step kind field=value ...` without the time; tuples shown by their length."""
    d = event.to_dict()
    kind = d.pop("kind")
    step = d.pop("step")
    d.pop("t")
    parts = []
    for name, value in d.items():
        if isinstance(value, list):
            value = f"[{len(value)}]"
        elif isinstance(value, float):
            value = f"{value:.4g}"
        parts.append(f"{name}={value}")
    return f"{step:>6} {kind:<16} {' '.join(parts)}"


def event_request_id(event: Event) -> str | None:
    return getattr(event, "request_id", None)


class EventLogView(Static):
    """The newest events that pass the filters; `frozen` holds a copy while the engine runs on."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.kinds: tuple[str, ...] = ()        # lower-case substrings of kind names; empty: all
        self.request_id: str | None = None
        self.show_steps = False                 # StepPlanned/StepFinished/BatchRebuilt are loud
        self.frozen: list[Event] | None = None
        self.scroll_back = 0                    # lines up from the newest (frozen view)

    def matches(self, event: Event) -> bool:
        if not self.show_steps and type(event) in STEP_KINDS and not self.kinds:
            return False
        if self.kinds:
            name = type(event).__name__.lower()
            if not any(k in name for k in self.kinds):
                return False
        if self.request_id is not None:
            ids = getattr(event, "sampled_request_ids", None)
            if event_request_id(event) != self.request_id and not (ids and self.request_id in ids):
                return False
        return True

    def freeze(self, events: list[Event] | None) -> None:
        self.frozen = events
        self.scroll_back = 0

    def describe_filter(self) -> str:
        every = "all kinds" if self.show_steps else "all but step events"
        parts = [f"kinds={','.join(self.kinds)}" if self.kinds else every]
        if self.request_id:
            parts.append(f"request={self.request_id}")
        if self.frozen is not None:
            parts.append(f"FROZEN (-{self.scroll_back})")
        return " ".join(parts)

    def render(self) -> Text:
        model: DashboardModel = self.screen.model
        events = self.frozen if self.frozen is not None else model.log
        wanted = max(1, self.size.height - 1)
        skip = self.scroll_back
        picked: list[Event] = []
        for event in reversed(events):           # newest first; stop once the screen is full
            if self.matches(event):
                if skip:
                    skip -= 1
                    continue
                picked.append(event)
                if len(picked) >= wanted:
                    break
        text = Text(f"events: {self.describe_filter()}  (f kinds, / request, v freeze)\n", style="bold")
        for event in reversed(picked):
            text.append(event_line(event) + "\n", style=_event_style(event))
        text.no_wrap = True
        return text


def _event_style(event: Event) -> str:
    name = type(event).__name__
    if name in ("RequestPreempted", "RequestRetracted", "CommandRefused", "EventsDropped", "StepFailed"):
        return "red"
    if name == "KnobChanged":
        return "bold cyan"
    if name in ("RequestAdmitted", "FirstToken"):
        return "green"
    if name in STEP_KINDS_NAMES:
        return "bright_black"
    return ""


STEP_KINDS_NAMES = frozenset(k.__name__ for k in STEP_KINDS)
