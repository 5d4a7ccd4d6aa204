"""Fan-out of engine events to subscribers with bounded buffers.

The engine thread calls `EventBus.publish(event)` (the bus is also callable, so
it can be handed over as the sink itself). Publishing never blocks on a
consumer: each subscriber owns a `collections.deque(maxlen=...)`, and when a
slow subscriber's buffer is full its oldest event is dropped. The next
`drain()` tells it so: its first item is `EventsDropped(step, t, count)`.

Drop accounting costs nothing per event beyond one counter: the bus numbers
what it publishes (`_seq`), each subscription remembers the number it had
reached at its last drain, so `published since - still buffered = dropped`.

A consumer that sleeps until there is something to drain gives `notify`: it is
called on the publisher's thread when an event lands in an empty buffer, so once
per burst between two drains, never per event. It must not block (a server's
`loop.call_soon_threadsafe`, a `threading.Event.set`).
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Iterable

from .events import Event, EventsDropped

DEFAULT_MAXLEN = 10_000

Sink = Callable[[Event], None]
Notify = Callable[[], None]


def _with_drop_notice(items: list[Event], num_dropped: int) -> list[Event]:
    """Prefix `items` with an EventsDropped when events were lost before them.

    The notice takes the step and time of the oldest event that survived: every
    event before that point in the stream (down to the previous drain) is gone.
    A buffer that dropped is full, so `items` is never empty here.
    """
    if num_dropped <= 0:
        return items
    first = items[0]
    return [EventsDropped(step=first.step, t=first.t, count=num_dropped), *items]


class Subscription:
    """One consumer's bounded buffer on an EventBus. Create with `EventBus.subscribe`."""

    __slots__ = ("_bus", "_buf", "_base_seq", "maxlen", "num_dropped_total", "closed", "notify")

    def __init__(self, bus: EventBus, maxlen: int, base_seq: int, initial: Iterable[Event] = (),
                 notify: Notify | None = None):
        self._bus = bus
        self._buf: deque[Event] = deque(initial, maxlen=maxlen)
        self._base_seq = base_seq       # bus sequence number the buffer's content starts after
        self.maxlen = maxlen
        self.num_dropped_total = 0      # over the subscription's life, for a status line
        self.closed = False
        self.notify = notify            # called when an event lands in the empty buffer

    def drain(self) -> list[Event]:
        """Every buffered event, oldest first; an EventsDropped first if some were lost.

        The buffer is swapped for an empty one under the bus lock (O(1)), so the
        publisher waits at most for that swap.
        """
        bus = self._bus
        with bus._lock:
            buf = self._buf
            if not buf and bus._seq == self._base_seq:
                return []
            self._buf = deque(maxlen=self.maxlen)
            num_published = bus._seq - self._base_seq
            self._base_seq = bus._seq
        items = list(buf)
        num_dropped = num_published - len(items)
        self.num_dropped_total += num_dropped
        return _with_drop_notice(items, num_dropped)

    def __len__(self) -> int:
        """Events waiting to be drained (at most maxlen)."""
        return len(self._buf)

    def close(self) -> None:
        self._bus.unsubscribe(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class EventBus:
    """Publish/subscribe hub between the engine (one publisher) and its viewers.

    `history` > 0 keeps the last `history` events in a ring so that a late
    joiner can start with recent context: `subscribe(replay_history=True)` or
    `recent()`.
    """

    def __init__(self, history: int = 0):
        self._lock = threading.Lock()
        self._subs: tuple[Subscription, ...] = ()   # replaced, never mutated: publish iterates it
        self._seq = 0                                # events published while anyone listened
        self._history: deque[Event] | None = deque(maxlen=history) if history > 0 else None

    def publish(self, event: Event) -> None:
        """The engine's sink: O(number of subscribers), never blocks on a consumer."""
        # Unlocked read: a subscriber that joins concurrently simply starts after this event.
        if not self._subs and self._history is None:
            return
        # acquire/release rather than `with`: measurably cheaper per call on CPython 3.11
        lock = self._lock
        lock.acquire()
        try:
            self._seq += 1
            for sub in self._subs:
                buf = sub._buf
                if not buf and sub.notify is not None:
                    sub.notify()
                buf.append(event)
            if self._history is not None:
                self._history.append(event)
        finally:
            lock.release()

    __call__ = publish

    def subscribe(self, maxlen: int = DEFAULT_MAXLEN, *, replay_history: bool = False,
                  notify: Notify | None = None) -> Subscription:
        """A new bounded buffer receiving every event published from now on.

        With `replay_history`, the buffer starts with the ring's recent events
        (the newest `maxlen` of them). `notify`: see the module's docstring.
        """
        if maxlen < 1:
            raise ValueError(f"maxlen must be >= 1, got {maxlen}")
        with self._lock:
            initial = list(self._history) if (replay_history and self._history) else []
            initial = initial[-maxlen:]
            # Count the replayed events as published to this subscriber, none dropped.
            sub = Subscription(self, maxlen, self._seq - len(initial), initial, notify)
            self._subs = (*self._subs, sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """Stop feeding `sub`; idempotent. Events still buffered remain drainable."""
        with self._lock:
            self._subs = tuple(s for s in self._subs if s is not sub)
            sub.closed = True

    def recent(self, n: int | None = None) -> list[Event]:
        """The last `n` (default: all kept) events of the history ring, oldest first."""
        with self._lock:
            events = list(self._history) if self._history is not None else []
        return events if n is None else events[-n:] if n > 0 else []

    @property
    def num_subscribers(self) -> int:
        return len(self._subs)


class EventLog:
    """A standalone bounded sink with the same drop semantics as a Subscription.

    For one consumer and no bus: `engine = Engine(cfg, sink=log)`, then
    `log.drain()` from any thread. Also handy in tests (`maxlen=None`: unbounded).
    """

    __slots__ = ("_lock", "_buf", "_num_appended", "maxlen", "num_dropped_total", "notify")

    def __init__(self, maxlen: int | None = DEFAULT_MAXLEN, notify: Notify | None = None):
        if maxlen is not None and maxlen < 1:
            raise ValueError(f"maxlen must be >= 1 or None, got {maxlen}")
        self._lock = threading.Lock()
        self._buf: deque[Event] = deque(maxlen=maxlen)
        self._num_appended = 0          # since the last drain
        self.maxlen = maxlen
        self.num_dropped_total = 0
        self.notify = notify            # as a Subscription's: called when an event lands in the empty buffer

    def append(self, event: Event) -> None:
        lock = self._lock
        lock.acquire()
        try:
            self._num_appended += 1
            buf = self._buf
            if not buf and self.notify is not None:
                self.notify()
            buf.append(event)
        finally:
            lock.release()

    __call__ = append

    def drain(self) -> list[Event]:
        with self._lock:
            buf, num_appended = self._buf, self._num_appended
            self._buf = deque(maxlen=self.maxlen)
            self._num_appended = 0
        items = list(buf)
        num_dropped = num_appended - len(items)
        self.num_dropped_total += num_dropped
        return _with_drop_notice(items, num_dropped)

    def __len__(self) -> int:
        return len(self._buf)
