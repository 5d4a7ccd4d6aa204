"""`Member`: one engine of the fleet, followed on its own thread so that a slow or dead engine never
holds the screen.

The thread finds out what answers at the URL (`detect`: batchtop's event stream, else a vLLM or SGLang
`/metrics`), builds the source the single-engine dashboard would use (`RemoteSource` or
`MetricsSource`), and then drains it into a `DashboardModel` and `StepStats` and publishes the engine's
rows (`rows`: immutable, read by the UI thread; `on_rows` is told). An event stream wakes the thread
when events arrive (at most every 20 ms, every 0.5 s without any); a scrape is polled every `poll_s`.
Nothing answering, or a server gone, is a row marked down with the reason; the thread (and the
sources' own) retry with backoff.

While a recording runs, every event drained is also handed to it under the engine's name; while the
engine's full dashboard is open, to `SharedSource` too (the dashboard folds its own model from it).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import replace
from typing import Callable

from ..model import DashboardModel
from ..sources import Poll, Source
from .rows import FleetRow, StepRecord, StepStats, event_row, scraped_row
from .targets import Target

KIND_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
MAX_KEPT_EVENTS = 20_000        # handed to a dashboard opened later, so it starts with recent history
POLL_S = 0.02                   # a scrape's source is drained this often (it fetches once a `period_s`)
POLL_GAP_S = 0.02               # an event source woken sooner waits this long after its last drain
ROW_EVERY_S = 0.5               # without new events the row is rebuilt this often (ages, decaying rates)


class Member:
    def __init__(self, target: Target, api_key: str | None = None, *, poll_s: float = POLL_S,
                 period_s: float = 1.0, backoff_s: tuple[float, float] = (0.5, 8.0)):
        self.target = target
        self.name, self.url = target.name, target.url
        self.api_key = api_key
        self.poll_s, self.period_s, self.backoff_s = poll_s, period_s, backoff_s
        self.source: Source | None = None
        self.flavour: str | None = None               # "events", "vllm" or "sglang" once detected
        self.model = DashboardModel()
        self.stats = StepStats()
        self.rows: tuple[FleetRow, ...] = (FleetRow(target.name, target.url, rank=target.rank),)
        self.steps: tuple[StepRecord, ...] = ()
        self.note = ""                                # the last command's answer, shown in the row
        self.version = 0                              # bumped whenever `rows` changes
        self.on_rows: Callable[[], None] | None = None  # told on this thread when `rows` changes
        self._base = self.rows[0]
        self._kept: deque = deque(maxlen=MAX_KEPT_EVENTS)
        self._taps: list = []                          # callables(events) fed from the poll thread
        self._tap_reset = False                        # a reset not yet told to the taps (no events came)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._woken = threading.Event()               # the event source has events to drain
        self._thread: threading.Thread | None = None
        self._scrape_key: tuple | None = None
        self._row_at = float("-inf")

    # -- the thread --------------------------------------------------------------------------

    def start(self) -> Member:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"batchtop-fleet-{self.name}", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        delay = self.backoff_s[0]
        while not self._stop.is_set():
            if self.source is None:
                error = self._connect()
                if error is not None:
                    self._publish_down(error, time.monotonic() + delay)
                    self._stop.wait(delay)
                    delay = min(delay * 2, self.backoff_s[1])
                    continue
            self._woken.clear()               # before draining: what arrives after it wakes us again
            try:
                self.poll()
            except Exception as error:        # a bug in folding is shown in the row, never kills the thread
                self._publish_down(f"{type(error).__name__}: {error}", None)
            if self.flavour == "events":
                self._stop.wait(POLL_GAP_S)
                self._woken.wait(ROW_EVERY_S)
            else:
                self._stop.wait(self.poll_s)

    def _connect(self) -> str | None:
        """Detect and build the source; the reason as text when nothing usable answers."""
        from ..sources.remote import RemoteSource
        from ..sources.scrape import MetricsSource, NotAServer, detect
        try:
            flavour = detect(self.url, self.api_key, timeout_s=min(5.0, self.backoff_s[1]))
        except NotAServer as error:
            return str(error)
        if flavour == "events":
            source = RemoteSource(self.url, self.api_key, notify=self._woken.set).start()
        else:
            source = MetricsSource(self.url, flavour, self.api_key, period_s=self.period_s).start()
        if self._stop.is_set():
            source.close()
            return "closed"
        self.flavour, self.source = flavour, source
        return None

    def poll(self) -> None:
        """Drain the source once and publish the rows (the poll thread; tests call it directly)."""
        source = self.source
        if source is None:
            return
        if self.flavour == "events":
            self._poll_events(source)
        else:
            self._poll_scrape(source)

    def _poll_events(self, source) -> None:
        poll: Poll = source.poll()
        if poll.reset:
            self.model, self.stats = DashboardModel(knobs=dict(source.knobs)), StepStats()
            with self._lock:
                self._kept.clear()
                # told to the taps with the next events; a reset before any tap (the first hello)
                # is no restart to a recording that starts later
                self._tap_reset = bool(self._taps)
        if not self.model.knobs and source.knobs:
            self.model.knobs.update(source.knobs)
        events = poll.events
        if events:
            self.model.feed(events)
            self.stats.feed(events)
            with self._lock:
                self._kept.extend(events)
                taps = list(self._taps)
            reset, self._tap_reset = self._tap_reset, False
            for tap in taps:
                tap(self, events, reset)
            self.steps = tuple(self.stats.steps)
        if not events and not poll.reset and time.monotonic() - self._row_at < ROW_EVERY_S:
            return
        self._row_at = time.monotonic()
        now = source.now()
        if now is not None:
            self.model.advance(now)
        base = self._base_row(source, events)
        row = event_row(base, self.model, self.stats, now)
        if row != self.rows[0] or len(self.rows) != 1:
            self._set_rows((row,))

    def _poll_scrape(self, source) -> None:
        key = (source.version, source.connected, self.note)
        if key == self._scrape_key:
            return
        self._scrape_key = key
        views = source.snapshot()
        base = self._base_row(source, None)
        if not views:
            self._set_rows((base,))
            return
        many = len(views) > 1
        rows = tuple(scraped_row(replace(base, name=f"{self.name} {key}" if many else self.name), view)
                     for key, view in views.items())
        self._set_rows(rows)

    def _base_row(self, source, events) -> FleetRow:
        """Name, kind, mode, state and age; the numbers are filled by event_row / scraped_row."""
        kind = self.kind()
        if self.flavour == "events":
            connected = source.connected
            state = "paused" if connected and source.paused else "live" if connected else "down"
        else:
            connected = source.connected
            state = "live" if connected else "down" if source.last_error else "connecting"
        data_at = self._base.data_at
        if events or self.flavour != "events" and source.last_scrape is not None:
            data_at = time.monotonic() if events else source.last_scrape.t
        reason = "" if connected else source.status()
        self._base = FleetRow(self.name, self.url, kind=kind, state=state, reason=reason or self.note,
                              data_at=data_at, rank=self.target.rank)
        return self._base

    def kind(self) -> str:
        """What answers at the URL, in words: batchtop serve, batchtop-in-vLLM, vLLM, SGLang."""
        if self.flavour == "events" and self.source is not None:
            inside = str(self.source.meta.get("device", "")).startswith("vllm")
            return "batchtop-in-vLLM" if inside else "batchtop serve"
        return KIND_NAMES.get(self.flavour, self.flavour or "?")

    def _publish_down(self, reason: str, retry_at: float | None) -> None:
        wait = f"; retrying in {max(0.0, retry_at - time.monotonic()):.1f} s" if retry_at else ""
        row = replace(self.rows[0], state="down", reason=reason + wait)
        self._set_rows((row,))

    def _set_rows(self, rows: tuple[FleetRow, ...]) -> None:
        self.rows = rows
        self.version += 1
        on_rows = self.on_rows
        if on_rows is not None:
            on_rows()

    # -- what the screen asks ------------------------------------------------------------------

    def tap(self, callback) -> None:
        """Call `callback(member, events, reset)` with every batch of events drained from now on."""
        with self._lock:
            self._taps.append(callback)

    def untap(self, callback) -> None:
        with self._lock:
            if callback in self._taps:
                self._taps.remove(callback)

    def kept_events(self) -> list:
        with self._lock:
            return list(self._kept)

    def say(self, note: str) -> None:
        """Show a command's answer in this engine's row (until the engine's state says more)."""
        self.note = note
        self._base = replace(self._base, reason=note if self._base.state != "down" else self._base.reason)
        self._set_rows(tuple(replace(row, reason=self._base.reason) for row in self.rows))

    def close(self) -> None:
        self._stop.set()
        self._woken.set()
        if self._thread is not None:
            self._thread.join(10)
        if self.source is not None:
            self.source.close()
