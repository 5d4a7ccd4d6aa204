"""The dashboard over any vLLM or SGLang: `/metrics` scraped at a fixed period, deltas per interval.

`detect(url)` finds out what answers at a URL: batchtop's event stream (`batchtop serve`, or
batchtop's scheduler class inside vLLM: `GET /v1/knobs`), else Prometheus text on `/metrics`
with `vllm:` or `sglang:` names, else a `NotAServer` naming what it tried.

`MetricsSource` scrapes on a thread every `period_s`, parses each exposition
(`telemetry.exposition`) and turns consecutive scrapes into one `Interval` per engine
(`telemetry.intervals`). It hands the dashboard no events (a stock server has none): the
dashboard's scrape panels read `snapshot()` (engine -> `EngineView`: latest snapshot, intervals, run
totals). A server that goes away is retried with exponential backoff; one that comes back
with lower counters (a restart) gives an interval marked `reset`, never a negative rate.
Knobs are read-only: `/metrics` has none.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import httpx

from batchtop.telemetry.exposition import Scrape, ScrapedEngine, detect_flavour, parse_exposition
from batchtop.telemetry.intervals import Interval, derive

from .base import Source, SourceDescription, disconnected

MAX_INTERVALS = 3600                 # per engine: an hour at the default period
SCHEDULER_HINT = ("start vLLM with --scheduler-cls batchtop.engine.vllm.scheduler.BatchtopScheduler and "
                  "BATCHTOP_EVENTS_PORT set, and point batchtop top at that port")
READ_ONLY_WHY = ("knobs are read-only over /metrics (a stock server exports none and takes no commands); "
                 + SCHEDULER_HINT)
NO_PAUSE_WHY = f"a stock server cannot be paused or stepped from /metrics; {SCHEDULER_HINT}"


class NotAServer(Exception):
    """Nothing batchtop can show answers at the URL; the message says what was tried."""


def detect(url: str, api_key: str | None = None, timeout_s: float = 5.0) -> str:
    """"events" (batchtop's event stream), "vllm" or "sglang"; NotAServer otherwise."""
    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    tried = []
    with httpx.Client(base_url=url, headers=headers, timeout=timeout_s) as client:
        try:
            knobs = client.get("/v1/knobs")
        except httpx.HTTPError as error:
            raise NotAServer(f"nothing answers at {url}: {type(error).__name__}: {error}") from None
        if knobs.status_code == 200 and _is_json_with(knobs, "knobs"):
            return "events"
        wants_key = " (the server wants an API key: --api-key)" if knobs.status_code == 401 else ""
        tried.append(f"GET /v1/knobs (batchtop's event stream): HTTP {knobs.status_code}{wants_key}")
        try:
            metrics = client.get("/metrics")
        except httpx.HTTPError as error:
            raise NotAServer(f"{url} stopped answering: {type(error).__name__}: {error}") from None
        if metrics.status_code == 200:
            try:
                flavour = detect_flavour(metrics.text)
            except ValueError as error:
                tried.append(f"GET /metrics: not Prometheus text ({error})")
            else:
                if flavour is not None:
                    return flavour
                tried.append("GET /metrics: Prometheus text without vllm: or sglang: series")
        else:
            tried.append(f"GET /metrics (vLLM or SGLang): HTTP {metrics.status_code}")
    raise NotAServer(f"{url} is neither batchtop's event stream nor a vLLM or SGLang server; tried "
                     + "; ".join(tried))


def _is_json_with(response: httpx.Response, key: str) -> bool:
    try:
        return key in response.json()
    except ValueError:
        return False


@dataclass
class EngineView:
    """One engine as the dashboard shows it: the latest snapshot, its intervals, run totals."""
    engine: str
    latest: ScrapedEngine
    intervals: deque = field(default_factory=lambda: deque(maxlen=MAX_INTERVALS))
    # retired, generation_tokens, ... since the first scrape
    totals: dict[str, float] = field(default_factory=dict)
    num_resets: int = 0

    def add(self, interval: Interval) -> None:
        self.intervals.append(interval)
        self.num_resets += interval.reset
        for name in ("steps", "admitted", "retired", "preemptions", "prompt_tokens", "generation_tokens"):
            value = getattr(interval, name)
            if value is not None:
                self.totals[name] = self.totals.get(name, 0.0) + value


class MetricsSource(Source):
    kind = "metrics"
    DESCRIPTION = SourceDescription(kind, events=False, why_not={
        "pause": NO_PAUSE_WHY, "step": NO_PAUSE_WHY, "knobs": READ_ONLY_WHY, "abort": READ_ONLY_WHY,
        "scenarios": READ_ONLY_WHY, "record": "a scrape has no events to record; " + SCHEDULER_HINT})

    def __init__(self, url: str, flavour: str, api_key: str | None = None, *, period_s: float = 1.0,
                 backoff_s: tuple[float, float] = (0.5, 8.0), timeout_s: float = 5.0,
                 clock=time.monotonic):
        super().__init__()
        if period_s <= 0:
            raise ValueError(f"the scrape period must be > 0 s, got {period_s}")
        self.url = url.rstrip("/")
        self.flavour = flavour
        self.period_s = period_s
        self.backoff_s = backoff_s
        self._client = httpx.Client(base_url=self.url, timeout=timeout_s,
                                    headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.engines: dict[str, EngineView] = {}
        self.last_scrape: Scrape | None = None
        self.last_text: str | None = None
        self.connected = False
        self.last_error: str | None = None
        self.retry_at: float | None = None
        self.num_scrapes = 0
        self.version = 0                 # bumped by every successful scrape (the app redraws on change)

    # -- scraping ------------------------------------------------------------------------------

    def scrape_once(self) -> Scrape:
        """GET /metrics, parse, fold into the engines; raises httpx.HTTPError or ValueError."""
        response = self._client.get("/metrics")
        if response.status_code != 200:
            raise ValueError(f"GET /metrics: HTTP {response.status_code}")
        now = self._clock()
        scrape = parse_exposition(response.text, now, self.flavour)
        with self._lock:
            self._fold(scrape)
            self.last_scrape, self.last_text = scrape, response.text
            self.num_scrapes += 1
            self.version += 1
        self.connected, self.last_error = True, None
        return scrape

    def _fold(self, scrape: Scrape) -> None:
        previous = self.last_scrape
        for key, snapshot in scrape.engines.items():
            view = self.engines.get(key)
            if view is None:
                self.engines[key] = EngineView(key, snapshot)
                continue
            view.add(derive(view.latest, snapshot, scrape.t, scrape.t - previous.t if previous else 0.0))
            view.latest = snapshot

    def start(self) -> MetricsSource:
        if self._thread is None:
            self._thread = threading.Thread(target=self._follow, name="batchtop-metrics", daemon=True)
            self._thread.start()
        return self

    def _follow(self) -> None:
        delay = self.backoff_s[0]
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.scrape_once()
            except (httpx.HTTPError, OSError, ValueError) as error:
                self.connected = False
                self.last_error = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
                self.retry_at = time.monotonic() + delay
                self._stop.wait(delay)
                self.retry_at = None
                delay = min(delay * 2, self.backoff_s[1])
                continue
            delay = self.backoff_s[0]
            self._stop.wait(max(0.0, self.period_s - (time.monotonic() - started)))

    # -- what the app reads ----------------------------------------------------------------------

    def snapshot(self) -> dict[str, EngineView]:
        """The engines, copied under the lock (the scraper thread keeps folding)."""
        with self._lock:
            return {key: EngineView(view.engine, view.latest, deque(view.intervals, maxlen=MAX_INTERVALS),
                                    dict(view.totals), view.num_resets)
                    for key, view in self.engines.items()}

    def status(self) -> str:
        if self.connected:
            return f"live · {self.flavour} /metrics every {self.period_s:g} s · {self.url}"
        return disconnected(self.url, self.last_error, self.retry_at)

    def describe(self) -> SourceDescription:
        return self.DESCRIPTION

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self._client.close()
