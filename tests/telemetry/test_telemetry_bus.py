import threading

import pytest

from batchtop.telemetry.bus import EventBus, EventLog
from batchtop.telemetry.events import EnginePaused, EventsDropped


def ev(i):
    return EnginePaused(step=i, t=float(i))


def test_slow_subscriber_gets_drop_notice_then_newest():
    bus = EventBus()
    slow = bus.subscribe(maxlen=10)
    fast = bus.subscribe(maxlen=100)
    for i in range(25):
        bus.publish(ev(i))
    got = slow.drain()
    assert got[0] == EventsDropped(step=15, t=15.0, count=15)
    assert got[1:] == [ev(i) for i in range(15, 25)]
    assert slow.num_dropped_total == 15
    assert fast.drain() == [ev(i) for i in range(25)]


def test_drop_notice_only_once_and_counting_restarts():
    bus = EventBus()
    sub = bus.subscribe(maxlen=3)
    for i in range(5):
        bus.publish(ev(i))
    assert sub.drain()[0].count == 2
    assert sub.drain() == []
    for i in range(5, 7):
        bus.publish(ev(i))
    assert sub.drain() == [ev(5), ev(6)]
    for i in range(7, 12):
        bus.publish(ev(i))
    assert sub.drain() == [EventsDropped(step=9, t=9.0, count=2), ev(9), ev(10), ev(11)]


def test_subscriber_sees_only_events_after_subscribing():
    bus = EventBus()
    bus.publish(ev(0))
    sub = bus.subscribe(maxlen=5)
    bus.publish(ev(1))
    assert sub.drain() == [ev(1)]


def test_never_draining_subscriber_stays_bounded():
    bus = EventBus()
    sub = bus.subscribe(maxlen=1000)
    for i in range(100_000):
        bus.publish(ev(i))
    assert len(sub) == 1000
    got = sub.drain()
    assert got[0] == EventsDropped(step=99_000, t=99_000.0, count=99_000)
    assert got[1] == ev(99_000) and got[-1] == ev(99_999)
    assert len(got) == 1001


def test_unsubscribe_stops_delivery_and_keeps_buffer():
    bus = EventBus()
    with bus.subscribe(maxlen=5) as sub:
        bus.publish(ev(0))
        assert bus.num_subscribers == 1
    assert bus.num_subscribers == 0 and sub.closed
    bus.publish(ev(1))
    assert sub.drain() == [ev(0)]
    bus.unsubscribe(sub)     # idempotent


def test_history_for_late_joiners():
    bus = EventBus(history=4)
    for i in range(6):
        bus.publish(ev(i))
    assert bus.recent() == [ev(2), ev(3), ev(4), ev(5)]
    assert bus.recent(2) == [ev(4), ev(5)]
    late = bus.subscribe(maxlen=3, replay_history=True)
    bus.publish(ev(6))
    # replayed history counts as delivered: 3 replayed + 1 new into maxlen 3 -> one dropped
    assert late.drain() == [EventsDropped(step=4, t=4.0, count=1), ev(4), ev(5), ev(6)]
    plain = bus.subscribe(maxlen=3)
    assert plain.drain() == []


def test_bad_maxlen():
    with pytest.raises(ValueError):
        EventBus().subscribe(maxlen=0)
    with pytest.raises(ValueError):
        EventLog(maxlen=0)


def test_bus_is_a_sink():
    bus = EventBus()
    sub = bus.subscribe()
    sink = bus
    sink(ev(0))
    assert sub.drain() == [ev(0)]


def test_concurrent_publish_and_drain_lose_nothing_unaccounted():
    bus = EventBus()
    sub = bus.subscribe(maxlen=64)
    n = 50_000
    done = threading.Event()

    def engine():
        for i in range(n):
            bus.publish(ev(i))
        done.set()

    thread = threading.Thread(target=engine)
    thread.start()
    received, dropped = [], 0
    while not done.is_set() or len(sub):
        for e in sub.drain():
            if isinstance(e, EventsDropped):
                dropped += e.count
            else:
                received.append(e.step)
    thread.join()
    assert sub.drain() == []
    assert received == sorted(received)
    assert len(received) + dropped == n


def test_event_log_sink():
    log = EventLog(maxlen=2)
    for i in range(5):
        log(ev(i))
    assert log.drain() == [EventsDropped(step=3, t=3.0, count=3), ev(3), ev(4)]
    assert log.drain() == []
    unbounded = EventLog(maxlen=None)
    for i in range(5):
        unbounded.append(ev(i))
    assert unbounded.drain() == [ev(i) for i in range(5)]


def test_notify_once_per_burst_between_drains():
    """A sleeping consumer is woken when an event lands in its empty buffer: once per burst, not per event."""
    bus = EventBus()
    calls = []
    woken = bus.subscribe(notify=lambda: calls.append(len(calls)))
    plain = bus.subscribe()
    for i in range(5):
        bus.publish(ev(i))
    assert len(calls) == 1
    assert len(woken.drain()) == 5 and len(plain.drain()) == 5
    bus.publish(ev(5))
    bus.publish(ev(6))
    assert len(calls) == 2
    woken.drain()
    assert woken.drain() == [] and len(calls) == 2          # an empty drain wakes nobody
    log_calls = []
    log = EventLog(notify=lambda: log_calls.append(1))
    for i in range(3):
        log(ev(i))
    log.drain()
    log(ev(3))
    assert len(log_calls) == 2
