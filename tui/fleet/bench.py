"""The fleet screen over N `batchtop serve --model tiny` engines under load: how often it redraws, what it
costs (this process's CPU seconds per wall second: the UI thread, the engines' poll and stream threads),
and how long a scheduler decision takes to reach the screen (a StepPlanned event's own time against the
time the table row showing it was rendered; the engines run on this host, so their clock is ours).

    python -m batchtop.tui.fleet.bench [--engines 8,1] [--seconds 20] [--rounds 2] [--no-write]

The load runs in its own process (each engine: a few requests at a time, 16 output tokens each), so it
is not counted in the screen's CPU.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import threading
import time
from collections import deque

from batchtop.engine.bench.figures import commit, cpu_name, publish
from batchtop.engine.vllm.launch import free_port
from batchtop.telemetry.events import StepPlanned
from batchtop.telemetry.run_stats import percentile

from .screen import DRAW_GAP_S

SECTION = "## Fleet screen"
SIZE = (160, 40)


def start_engines(n: int, folder: str):
    from batchtop.engine.vllm.launch import LaunchedServer
    servers = []
    for i in range(n):
        port = free_port()
        command = [sys.executable, "-m", "batchtop.tui.cli", "serve", "--model", "tiny",
                   "--port", str(port), "--threads", "1", "--max-num-seqs", "4"]
        servers.append(LaunchedServer(command, f"http://127.0.0.1:{port}",
                                      log_path=f"{folder}/serve-{i}.log"))
    for server in servers:
        server.wait_healthy(300)
    return servers


def load(urls: list[str], streams: int, stop) -> None:
    """Each engine: `streams` clients, one completion after another (a separate process)."""
    import httpx

    def client(url: str) -> None:
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                try:
                    http.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hello fleet",
                                                             "max_tokens": 16, "ignore_eos": True})
                except httpx.HTTPError:
                    time.sleep(0.2)
    threads = [threading.Thread(target=client, args=(url,), daemon=True)
               for url in urls for _ in range(streams)]
    for thread in threads:
        thread.start()
    stop.wait()


class Probe:
    """Every StepPlanned's time per engine (from the poll threads) until a drawn row shows it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: dict[str, deque] = {}
        self.latencies: list[float] = []
        self.draws: list[float] = []
        self.arrivals: list[float] = []          # a StepPlanned's time to its engine's poll thread
        self.screen: list[float] = []            # from there to the render that shows it
        self.measuring = False

    def tap(self, member, events, reset) -> None:
        now = time.monotonic()
        ts = [e.t for e in events if type(e) is StepPlanned]
        with self.lock:
            self.pending.setdefault(member.name, deque()).extend((t, now) for t in ts)
            if self.measuring:
                self.arrivals.extend(now - t for t in ts)

    def drawn(self, rows, t: float) -> None:
        with self.lock:
            for row in rows:
                pending = self.pending.get(row.name)
                if not pending or row.newest_t is None:
                    continue
                while pending and pending[0][0] <= row.newest_t:
                    planned, arrived = pending.popleft()
                    if self.measuring:
                        self.latencies.append(t - planned)
                        self.screen.append(t - arrived)
            if self.measuring:
                self.draws.append(t)


async def measure(urls: list[str], seconds: float, warmup_s: float = 5.0) -> dict:
    from .member import Member
    from .screen import FleetApp
    from .targets import targets
    probe = Probe()
    members = [Member(target) for target in targets(urls)]
    for member in members:
        member.tap(probe.tap)
    app = FleetApp(members, on_draw=probe.drawn)
    async with app.run_test(size=SIZE) as pilot:
        deadline = time.monotonic() + 120
        while not all(m.rows[0].state == "live" for m in members):
            assert time.monotonic() < deadline, [m.rows[0] for m in members]
            await pilot.pause(0.5)
        await pilot.pause(warmup_s)
        with probe.lock:
            probe.measuring = True
            probe.latencies.clear()
            probe.arrivals.clear()
            probe.screen.clear()
        cpu0, wall0 = time.process_time(), time.monotonic()
        await pilot.pause(seconds)
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        loadavg = os.getloadavg()[0]
        probe.measuring = False
    latencies = sorted(probe.latencies)
    arrivals, screen = sorted(probe.arrivals), sorted(probe.screen)
    return {"arrival_p50": percentile(arrivals, 50), "arrival_p99": percentile(arrivals, 99),
            "screen_p50": percentile(screen, 50), "screen_p99": percentile(screen, 99),
            "load": loadavg, "hz": len(probe.draws) / wall, "cpu": cpu / wall, "n": len(latencies),
            "p50": percentile(latencies, 50), "p99": percentile(latencies, 99), "max": latencies[-1]}


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}"


def engine_counts(text: str) -> list[int]:
    counts = [int(part) for part in text.split(",")]
    if min(counts) < 1:
        raise argparse.ArgumentTypeError(f"want engine counts like 8 or 8,1, got {text!r}")
    return counts


def run_fleet(num_engines: int, args) -> list[dict]:
    """`args.rounds` measurements of the screen over `num_engines` loaded engines (started and stopped
    here)."""
    import tempfile
    with tempfile.TemporaryDirectory() as folder:
        servers = start_engines(num_engines, folder)
        stop = multiprocessing.Event()
        loader = multiprocessing.Process(target=load, args=([s.url for s in servers], args.streams, stop))
        loader.start()
        try:
            runs = []
            for _ in range(args.rounds):
                measured = asyncio.run(measure([s.url for s in servers], args.seconds))
                runs.append({"engines": num_engines, **measured})
                print(runs[-1], flush=True)
        finally:
            stop.set()
            loader.join(10)
            for server in servers:
                server.stop()
    return runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=engine_counts, default=[8],
                        help="engines to watch; several counts (8,1) are measured one after another")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", type=int, default=2, help="clients per engine")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    runs = [run for count in args.engines for run in run_fleet(count, args)]
    counts = ",".join(map(str, args.engines))
    lines = [SECTION, "",
             f"`python -m batchtop.tui.fleet.bench --engines {counts} --seconds {args.seconds:g} "
             f"--rounds {args.rounds}`, {time.strftime('%Y-%m-%d')}, commit {commit()}, {cpu_name()} "
             f"({os.cpu_count()} cores, shared with the engines and their clients; the "
             "load average column says what else ran): the fleet screen (headless Textual at "
             f"{SIZE[0]}x{SIZE[1]}, a changed row drawn at once, at most {1 / DRAW_GAP_S:.0f} times a "
             f"second) over {counts} `batchtop serve --model tiny --max-num-seqs 4 --threads 1` "
             f"processes on this host, each kept busy by {args.streams} "
             "clients (16 output tokens a request, from a separate process). Redraws: the table's renders "
             "per second; CPU: this process's CPU seconds per wall second (UI thread, the engines' poll "
             "and stream threads); latency: each StepPlanned event's own time to the render of the row "
             "that first shows it, split into its way to the fleet (the engine's pump, the stream, the poll "
             "thread receiving it) and the fleet's own part (folded, row built, drawn). Load avg: the "
             "host's 1-minute load average at the end of the round (2 cores).", "",
             "| engines | round | load avg | redraws/s | CPU s / s | decisions "
             "| decision → screen p50 / p99 / max ms | → poll thread p50 / p99 ms "
             "| poll thread → screen p50 / p99 ms |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for i, run in enumerate(runs):
        lines.append(f"| {run['engines']} | {i % args.rounds + 1} | {run['load']:.1f} | {run['hz']:.1f} "
                     f"| {run['cpu']:.2f} | {run['n']} | "
                     f"{ms(run['p50'])} / "
                     f"{ms(run['p99'])} / {ms(run['max'])} | {ms(run['arrival_p50'])} / "
                     f"{ms(run['arrival_p99'])} "
                     f"| {ms(run['screen_p50'])} / {ms(run['screen_p99'])} |")
    text = "\n".join(lines) + "\n"
    return publish(SECTION, text, write=not args.no_write)


if __name__ == "__main__":
    raise SystemExit(main())
