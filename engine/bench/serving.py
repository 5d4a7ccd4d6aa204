"""The serving benchmark behind `batchtop bench` and `batchtop sweep` (commands.py), in the manner of vLLM's.

A dataset (random lengths, or ShareGPT conversations) becomes a list of requests; they
are sent at a request rate whose gaps are Gamma-distributed (burstiness 1 = Poisson,
rate inf = all at once), at most `max_concurrency` in flight, to a backend: any
OpenAI-compatible server (streaming /v1/completions or /v1/chat/completions through
httpx) or the embedded engine (an `EngineLoop` in this process, no HTTP). The client
times every request: TTFT, the gaps between streamed chunks (ITL), TPOT
((E2E - TTFT) / (output tokens - 1)) and E2E; metric names follow vLLM's benchmark.

`sweep` runs the same trace on the embedded engine at several max_num_seqs and shows
output throughput and p99 TPOT against it, with preemptions and retractions per point.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import AsyncIterator

import numpy as np

VOCAB_LOW, VOCAB_HIGH = 1000, 30000      # ordinary tokens of SmolLM2's vocabulary (no specials)


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]          # token ids for the random dataset: lengths are then exact
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    error: str = ""
    usage: dict | None = None        # the server's usage block, when it sent one
    num_chunks: int = 0
    last_chunk_time: float = 0.0

    def chunk_arrived(self, now: float) -> None:
        """A streamed chunk: the first sets TTFT, every later one adds an inter-token gap."""
        if self.num_chunks == 0:
            self.ttft = now - self.start_time
        else:
            self.itl.append(now - self.last_chunk_time)
        self.last_chunk_time = now
        self.num_chunks += 1

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


# -- datasets ---------------------------------------------------------------------------------


def random_dataset(num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                   seed: int = 0) -> list[BenchRequest]:
    """Lengths uniform in [L(1-r), L(1+r)] (vLLM's random dataset); prompts are random token ids."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ValueError("num prompts, input and output lengths must be >= 1")
    rng = np.random.default_rng(seed)

    def lengths(mean: int) -> np.ndarray:
        low, high = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
        return rng.integers(low, high + 1, size=num_prompts)

    inputs, outputs = lengths(input_len), lengths(output_len)
    return [BenchRequest(rng.integers(VOCAB_LOW, VOCAB_HIGH, size=int(n)).tolist(), int(n), int(m))
            for n, m in zip(inputs, outputs)]


def sharegpt_dataset(path: str, num_prompts: int, tokenizer, seed: int = 0,
                     output_len: int | None = None, max_prompt_len: int = 1024,
                     max_total_len: int = 2048) -> list[BenchRequest]:
    """The first human turn as prompt, the answer's token count as output length (vLLM's filters)."""
    with open(path) as f:
        data = json.load(f)
    conversations = [d.get("conversations") or d.get("conversation") for d in data if isinstance(d, dict)]
    conversations = [c for c in conversations if isinstance(c, list) and len(c) >= 2]
    random.Random(seed).shuffle(conversations)
    out = []
    for conversation in conversations:
        prompt, answer = conversation[0].get("value", ""), conversation[1].get("value", "")
        prompt_len = len(tokenizer.encode(prompt))
        completion_len = output_len or len(tokenizer.encode(answer))
        if prompt_len < 4 or (output_len is None and completion_len < 4):
            continue
        if prompt_len > max_prompt_len or prompt_len + completion_len > max_total_len:
            continue
        out.append(BenchRequest(prompt, prompt_len, completion_len))
        if len(out) == num_prompts:
            break
    if not out:
        raise ValueError(f"{path}: no usable conversations")
    return out


async def paced(requests: list[BenchRequest], rate: float, burstiness: float, seed: int
                ) -> AsyncIterator[BenchRequest]:
    """Yield requests at `rate` per second, Gamma gaps with shape `burstiness` (1: Poisson)."""
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    rng = np.random.default_rng(seed)
    for request in requests:
        yield request
        if math.isinf(rate):
            continue
        await asyncio.sleep(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)))


# -- backends ---------------------------------------------------------------------------------


class OpenAIBackend:
    """A streaming client for any OpenAI-compatible server."""

    def __init__(self, base_url: str, model: str, *, chat: bool = False, api_key: str | None = None,
                 ignore_eos: bool = True, timeout_s: float = 600.0):
        import httpx
        self.url = base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
        self.model, self.chat, self.ignore_eos = model, chat, ignore_eos
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.client = httpx.AsyncClient(headers=headers, timeout=timeout_s, limits=limits)

    def body(self, request: BenchRequest) -> dict:
        body = {"model": self.model, "max_tokens": request.output_len, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.chat:
            prompt = request.prompt if isinstance(request.prompt, str) else None
            if prompt is None:
                raise ValueError("the chat endpoint needs text prompts (use the completions endpoint)")
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = request.prompt
        return body

    async def send(self, request: BenchRequest) -> RequestResult:
        result = RequestResult(prompt_len=request.prompt_len)
        start = result.start_time = time.perf_counter()
        try:
            async with self.client.stream("POST", self.url, json=self.body(request)) as response:
                if response.status_code != 200:
                    result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}"
                    return result
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    data = json.loads(payload)
                    if "error" in data:
                        result.error = str(data["error"].get("message"))
                        return result
                    if data.get("usage"):
                        result.usage = data["usage"]
                    choices = data.get("choices")
                    if not choices or (self.chat and "role" in choices[0].get("delta", {})):
                        continue
                    result.chunk_arrived(time.perf_counter())
            result.latency = time.perf_counter() - start
            result.output_tokens = (result.usage or {}).get("completion_tokens", result.num_chunks)
            if result.usage and "prompt_tokens" in result.usage:
                result.prompt_len = result.usage["prompt_tokens"]
            result.success = result.num_chunks > 0
            if not result.success:
                result.error = "no tokens received"
        except Exception as error:          # a failed request is a result, not a crash
            result.error = f"{type(error).__name__}: {error}"
        return result

    async def close(self) -> None:
        await self.client.aclose()


class EmbeddedBackend:
    """The engine in this process: requests go straight into its `EngineLoop`, no HTTP."""

    def __init__(self, loop, *, ignore_eos: bool = True):
        from batchtop.engine.server.outputs import OutputRouter
        self.loop = loop
        self.ignore_eos = ignore_eos
        self.router = OutputRouter()
        self._ids = 0

    async def send(self, request: BenchRequest) -> RequestResult:
        from batchtop.engine.core.sampling import SamplingParams
        if self.router.aloop is None:
            self.router.aloop = asyncio.get_running_loop()
        result = RequestResult(prompt_len=request.prompt_len)
        start = result.start_time = time.perf_counter()
        self._ids += 1
        request_id = f"bench-{self._ids}"
        wake = asyncio.Event()
        pending = self.router.open(request_id, wake)
        try:
            self.loop.add_request(request.prompt, SamplingParams(max_tokens=request.output_len,
                                                                 ignore_eos=self.ignore_eos),
                                  on_output=self.router.push, request_id=request_id)
            while True:
                if pending.tokens:
                    result.chunk_arrived(time.perf_counter())
                    result.output_tokens += len(pending.tokens)
                    pending.tokens = []
                if pending.finished:
                    break
                wake.clear()
                await wake.wait()
            result.latency = time.perf_counter() - start
            result.success = pending.reason != "abort" and result.output_tokens > 0
        except ValueError as error:
            result.error = str(error)
        finally:
            self.router.close(request_id)
        return result

    async def close(self) -> None:
        pass


async def run_benchmark(backend, requests: list[BenchRequest], *, request_rate: float = math.inf,
                        burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0
                        ) -> tuple[list[RequestResult], float]:
    """Send every request; the results in request order and the wall time of the run."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(request):
        if limit is None:
            return await backend.send(request)
        async with limit:
            return await backend.send(request)

    start = time.perf_counter()
    tasks = []
    async for request in paced(requests, request_rate, burstiness, seed):
        tasks.append(asyncio.create_task(one(request)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


# -- results ----------------------------------------------------------------------------------


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50", "e2el:2000"] (milliseconds) -> SLOs in seconds."""
    slos = {}
    for spec in specs or []:
        name, _, value = spec.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"goodput SLO must be ttft:MS, tpot:MS or e2el:MS, got {spec!r}")
        slos[name] = float(value) / 1000.0
    return slos


def summarize(results: list[RequestResult], duration_s: float, *, slos: dict[str, float] | None = None,
              extra: dict | None = None) -> dict:
    """vLLM's result fields: throughputs, then mean/median/std/p99 of TTFT, TPOT, ITL, E2E in ms."""
    ok = [r for r in results if r.success]
    summary = {"duration": duration_s, "completed": len(ok), "failed": len(results) - len(ok),
               "num_prompts": len(results),
               "total_input_tokens": sum(r.prompt_len for r in ok),
               "total_output_tokens": sum(r.output_tokens for r in ok)}
    summary["request_throughput"] = len(ok) / duration_s if duration_s else 0.0
    summary["output_throughput"] = summary["total_output_tokens"] / duration_s if duration_s else 0.0
    summary["total_token_throughput"] = ((summary["total_input_tokens"] + summary["total_output_tokens"])
                                         / duration_s if duration_s else 0.0)
    samples = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
               "itl": [gap for r in ok for gap in r.itl], "e2el": [r.latency for r in ok]}
    for name, values in samples.items():
        xs = np.asarray(values, dtype=float) * 1000.0
        for stat, fn in (("mean", np.mean), ("median", np.median), ("std", np.std)):
            summary[f"{stat}_{name}_ms"] = float(fn(xs)) if xs.size else None
        summary[f"p99_{name}_ms"] = float(np.percentile(xs, 99)) if xs.size else None
    if slos:
        good = [r for r in ok if r.ttft <= slos.get("ttft", math.inf)
                and (r.tpot or 0.0) <= slos.get("tpot", math.inf) and r.latency <= slos.get("e2el", math.inf)]
        summary["request_goodput"] = len(good) / duration_s if duration_s else 0.0
        summary["goodput_slos_ms"] = {k: v * 1000 for k, v in slos.items()}
    summary["errors"] = sorted({r.error for r in results if r.error})[:10]
    summary.update(extra or {})
    return summary


def format_table(summary: dict, title: str = "Serving Benchmark Result") -> str:
    width = 50
    lines = [f"{' ' + title + ' ':=^{width}}"]

    def row(label, value, fmt="{:.2f}"):
        text = "n/a" if value is None else fmt.format(value)
        lines.append(f"{label:<40}{text:>10}")

    row("Successful requests:", summary["completed"], "{}")
    row("Failed requests:", summary["failed"], "{}")
    if summary.get("max_concurrency"):
        row("Maximum request concurrency:", summary["max_concurrency"], "{}")
    row("Benchmark duration (s):", summary["duration"])
    row("Total input tokens:", summary["total_input_tokens"], "{}")
    row("Total generated tokens:", summary["total_output_tokens"], "{}")
    row("Request throughput (req/s):", summary["request_throughput"])
    if "request_goodput" in summary:
        row("Request goodput (req/s):", summary["request_goodput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"])
    for name, label in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{' ' + label + ' ':-^{width}}")
        row(f"Mean {name.upper()} (ms):", summary[f"mean_{name}_ms"])
        row(f"Median {name.upper()} (ms):", summary[f"median_{name}_ms"])
        row(f"P99 {name.upper()} (ms):", summary[f"p99_{name}_ms"])
    lines.append("=" * width)
    for error in summary.get("errors", []):
        lines.append(f"error: {error}")
    return "\n".join(lines)


def result_json(summary: dict, results: list[RequestResult], config: dict) -> dict:
    """--save-result: the summary, the run's settings and per-request figures (vLLM's layout)."""
    return {**config, **summary,
            "input_lens": [r.prompt_len for r in results], "output_lens": [r.output_tokens for r in results],
            "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
            "e2els": [r.latency for r in results], "errors_per_request": [r.error for r in results]}


# -- the embedded engine ------------------------------------------------------------------------


class EmbeddedEngine:
    """An engine, its event bus and a started loop; `close()` stops the loop."""

    def __init__(self, config, loaded=None):
        from batchtop.engine.core.engine import Engine
        from batchtop.engine.core.loop import EngineLoop
        from batchtop.telemetry.bus import EventBus
        self.bus = EventBus()
        self.events = self.bus.subscribe(maxlen=2_000_000)
        self.engine = Engine(config, sink=self.bus.publish, loaded=loaded)
        self.loop = EngineLoop(self.engine).start()

    def close(self) -> None:
        self.loop.stop()
        self.events.close()


def bench_embedded(config, requests, *, loaded=None, **run_kwargs) -> tuple[list[RequestResult], float, list]:
    """One run on a fresh embedded engine: results, duration, and the engine's events."""
    embedded = EmbeddedEngine(config, loaded)
    try:
        backend = EmbeddedBackend(embedded.loop)
        results, duration = asyncio.run(run_benchmark(backend, requests, **run_kwargs))
        return results, duration, embedded.events.drain()
    finally:
        embedded.close()


def bench_server(base_url: str, model: str, requests, *, chat: bool = False, api_key: str | None = None,
                 ignore_eos: bool = True, **run_kwargs) -> tuple[list[RequestResult], float]:
    async def go():
        backend = OpenAIBackend(base_url, model, chat=chat, api_key=api_key, ignore_eos=ignore_eos)
        try:
            return await run_benchmark(backend, requests, **run_kwargs)
        finally:
            await backend.close()
    return asyncio.run(go())


def served_model(base_url: str, api_key: str | None = None) -> str:
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def sweep(config, requests, values: list[int], *, loaded=None, **run_kwargs) -> list[dict]:
    """The same trace at each max_num_seqs on a fresh embedded engine (the model loaded once)."""
    import dataclasses

    import torch

    from batchtop.engine.model.loading import load_model
    from batchtop.telemetry.run_stats import summarize as summarize_events
    if loaded is None:
        loaded = load_model(config.model, getattr(torch, config.dtype))
    points = []
    for value in values:
        point_config = dataclasses.replace(config, max_num_seqs=value,
                                           batch_capacity=max(config.batch_capacity, value))
        results, duration, events = bench_embedded(point_config, requests, loaded=loaded, **run_kwargs)
        summary = summarize(results, duration)
        stats = summarize_events(events)
        points.append({"max_num_seqs": value, **summary, "preemptions": stats.num_preemptions,
                       "retractions": stats.num_retractions, "batch_utilisation": stats.batch_utilisation,
                       "steps": stats.num_steps})
    return points


def sweep_table(points: list[dict]) -> str:
    """One row per point; a point whose server did not start says so, with its log's tail below."""
    head = (f"{'max_num_seqs':>12} {'req/s':>7} {'out tok/s':>10} {'mean TTFT ms':>13} {'p99 TPOT ms':>12} "
            f"{'p99 ITL ms':>11} {'preempt':>8} {'retract':>8} {'steps':>7}")
    lines, failures = [head, "-" * len(head)], []
    for p in points:
        if "error" in p:
            lines.append(f"{p['max_num_seqs']:>12} failed: {p['error']}")
            failures.append(f"max_num_seqs={p['max_num_seqs']}: the end of the server's log:\n"
                            f"{p['log_tail']}")
            continue
        lines.append(f"{p['max_num_seqs']:>12} {p['request_throughput']:>7.2f} "
                     f"{p['output_throughput']:>10.1f} {_ms(p['mean_ttft_ms']):>13} "
                     f"{_ms(p['p99_tpot_ms']):>12} {_ms(p['p99_itl_ms']):>11} "
                     f"{_count(p.get('preemptions')):>8} {_count(p.get('retractions')):>8} "
                     f"{_count(p.get('steps')):>7}")
    return "\n".join(lines + failures)


def _count(value) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def _ms(value) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def sweep_plot(points: list[dict], width: int = 78, height: int = 20, color: bool = False) -> str:
    """Output throughput (left axis) and p99 TPOT (right axis) against max_num_seqs, log2 x axis."""
    import re

    import plotext
    fig = plotext.figure
    fig.clear()
    fig.theme("default" if color else "clear")
    fig.plot_size(width, height)
    points = [p for p in points if "error" not in p]
    if not points:
        return "no point measured: nothing to plot"
    xs = [math.log2(p["max_num_seqs"]) for p in points]
    throughput = fig.signal(xs, [p["output_throughput"] for p in points], marker="hd")
    throughput.label("output tok/s (left)")
    throughput.lines()
    fig.draw(throughput)
    tpot = [(x, p["p99_tpot_ms"]) for x, p in zip(xs, points) if p["p99_tpot_ms"] is not None]
    if tpot:
        latency = fig.signal([x for x, _ in tpot], [y for _, y in tpot], marker="dot", yside="right")
        latency.label("p99 TPOT ms (right)")
        latency.lines()
        fig.draw(latency)
    fig.ruler("x").ticks(xs, [str(p["max_num_seqs"]) for p in points])
    fig.label("max_num_seqs", axis="x")
    fig.title("output throughput and p99 TPOT vs max_num_seqs")
    text = fig.build().string()
    return text if color else re.sub(r"\x1b\[[0-9;]*m", "", text)


def to_json(points_or_summary) -> str:
    return json.dumps(points_or_summary, indent=2,
                      default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__")
                      else str(o))
