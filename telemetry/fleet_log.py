"""A fleet recording: the events of many engines in one JSON Lines log, each line named by its engine.

The header is a log header (`make_header`) with `engines`: name -> that engine's own header fields
(url, engine_kind, model, knobs, device, ..., `start_monotonic` on the engine's clock where known;
never `kind`, which names the line). Every event line
is the event's usual line with `"engine": NAME` first:

    {"kind": "Header", "schema_version": 4, "engines": {"rank 0": {"url": ..., "model": ...}, ...}, ...}
    {"engine": "rank 0", "kind": "StepPlanned", "step": 7, "t": 1234.5, ...}

An engine whose event stream starts after the recording did (down or not yet found then, or back
from down) is recorded from when it joins: its header entry is a line of its own, written then,

    {"engine": "rank 2", "kind": "Header", "url": ..., "model": ..., ...}

and the header names it in `waiting` (engines not streaming when the recording started). Engines seen
only through /metrics are not recorded: the header names them in `scraped` (name -> url).

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
FLEET_ONLY = ("waiting", "scraped")       # header keys about the fleet, not about any one engine
JOINED_KIND = "Header"                    # an event line of this kind is a late engine's header entry
_PER_ENGINE = ("model", "knobs", "start_monotonic")


def joined_engines(lines) -> dict[str, dict]:
    """The header entries of the engines that joined later, from a fleet recording's lines after its
    header (bytes); the lines are read only as far as telling a joiner's entry from an event."""
    import json
    marker = b'"kind":' + _encode(JOINED_KIND).encode()
    joined = {}
    for raw in lines:
        if marker in raw[:200]:
            try:
                data = json.loads(raw)
            except ValueError:
                continue                   # a cut last line: the reader reports it
            if isinstance(data, dict) and data.get("kind") == JOINED_KIND and "engine" in data:
                name = data.pop("engine")
                data.pop("kind")
                joined.setdefault(name, data)
    return joined


def engine_names(header: dict) -> list[str] | None:
    """The engines of a fleet recording's header, in their order; None for the log of one engine."""
    engines = header.get(ENGINES_KEY)
    return list(engines) if isinstance(engines, dict) else None


def engine_header(header: dict, name: str) -> dict:
    """The header a log of engine `name` alone would have, its name in `engine_name` (`engine` stays
    what the engine's own header says of its set-up, which the what-if reads)."""
    own = dict(header[ENGINES_KEY][name])
    out = {k: v for k, v in header.items() if k not in (ENGINES_KEY, *FLEET_ONLY)}
    out.update(own)
    out["engine_name"] = name
    out.setdefault("knobs", {})
    if own.get("start_monotonic") is None:
        out.pop("start_monotonic", None)         # unknown on the engine's clock: the first event's time
    return out


class FleetRecorder:
    """Writes a fleet recording. `write(name, events)` may be called from any thread (each engine's poll
    thread): one locked write and flush per batch."""

    def __init__(self, path: str | os.PathLike, engines: dict[str, dict], *,
                 waiting: dict[str, str] | None = None, scraped: dict[str, str] | None = None):
        self.path = os.fspath(path)
        self.header = make_header(None, {}, **{ENGINES_KEY: engines}, waiting=dict(waiting or {}),
                                  scraped=dict(scraped or {}))
        self.engines = list(engines)           # recorded so far, joiners included
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

    def join(self, name: str, fields: dict) -> None:
        """Engine `name` starts streaming now: its header entry, then its events (`write`) from here."""
        line = '{"engine":' + _encode(name) + ',"kind":' + _encode(JOINED_KIND) + "," + _encode(fields)[1:]
        with self._lock:
            if self._file is None or name in self.engines:
                return
            self._file.write(line + "\n")
            self._file.flush()
            self.engines.append(name)

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
