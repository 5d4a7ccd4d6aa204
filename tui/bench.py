"""Dashboard overhead: the same trace through the engine with the dashboard attached (a headless
Textual run, redrawing at batchtop's default rate) and with only the recorder listening, alternated.

    python -m batchtop.tui.bench          (writes its section of docs/benchmarks.md)
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from batchtop.engine.bench.engine import make_trace
from batchtop.engine.bench.figures import commit, cpu_name, publish
from batchtop.engine.core.config import EngineConfig
from batchtop.engine.core.engine import Engine
from batchtop.engine.core.loop import EngineLoop
from batchtop.engine.core.sampling import SamplingParams
from batchtop.engine.model.loading import load_model
from batchtop.telemetry.bus import EventBus
from batchtop.telemetry.recorder import Recorder

from .commands import LIVE_REFRESH_S

SECTION = "## Dashboard overhead"


def _submit_trace(loop: EngineLoop, prompts, lengths) -> threading.Event:
    """Queue the whole trace; the event is set when the last request finishes."""
    remaining = [len(prompts)]
    done = threading.Event()

    def on_output(output):
        if output.finished:
            remaining[0] -= 1
            if remaining[0] == 0:
                done.set()

    for prompt, n in zip(prompts, lengths):
        loop.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True), on_output=on_output)
    return done


def run_recorder_only(loaded, prompts, lengths, config, folder) -> float:
    bus = EventBus()
    engine = Engine(config, sink=bus.publish, loaded=loaded)
    with Recorder(Path(folder) / "recorder.jsonl", model=loaded.name, bus=bus):
        loop = EngineLoop(engine)
        start = time.perf_counter()
        done = _submit_trace(loop, prompts, lengths)
        loop.start()
        done.wait()
        elapsed = time.perf_counter() - start
        loop.stop()
    return elapsed


def run_with_dashboard(loaded, prompts, lengths, config, folder, refresh_s: float, size=(120, 40)) -> float:
    from .app import BatchtopApp
    from .sources.engine import EngineSource
    bus = EventBus()
    engine = Engine(config, sink=bus.publish, loaded=loaded)
    loop = EngineLoop(engine)
    source = EngineSource(loop, bus, model=loaded.name)

    async def drive() -> float:
        app = BatchtopApp(source, record_path=str(Path(folder) / "dashboard.jsonl"), refresh_s=refresh_s)
        async with app.run_test(size=size):
            start = time.perf_counter()
            done = _submit_trace(loop, prompts, lengths)
            while not done.is_set():
                # the app's own timers drain and draw meanwhile, as in a terminal; not pilot.pause,
                # which also messages every widget and forces a screen update 20 times a second
                await asyncio.sleep(0.05)
            return time.perf_counter() - start

    try:
        return asyncio.run(drive())
    finally:
        source.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--refresh", default=f"{LIVE_REFRESH_S:g},0.1",
                        help="comma-separated redraw periods to compare (default: batchtop's own, and 0.1 s)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    prompts, lengths = make_trace(num_requests=args.requests)
    config = EngineConfig(model=args.model, max_num_seqs=32, max_num_batched_tokens=2048)
    periods = [float(p) for p in args.refresh.split(",")]

    def label(period: float) -> str:
        default = ", the default" if period == LIVE_REFRESH_S else ""
        return f"dashboard + recorder, redraw every {period:g} s{default}"

    runs: dict[str, list[float]] = {"recorder only": [], **{label(p): [] for p in periods}}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.rounds):
            runs["recorder only"].append(run_recorder_only(loaded, prompts, lengths, config, folder))
            for period in periods:
                seconds = run_with_dashboard(loaded, prompts, lengths, config, folder, period)
                runs[label(period)].append(seconds)
            print({k: [round(v, 2) for v in vs] for k, vs in runs.items()}, flush=True)
    useful = sum(lengths)
    base = statistics.median(runs["recorder only"])
    lines = [SECTION, "",
             f"`python -m batchtop.tui.bench --rounds {args.rounds}`, {args.model} fp32, "
             f"{args.threads} threads, "
             f"{time.strftime('%Y-%m-%d')}, commit {commit()}, {cpu_name()}: {len(prompts)} requests of the "
             f"engine trace ({useful} output "
             "tokens) through the engine thread, with the recorder alone and with the dashboard (headless "
             "Textual run at 120x40, polling at 10 Hz, redrawing at most once per period while events flow) "
             f"attached and recording; alternated {args.rounds} times: the median and the range.", "",
             "| listeners | wall s | range | out tok/s | throughput kept |", "|---|---:|---:|---:|---:|"]
    for name, seconds in runs.items():
        median = statistics.median(seconds)
        lines.append(f"| {name} | {median:.2f} | {min(seconds):.2f}-{max(seconds):.2f} "
                     f"| {useful / median:.1f} | {base / median:.1%} |")
    spread = (max(runs["recorder only"]) - min(runs["recorder only"])) / base
    lines += ["", f"The recorder-only runs spread {spread:.0%} (range over median): a difference within the "
              "runs' ranges is not a cost this run can resolve."]
    text = "\n".join(lines) + "\n"
    return publish(SECTION, text, write=not args.no_write)


if __name__ == "__main__":
    raise SystemExit(main())
