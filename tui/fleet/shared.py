"""`SharedSource`: one fleet engine's source, as its full dashboard sees it while the fleet keeps
following it.

The engine's poll thread stays the only reader of the real source; this stand-in receives what it
drains (a tap on the `Member`) and starts with the events the member kept, so the dashboard opens with
recent history rather than blank. Everything else (status, knobs, commands, recording) is the real
source's.
"""
from __future__ import annotations

import threading

from ..sources import Poll, Source


class SharedSource(Source):
    def __init__(self, member):
        self._member = member
        self._source = member.source
        self._lock = threading.Lock()
        self._pending = member.kept_events()
        self._reset = True
        member.tap(self._take)

    def __getattr__(self, name):          # what Source does not define: the real source's own
        return getattr(self._source, name)

    def _take(self, member, events, reset: bool) -> None:
        with self._lock:
            if reset:
                self._pending, self._reset = [], True
            self._pending.extend(events)

    def start(self) -> SharedSource:
        return self                       # the member started the real source

    def poll(self) -> Poll:
        with self._lock:
            events, self._pending = self._pending, []
            reset, self._reset = self._reset, False
        return Poll(events, reset)

    def close(self) -> None:
        """Leaves the real source running: the fleet still follows it."""
        self._member.untap(self._take)


def _forward(name):
    def call(self, *args, **kwargs):
        return getattr(self._source, name)(*args, **kwargs)
    call.__name__ = name
    return call


def _forward_property(name):
    return property(lambda self: getattr(self._source, name))


# Every method and attribute the dashboard may ask of a Source, but poll and close, is the real one's.
for _name, _value in list(vars(Source).items()):
    if _name.startswith("_") or _name in ("poll", "close", "start"):
        continue
    if callable(_value):
        setattr(SharedSource, _name, _forward(_name))
    else:
        setattr(SharedSource, _name, _forward_property(_name))
for _name in ("meta", "knobs"):
    setattr(SharedSource, _name, _forward_property(_name))
