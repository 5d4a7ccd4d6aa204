"""Record events to JSON Lines and read them back.

A log is a header line, then one event per line (`Event.to_dict()`):

    {"kind": "Header", "schema_version": 1, "model": "tiny", "knobs": {...},
     "start_time": "2025-01-01T12:00:00.000000+00:00", "start_monotonic": 1234.5}
    {"kind": "RequestArrived", "step": 0, "t": 1234.6, "request_id": "r0", ...}

The engine thread only appends to a bounded buffer; a background thread
serialises and writes in batches every `flush_interval_s`, so disk I/O never
sits on the engine's path. If the writer falls behind by more than `maxlen`
events the oldest are dropped and an `EventsDropped` line says so: the log is
lossy then, but honest about it.

Reading tolerates a crash mid-write: an unparseable *last* line is skipped
(`LogReader.truncated` tells). Anything else wrong raises `LogFormatError`.
"""
from __future__ import annotations

import json
import os
import threading
import time
from datetime import datetime, timezone
from typing import IO, Callable, Iterable, Iterator

from .bus import EventBus, EventLog, Subscription
from .events import SCHEMA_VERSION, Event, event_from_dict

HEADER_KIND = "Header"
SUPPORTED_SCHEMA_VERSIONS = frozenset({1, 2, 3, 4, 5, 6, SCHEMA_VERSION})

# Version 1 lacked: StepPlanned's recompute split (its prefill counted recompute), PrefillChunk's
# recompute flag, RequestAdmitted's / RequestRetired's wait split, RequestRetired's num_blocks and
# StepFinished's num_padded_tokens.
# Upgrading fills them with "none seen"; the kinds added in version 2 never occur in a v1 log.
_V1_DEFAULTS = {
    "StepPlanned": {"recompute_tokens": 0, "num_recompute_rows": 0},
    "StepFinished": {"num_padded_tokens": 0},
    "PrefillChunk": {"recompute": False},
    "RequestAdmitted": {"wait_reasons": [], "wait_s": []},
    "RequestRetired": {"num_blocks": 0, "wait_reasons": [], "wait_s": []},
}
# Version 2 lacked prefix caching (the engine had none): nothing cached, and a RequestAdmitted's
# known tokens are unknown (0); the kinds added in version 3 never occur in an older log.
_V2_DEFAULTS = {
    "StepPlanned": {"kv_blocks_cached": 0},
    "StepFinished": {"kv_blocks_cached": 0},
    "EngineSnapshot": {"kv_blocks_cached": 0},
    "RequestAdmitted": {"num_known_tokens": 0, "num_cached_tokens": 0, "num_full_blocks": 0,
                        "num_hit_blocks": 0, "miss_reason": "", "num_matched_tokens": 0,
                        "evicted_ago_s": 0.0, "prefix_id": ""},
}

# Version 3 took a request's arrival to be the event that took it in.
_V3_DEFAULTS = {"RequestArrived": {"since_arrival_s": 0.0}}
# Version 4 stamped a server's request when it was handed to the engine: no input path before it.
_V4_DEFAULTS = {"RequestArrived": {"input_s": 0.0}}
# Version 5's snapshots did not say the requests' priorities and preemptions or retraction's estimate.
_V5_DEFAULTS = {"EngineSnapshot": {"priorities": [], "num_preemptions": [], "new_token_ratio": None}}
# Version 6 did not name a request's prompt blocks or the pool's free queue.
_V6_DEFAULTS = {"RequestArrived": {"prompt_blocks": []},
                "EngineSnapshot": {"prompt_blocks": [], "num_hit_blocks": [], "free_blocks": None}}


# What each version lacked, by version: an older event gets each later version's defaults in turn.
_LACKED = {1: _V1_DEFAULTS, 2: _V2_DEFAULTS, 3: _V3_DEFAULTS, 4: _V4_DEFAULTS, 5: _V5_DEFAULTS,
           6: _V6_DEFAULTS}


def upgrade(data: dict, version: int) -> dict:
    """A version-`version` event dict in the next version's schema."""
    defaults = _LACKED[version].get(data.get("kind"))
    return {**defaults, **data} if defaults else data


ALL_ENGINES = "*"                     # LogReader: every engine of a fleet recording, header as written
DEFAULT_RECORDER_MAXLEN = 100_000     # at the default 0.2 s flush: 500k events/s before loss

# Compact separators; default=str keeps an odd knob value (say an enum) from
# killing the writer thread: it is written as its str().
_encode = json.JSONEncoder(separators=(",", ":"), check_circular=False, default=str).encode


def encode_event(event: Event) -> str:
    """One compact JSON line (no newline) for an event: the log's and the wire's format."""
    return _encode(event.to_dict())


def decode_event(text: str | bytes, schema_version: int = SCHEMA_VERSION) -> Event:
    """Inverse of encode_event; ValueError on bad JSON, an unknown kind or missing fields. An event
    written under an older `schema_version` is upgraded to the current schema first."""
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"an event is a JSON object, got {type(data).__name__}")
    return event_of(data, schema_version)


def event_of(data: dict, schema_version: int = SCHEMA_VERSION) -> Event:
    """An event dict (as decoded from a line) as an event of the current schema."""
    for version in range(schema_version, SCHEMA_VERSION):
        data = upgrade(data, version)
    return event_from_dict(data)


class LogFormatError(ValueError):
    """The file is not a readable batchtop event log (message names file and line)."""


def make_header(model: str | None = None, knobs: dict | None = None, **extra) -> dict:
    """The header line of a log; `extra` keys (JSON values) are added as they are."""
    return {
        "kind": HEADER_KIND,
        "schema_version": SCHEMA_VERSION,
        "model": model,
        "knobs": dict(knobs or {}),
        "start_time": datetime.now(timezone.utc).isoformat(),
        "start_monotonic": time.monotonic(),
        **extra,
    }


class Recorder:
    """A sink (or bus subscriber) that writes a JSON Lines event log.

        rec = Recorder("run.jsonl", model="tiny", knobs=engine.knobs(), bus=bus)
        ...
        rec.close()            # writes what is left; also a context manager

    Without `bus`, the recorder itself is the sink: `Engine(cfg, sink=rec.sink)`
    (or `sink=rec`, one Python call slower).
    The header is written and flushed in the constructor, so even an empty run
    leaves a readable log. `close()` re-raises an error the writer thread met.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        model: str | None = None,
        knobs: dict | None = None,
        bus: EventBus | None = None,
        maxlen: int = DEFAULT_RECORDER_MAXLEN,
        flush_interval_s: float = 0.2,
        fsync: bool = False,
        header_extra: dict | None = None,
    ):
        self.path = os.fspath(path)
        self.header = make_header(model, knobs, **(header_extra or {}))
        self.flush_interval_s = flush_interval_s
        self.fsync = fsync
        self.num_written = 0
        self.error: BaseException | None = None
        self._file: IO[str] = open(self.path, "w", encoding="utf-8")
        self._file.write(_encode(self.header) + "\n")
        self._file.flush()
        self._source: Subscription | EventLog
        self.sink: Callable[[Event], None]
        if bus is not None:
            self._source = bus.subscribe(maxlen)
            self.sink = self._refuse
        else:
            self._source = EventLog(maxlen)
            self.sink = self._source.append
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="batchtop-recorder", daemon=True)
        self._thread.start()

    def __call__(self, event: Event) -> None:
        """Sink entry point (only when not attached to a bus): one locked deque append.

        `Recorder.sink` is the same without this extra call layer.
        """
        self.sink(event)

    @staticmethod
    def _refuse(event: Event) -> None:
        raise TypeError("this Recorder listens to a bus; publish to the bus, not to it")

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.flush_interval_s):
                self._write_pending()
        except BaseException as exc:     # keep it for close(); the engine must not notice
            self.error = exc
            if isinstance(self._source, Subscription):
                self._source.close()     # stop buffering for a writer that is gone

    def _write_pending(self) -> None:
        # The lock keeps drain-then-write atomic when flush() races the writer thread,
        # so batches reach the file in drain order.
        with self._flush_lock:
            events = self._source.drain()
            if not events:
                return
            self._file.write("".join([encode_event(e) + "\n" for e in events]))
            self._file.flush()
            if self.fsync:
                os.fsync(self._file.fileno())
            self.num_written += len(events)

    def flush(self) -> None:
        """Write everything buffered so far, from the calling thread (tests, checkpoints)."""
        if self.error is None and not self._closed:
            self._write_pending()

    def close(self) -> None:
        """Stop the writer, write what is left, close the file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join()
        if isinstance(self._source, Subscription):
            self._source.close()
        try:
            if self.error is None:
                self._write_pending()
        finally:
            self._file.close()
        if self.error is not None:
            raise RuntimeError(f"recorder for {self.path} failed: {self.error!r}") from self.error

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LogReader:
    """Reads a log lazily: `header` at construction, events by iteration.

        with LogReader("run.jsonl") as log:
            print(log.header["model"])
            for event in log: ...

    After iteration, `truncated` is True when an unparseable last line (a
    crash mid-write) was skipped.

    A fleet recording (many engines in one log, `telemetry/fleet_log.py`) is read one engine at a
    time: `engine=NAME` gives that engine's header (as a log of its own would have) and events; without
    it, LogFormatError names the engines to choose from. `engine=ALL_ENGINES` reads the header as written
    and every engine's events, `event_engine` naming the engine of the event just yielded.
    """

    def __init__(self, path: str | os.PathLike, engine: str | None = None):
        self.path = os.fspath(path)
        self.truncated = False
        self.engine = engine
        self.event_engine: str | None = None
        self._file = open(self.path, "rb")
        self._line_no = 0
        try:
            self.header = self._read_header()
            self._version = self.header["schema_version"]
            self._add_joined(self.header)
            self.header = self._engine_header(self.header)
        except BaseException:
            self._file.close()
            raise

    def _add_joined(self, header: dict) -> None:
        """A fleet recording: the engines that joined after it started go into `engines` too."""
        from .fleet_log import ENGINES_KEY, joined_engines
        if not isinstance(header.get(ENGINES_KEY), dict):
            return
        start = self._file.tell()
        joined = joined_engines(self._file)
        self._file.seek(start)
        for name, fields in joined.items():
            header[ENGINES_KEY].setdefault(name, fields)

    def _engine_header(self, header: dict) -> dict:
        from .fleet_log import engine_header, engine_names
        names = engine_names(header)
        if self.engine == ALL_ENGINES:
            return header
        if names is None:
            if self.engine is not None:
                raise LogFormatError(f"{self.path} is the log of one engine: it has no engine "
                                     f"{self.engine!r} to choose")
            return header
        if self.engine is None:
            raise LogFormatError(f"{self.path} records {len(names)} engines ({', '.join(names)}): "
                                 "choose one with --engine NAME")
        if self.engine not in names:
            raise LogFormatError(f"{self.path} has no engine {self.engine!r}; "
                                 f"its engines: {', '.join(names)}")
        return engine_header(header, self.engine)

    def _error(self, line_no: int, reason: str) -> LogFormatError:
        return LogFormatError(f"{self.path}:{line_no}: {reason}")

    def _read_header(self) -> dict:
        raw = self._file.readline()
        self._line_no = 1
        if not raw.strip():
            raise self._error(1, "empty file: no header line (not a batchtop event log)")
        try:
            header = json.loads(raw)
        except ValueError:
            raise self._error(1, "the header line is not JSON (not a batchtop event log, "
                                 "or a log cut before its header was complete)") from None
        if not isinstance(header, dict) or header.get("kind") != HEADER_KIND:
            raise self._error(1, "first line is not a Header record (not a batchtop event log)")
        version = header.get("schema_version")
        if version not in SUPPORTED_SCHEMA_VERSIONS:
            raise self._error(1, f"schema_version {version!r} is not supported by this reader "
                                 f"(supported: {sorted(SUPPORTED_SCHEMA_VERSIONS)})")
        return header

    def __iter__(self) -> Iterator[Event]:
        for raw in self._file:
            self._line_no += 1
            if not raw.strip():
                continue
            try:
                data = json.loads(raw)
                if not isinstance(data, dict):
                    raise ValueError(f"an event is a JSON object, got {type(data).__name__}")
                if self.engine is not None:
                    self.event_engine = data.pop("engine", None)
                    if self.event_engine != self.engine and self.engine != ALL_ENGINES:
                        continue
                    if data.get("kind") == HEADER_KIND:
                        continue              # a late engine's header entry (in self.header already)
                event = event_of(data, self._version)
            except (ValueError, TypeError) as exc:
                if self._rest_is_empty():
                    self.truncated = True
                    return
                raise self._error(self._line_no, f"corrupt event line: {exc}") from None
            yield event

    def _rest_is_empty(self) -> bool:
        """True when nothing but whitespace follows the current line."""
        return not any(chunk.strip() for chunk in iter(lambda: self._file.read(1 << 16), b""))

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> LogReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_header(path: str | os.PathLike) -> dict:
    """The header line of a log as written (a fleet recording's with all its engines)."""
    with LogReader(path, ALL_ENGINES) as log:
        return log.header


def iter_log(path: str | os.PathLike, engine: str | None = None) -> Iterator[Event]:
    """The events of a log, lazily (the header is checked before the first one)."""
    with LogReader(path, engine) as log:
        yield from log


def write_log(path: str | os.PathLike, header: dict, events: Iterable[Event]) -> str:
    """A whole log at once: the header line, then an event a line (what `read_log` reads back)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(header, separators=(",", ":"), default=str) + "\n")
        f.writelines(encode_event(e) + "\n" for e in events)
    return str(path)


def read_log(path: str | os.PathLike, engine: str | None = None) -> tuple[dict, list[Event]]:
    """(header, events) of a whole log (of one engine of a fleet recording); a truncated last line is
    skipped."""
    with LogReader(path, engine) as log:
        return log.header, list(log)
