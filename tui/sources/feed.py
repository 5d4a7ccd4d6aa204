"""FeedSource: events pushed by the caller (tests, synthetic streams), described as the caller says."""
from __future__ import annotations

from typing import Callable

from batchtop.telemetry.events import Event

from .base import Poll, Source, SourceDescription


class FeedSource(Source):
    """Events handed in by `push`; the next poll returns them. Optional fixed clock for `now`."""

    kind = "feed"

    def __init__(self, knobs: dict | None = None, meta: dict | None = None,
                 clock: Callable[[], float] | None = None, description: SourceDescription | None = None):
        super().__init__()
        self._description = description or SourceDescription(self.kind)
        self.knobs = dict(knobs or {})
        self.meta = dict(meta or {})
        self._pending: list[Event] = []
        self._clock = clock

    def push(self, events) -> None:
        self._pending.extend(events)

    def poll(self) -> Poll:
        events, self._pending = self._pending, []
        return Poll(events)

    def describe(self) -> SourceDescription:
        return self._description

    def now(self) -> float | None:
        return self._clock() if self._clock else None
