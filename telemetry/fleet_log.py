"""A fleet recording: the events of many engines in one JSON Lines log, each line named by its engine.

The header is a log header (`make_header`) with `engines`: name -> that engine's own header fields
(url, model, knobs, device, ..., `start_monotonic` on the engine's clock where known). Every event line
is the event's usual line with `"engine": NAME` first:

    {"kind": "Header", "schema_version": 4, "engines": {"rank 0": {"url": ..., "model": ...}, ...}, ...}
    {"engine": "rank 0", "kind": "StepPlanned", "step": 7, "t": 1234.5, ...}

`LogReader(path, engine=NAME)` (and so `read_log`, replay, export and what-if with `--engine`) reads one
engine back as a log of its own; `read_fleet_log` reads all of them.
"""
from __future__ import annotations

import os
import threading
from typing import IO

from .events import Event
from .recorder import _encode, encode_event, make_header

ENGINES_KEY = "engines"
_PER_ENGINE = ("model", "knobs", "start_monotonic")


def engine_names(header: dict) -> list[str] | None:
    """The engines of a fleet recording's header, in their order; None for the log of one engine."""
    engines = header.get(ENGINES_KEY)
    return list(engines) if isinstance(engines, dict) else None


def engine_header(header: dict, name: str) -> dict:
    """The header a log of engine `name` alone would have (its engine named in `engine`)."""
    own = dict(header[ENGINES_KEY][name])
    out = {k: v for k, v in header.items() if k != ENGINES_KEY}
    out.update(own)
    out["engine"] = name
    out.setdefault("knobs", {})
    if own.get("start_monotonic") is None:
        out.pop("start_monotonic", None)         # unknown on the engine's clock: the first event's time
    return out


class FleetRecorder:
    """Writes a fleet recording. `write(name, events)` may be called from any thread (each engine's poll
    thread): one locked write and flush per batch."""

    def __init__(self, path: str | os.PathLike, engines: dict[str, dict]):
        self.path = os.fspath(path)
        self.header = make_header(None, {}, **{ENGINES_KEY: engines})
        self.num_written = 0
        self._lock = threading.Lock()
        self._file: IO[str] | None = open(self.path, "w", encoding="utf-8")
        self._file.write(_encode(self.header) + "\n")
        self._file.flush()

    def write(self, name: str, events: list[Event]) -> None:
        prefix = '{"engine":' + _encode(name) + ","
        text = "".join(prefix + encode_event(e)[1:] + "\n" for e in events)
        with self._lock:
            if self._file is None:
                return
            self._file.write(text)
            self._file.flush()
            self.num_written += len(events)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_fleet_log(path: str | os.PathLike) -> tuple[dict, dict[str, tuple[dict, list[Event]]]]:
    """(header, engine name -> (its header, its events)) of a fleet recording, in one pass;
    LogFormatError when the log is not one."""
    from .recorder import ALL_ENGINES, LogFormatError, LogReader
    with LogReader(path, ALL_ENGINES) as log:
        header = log.header
        names = engine_names(header)
        if names is None:
            raise LogFormatError(f"{path} is not a fleet recording (its header names no engines)")
        events: dict[str, list[Event]] = {name: [] for name in names}
        for event in log:
            kept = events.get(log.event_engine)
            if kept is None:
                raise LogFormatError(f"{path}: an event of engine {log.event_engine!r}, which the header "
                                     "does not name")
            kept.append(event)
    return header, {name: (engine_header(header, name), events[name]) for name in names}
