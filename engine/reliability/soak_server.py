"""The soak through the HTTP server: concurrent streams, client disconnects, aborts through the control API.

    python -m batchtop.engine.reliability.soak_server [--requests 10000] [--concurrency 32] [--seed 0]
        [--event-history 100000] [--warmup 2000] [--no-write]

Serves the tiny model on a free loopback port (with an API key, so control goes through it) and
drives it with `concurrency` clients. Each request is one of: a stream read to its end, a stream
the client cuts after a few chunks, a stream aborted through `POST /v1/requests/{id}/abort` (the
stream must then end with `finish_reason: abort`), or a plain completion. Every answer with status
5xx is counted (must be 0); every stream must end with `[DONE]` unless its client cut it. Every
`--sample-every` served requests the engine's tables and the process's resident memory are sampled:
with finished requests released they stay flat however many are served, and the memory growth per
1,000 requests after `--warmup` is printed. After the run the KV pool must be whole and the engine
must keep no request. Exit status 1 on any violation. The figures go into docs/reliability.md's
section for the event history (unless --no-write).
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from batchtop.engine.bench.figures import RELIABILITY, commit, cpu_name, publish
from batchtop.engine.core.config import EngineConfig
from batchtop.engine.server.app import ServerThread, build_server

API_KEY = "soak-key"
KINDS = (("complete", 0.55), ("disconnect", 0.15), ("control_abort", 0.15), ("plain", 0.15))


@dataclass
class ServerSoakReport:
    requests: int = 0
    outcomes: Counter = field(default_factory=Counter)     # complete | cut | aborted | plain | refused (4xx)
    statuses: Counter = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    # served, RSS bytes, engine.requests, pending on the server, events in the server's ring
    samples: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    elapsed_s: float = 0.0

    def rss_growth_per_1000(self, warmup: int) -> float | None:
        """Resident memory growth in MiB per 1,000 requests served after the first `warmup`: the least-squares
        slope over the samples from there on; None with fewer than two served counts to fit."""
        after = [(served, rss / 2**20) for served, rss, *_ in self.samples if served >= warmup]
        if len({served for served, _ in after}) < 2:
            return None
        mean_x = sum(x for x, _ in after) / len(after)
        mean_y = sum(y for _, y in after) / len(after)
        slope = (sum((x - mean_x) * (y - mean_y) for x, y in after)
                 / sum((x - mean_x) ** 2 for x, _ in after))
        return slope * 1000

    @property
    def num_5xx(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)

    def text(self) -> str:
        lines = [f"requests {self.requests} in {self.elapsed_s:.1f} s "
                 f"({self.requests / max(self.elapsed_s, 1e-9):.1f}/s)",
                 f"outcomes {dict(sorted(self.outcomes.items()))}",
                 f"statuses {dict(sorted(self.statuses.items()))}  5xx {self.num_5xx}",
                 "served  RSS MiB  engine.requests  server pending  event ring"]
        lines += [f"{served:>6}  {rss / 2**20:7.1f}  {num_requests:>15}  {pending:>14}  {ring:>10}"
                  for served, rss, num_requests, pending, ring in self.samples]
        lines.append(f"violations {len(self.violations)}")
        lines += [f"  {v}" for v in self.violations[:20]]
        return "\n".join(lines)


def resident_bytes() -> int:
    """The process's resident memory once garbage is collected and the C allocator has handed its free
    pages back (glibc's malloc_trim, where there is one): what is live, not the allocator's high-water
    mark, so a sample does not depend on which thread's arena last grew."""
    gc.collect()
    if _libc is not None:
        _libc.malloc_trim(0)
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _glibc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_libc = _glibc()


class ServerSoak:
    def __init__(self, num_requests: int, concurrency: int, seed: int, sample_every: int, served=None,
                 event_history: int = 100_000):
        self.num_requests = num_requests
        self.concurrency = concurrency
        self.rng = random.Random(seed)
        self.sample_every = sample_every
        self.report = ServerSoakReport()
        self._owns_server = served is None
        if served is None:
            server = build_server(EngineConfig(model="tiny", num_kv_blocks=48, max_model_len=256,
                                               max_num_seqs=16, num_threads=1), api_key=API_KEY,
                                               event_history=event_history)
            served = (server, ServerThread(server).start())
        self.server, self.thread = served
        self.headers = {"Authorization": f"Bearer {self.server.api_key}"} if self.server.api_key else {}
        self._next = 0

    def run(self) -> ServerSoakReport:
        started = time.perf_counter()
        try:
            asyncio.run(self._drive())
            self._wait_idle()
        finally:
            if self._owns_server:
                self.thread.stop()
                self.server.loop.stop()
        self.report.elapsed_s = time.perf_counter() - started
        return self.report

    async def _drive(self) -> None:
        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        async with httpx.AsyncClient(base_url=self.thread.url, headers=self.headers, limits=limits,
                                     timeout=httpx.Timeout(120.0)) as client:
            await asyncio.gather(*[self._client(client) for _ in range(self.concurrency)])

    async def _client(self, client: httpx.AsyncClient) -> None:
        while self._next < self.num_requests:
            self._next += 1
            kind = self.rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0]
            body = {"model": self.server.model_name,
                    "prompt": [self.rng.randint(0, 40_000) for _ in range(self.rng.randint(1, 100))],
                    "max_tokens": self.rng.randint(1, 48), "temperature": self.rng.choice((0.0, 1.0)),
                    "ignore_eos": True, "stream": kind != "plain"}
            try:
                await (self._plain(client, body) if kind == "plain" else self._stream(client, body, kind))
            except httpx.HTTPError as error:
                self.report.violations.append(f"{kind}: {type(error).__name__}: {error}")
            self.report.requests += 1
            if self.report.requests % self.sample_every == 0:
                self._sample()

    async def _plain(self, client, body) -> None:
        response = await client.post("/v1/completions", json=body)
        self.report.statuses[response.status_code] += 1
        if response.status_code != 200:
            self.report.outcomes["refused"] += 1
            return
        reason = response.json()["choices"][0]["finish_reason"]
        if reason != "length":
            self.report.violations.append(f"plain completion ended with {reason!r}")
        self.report.outcomes["plain"] += 1

    async def _stream(self, client, body, kind: str) -> None:
        cut_after = self.rng.randint(1, 4)
        async with client.stream("POST", "/v1/completions", json=body) as response:
            self.report.statuses[response.status_code] += 1
            if response.status_code != 200:
                self.report.outcomes["refused"] += 1
                return
            chunks, reasons, done, aborted = 0, [], False, False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self.report.violations.append(f"error inside a stream: {chunk['error']}")
                    continue
                chunks += 1
                reasons += [c["finish_reason"] for c in chunk["choices"] if c.get("finish_reason")]
                if kind == "disconnect" and chunks >= cut_after:
                    self.report.outcomes["cut"] += 1
                    return                           # leaving the block closes the connection mid-stream
                if kind == "control_abort" and not aborted:
                    aborted = True
                    answer = await client.post(f"/v1/requests/{chunk['id']}/abort")
                    self.report.statuses[answer.status_code] += 1
                    if answer.status_code not in (200, 404):     # 404: it had finished already
                        self.report.violations.append(f"abort answered {answer.status_code}: {answer.text}")
            if not done:
                self.report.violations.append(f"{kind} stream ended without [DONE]")
            expected = ("abort", "length") if kind == "control_abort" else ("length",)
            if len(reasons) != 1 or reasons[0] not in expected:
                self.report.violations.append(f"{kind} stream finished with {reasons}")
            self.report.outcomes["aborted" if reasons == ["abort"] else "complete"] += 1

    def _sample(self) -> None:
        self.report.samples.append((self.report.requests, resident_bytes(), len(self.server.engine.requests),
                                    len(self.server.router._pending), len(self.server.ring)))

    def _wait_idle(self, timeout_s: float = 60.0) -> None:
        engine = self.server.engine
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (not engine.has_unfinished() and engine.kv.num_used_blocks == 0 and not engine.requests
                    and not self.server.router._pending):
                break
            time.sleep(0.05)
        else:
            self.report.violations.append(
                f"not idle after the run: {engine.kv.num_used_blocks} blocks used, {len(engine.requests)} "
                f"requests kept, {len(self.server.router._pending)} pending on the server")
        self._sample()


SECTION = "## Server soak: figures"


def section(report: ServerSoakReport, args, at: str) -> str:
    """docs/reliability.md's server soak figures: the command, where and when, answers, the samples, and
    the memory growth after warm-up."""
    command = (f"python -m batchtop.engine.reliability.soak_server --requests {args.requests} "
               f"--concurrency {args.concurrency} --seed {args.seed} --sample-every {args.sample_every} "
               f"--event-history {args.event_history} --warmup {args.warmup}")
    outcomes = report.outcomes
    growth = report.rss_growth_per_1000(args.warmup)
    lines = [f"{SECTION}, event history {args.event_history:,}", "",
             f"`{command}` (written by it), commit {at}, {time.strftime('%Y-%m-%d')}, {cpu_name()}, "
             f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end: "
             f"{report.elapsed_s:.1f} s ({report.requests / max(report.elapsed_s, 1e-9):.1f} requests/s); "
             f"{outcomes['complete']:,} streams complete, {outcomes['cut']:,} cut by their clients, "
             f"{outcomes['aborted']:,} aborted through the control API, {outcomes['plain']:,} plain, "
             f"{outcomes['refused']:,} refused; statuses "
             + ", ".join(f"{status} × {n:,}" for status, n in sorted(report.statuses.items()))
             + f"; **5xx {report.num_5xx}**, violations {len(report.violations)}.", "",
             "| served | RSS MiB | `Engine.requests` | server pending | event ring |",
             "|---:|---:|---:|---:|---:|"]
    for i, (served, rss, num_requests, pending, ring) in enumerate(report.samples):
        label = "after the run" if i == len(report.samples) - 1 else f"{served:,}"
        lines.append(f"| {label} | {rss / 2**20:.1f} | {num_requests} | {pending} | {ring:,} |")
    lines += ["", "Resident memory after the first {:,} requests: {}.".format(
        args.warmup, "not measured (too few samples)" if growth is None else
        f"**{growth:+.2f} MiB per 1,000 requests**")]
    lines += [f"- {v}" for v in report.violations[:20]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchtop.engine.reliability.soak_server",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-every", type=int, default=1000)
    parser.add_argument("--event-history", type=int, default=100_000,
                        help="the server's event ring, as serve's flag")
    parser.add_argument("--warmup", type=int, default=2000,
                        help="requests served before the memory growth is measured")
    parser.add_argument("--no-write", action="store_true", help="print; leave docs/reliability.md")
    args = parser.parse_args(argv)
    at = commit()                               # the code the figures come from: HEAD as the run starts
    report = ServerSoak(args.requests, args.concurrency, args.seed, args.sample_every,
                        event_history=args.event_history).run()
    print(report.text(), file=sys.stderr)
    title = f"{SECTION}, event history {args.event_history:,}"
    publish(title, section(report, args, at), write=not args.no_write, doc=RELIABILITY)
    return 1 if report.violations or report.num_5xx else 0


if __name__ == "__main__":
    sys.exit(main())
