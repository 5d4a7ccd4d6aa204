"""Overhead of the telemetry path, per event: `python -m batchtop.telemetry.bench`.

Prints a Markdown table (copied into docs/events.md, "Overhead"). Each figure
is the best of `--repeat` runs over `--n` events, on the calling thread.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from typing import Callable

from .bus import EventBus, EventLog
from .events import Event, FirstToken, PrefillChunk, RequestAdmitted, StepFinished, StepPlanned
from .flight import FlightRecorder
from .recorder import Recorder, encode_event


def sample_events(batch_rows: int = 32) -> list[Event]:
    """One decode step of a `batch_rows`-row batch plus a few request events: a typical mix."""
    ids = tuple(f"req-{i:06d}" for i in range(batch_rows))
    return [
        StepPlanned(step=1000, t=1.0, prefill_tokens=0, decode_tokens=batch_rows, num_prefill_rows=0,
                    num_decode_rows=batch_rows, num_padding_rows=0, token_budget=2048, num_running=batch_rows,
                    num_waiting=3, kv_blocks_used=812, kv_blocks_total=4096, recompute_tokens=0,
                    num_recompute_rows=0),
        RequestAdmitted(step=1000, t=1.0, request_id="req-000123", slot=5, num_computed_tokens=0,
                        resumed=False),
        PrefillChunk(step=1000, t=1.0, request_id="req-000123", num_tokens=512, num_computed_tokens=512,
                     num_known_tokens=512),
        StepFinished(step=1000, t=1.01, num_rows=batch_rows, num_tokens=batch_rows, sampled_request_ids=ids,
                     num_running=batch_rows, num_waiting=3, kv_blocks_used=812, kv_blocks_total=4096,
                     schedule_s=1e-4, prepare_s=2e-4, forward_s=8e-3, sample_s=3e-4, update_s=1e-4),
        FirstToken(step=1000, t=1.01, request_id="req-000123", ttft_s=0.25),
    ]


def _per_event_ns(fn: Callable[[list[Event]], None], events: list[Event], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter_ns()
        fn(events)
        best = min(best, time.perf_counter_ns() - start)
    return best / len(events)


def measure(n: int = 200_000, repeat: int = 5) -> list[tuple[str, float]]:
    mix = sample_events()
    events = (mix * (n // len(mix) + 1))[:n]
    rows: list[tuple[str, float]] = []

    def loop(sink):
        def run(evs):
            for e in evs:
                sink(e)
        return run

    rows.append(("plain function call (baseline: `sink(e)` doing nothing)",
                 _per_event_ns(loop(lambda e: None), events, repeat)))
    for num_subs in (0, 1, 3):
        bus = EventBus()
        subs = [bus.subscribe(maxlen=10_000) for _ in range(num_subs)]   # full: appends also evict
        rows.append((f"`EventBus.publish`, {num_subs} subscriber(s), never drained",
                     _per_event_ns(loop(bus.publish), events, repeat)))
        del subs
    bus = EventBus(history=10_000)
    rows.append(("`EventBus.publish`, 0 subscribers, history ring 10k",
                 _per_event_ns(loop(bus.publish), events, repeat)))

    bus = EventBus()
    sub = bus.subscribe(maxlen=10_000)

    def publish_and_drain(evs):
        for i, e in enumerate(evs):
            bus.publish(e)
            if i % 1000 == 999:
                sub.drain()
    rows.append(("`EventBus.publish` + `drain()` every 1000 events, 1 subscriber",
                 _per_event_ns(publish_and_drain, events, repeat)))
    rows.append(("`FlightRecorder.tee(None)` (the engine's sink with no other)",
                 _per_event_ns(loop(FlightRecorder().tee(None)), events, repeat)))
    bus = EventBus()
    sub = bus.subscribe(maxlen=10_000)
    rows.append(("`FlightRecorder.tee(bus.publish)`, 1 subscriber (the engine's sink in the dashboard)",
                 _per_event_ns(loop(FlightRecorder().tee(bus.publish)), events, repeat)))
    sub.close()
    log = EventLog(maxlen=None)
    rows.append(("`EventLog.append` (standalone sink)",
                 _per_event_ns(loop(log.append), events, repeat)))
    log.drain()

    rows.append(("`to_dict` + JSON encode (writer thread work)",
                 _per_event_ns(lambda evs: [encode_event(e) for e in evs], events, repeat)))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.jsonl")
        rec = Recorder(path, model="bench", flush_interval_s=3600, maxlen=n + 1)
        writer_ns = []

        def timed_sink(evs):
            for e in evs:
                rec.sink(e)
        best_sink = float("inf")
        for _ in range(repeat):
            best_sink = min(best_sink, _per_event_ns(timed_sink, events, 1))
            start = time.perf_counter_ns()
            rec.flush()
            writer_ns.append((time.perf_counter_ns() - start) / n)
        rec.close()
        rows.append(("`Recorder.sink`, engine-thread cost (one locked append)", best_sink))
        rows.append(("`Recorder` writer thread: `to_dict` + encode + write + flush",
                     min(writer_ns)))

        def end_to_end(evs):
            with Recorder(path, model="bench", flush_interval_s=0.05, maxlen=n + 1) as r:
                for e in evs:
                    r.sink(e)
        rows.append(("`Recorder` end to end (sink + background writer + close), per event",
                     _per_event_ns(end_to_end, events, 3)))
    return rows


def measure_flight(n: int = 200_000, repeat: int = 5) -> list[tuple[str, float]]:
    """The flight recorder's cost alone: its sinks and the ones it wraps, interleaved round by round
    (on a loaded machine only figures taken side by side compare), best of `repeat` rounds each, in
    this thread's CPU time (time the thread spent descheduled is not counted)."""
    mix = sample_events()
    events = (mix * (n // len(mix) + 1))[:n]
    bus = EventBus()
    sub = bus.subscribe(maxlen=10_000)
    sinks = {
        "plain function call (baseline)": lambda e: None,
        "`FlightRecorder.tee(None)`: the engine's sink with no other": FlightRecorder().tee(None),
        "`EventBus.publish`, 1 subscriber": bus.publish,
        "`FlightRecorder.tee(bus.publish)`, 1 subscriber": FlightRecorder().tee(bus.publish),
    }
    best = dict.fromkeys(sinks, float("inf"))
    for _ in range(repeat):
        for name, sink in sinks.items():
            start = time.thread_time_ns()
            for e in events:
                sink(e)
            best[name] = min(best[name], (time.thread_time_ns() - start) / n)
    del sub
    return list(best.items())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--flight", action="store_true", help="only the flight recorder's cost, interleaved")
    args = parser.parse_args(argv)
    rows = measure_flight(args.n, args.repeat) if args.flight else measure(args.n, args.repeat)
    print(f"Python {sys.version.split()[0]} on {platform.machine()} "
          f"({platform.processor() or platform.platform()}), n={args.n}\n")
    print("| path | ns per event |")
    print("|---|---:|")
    for name, ns in rows:
        print(f"| {name} | {ns:.0f} |")


if __name__ == "__main__":
    main()
