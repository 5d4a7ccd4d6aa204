"""The prefix-caching benchmark's serving leg: `batchtop serve` and a stock vLLM, the same traces over HTTP.

Run through `python -m batchtop.engine.bench.prefix_cache --vllm`. Both servers keep their defaults
for prefix caching (on in both; blocks of 16 tokens in batchtop, 128 in vLLM's CPU build); the same
client (serving.py's) sends the same requests to each, the idle server stopped (SIGSTOP, as
vllm_serve.py does). Each run draws a new prefix (the round's seed), so no run hits what an earlier
one cached. Per run:

- prefill tokens computed: batchtop from its events (PrefillChunk, followed on /v1/events); vLLM as
  prompt tokens minus `usage.prompt_tokens_details.cached_tokens`, summed over the requests;
- the token hit rate (cached / queried tokens) and the request hit rate (requests with any cached
  token): batchtop from its RequestAdmitted events, vLLM from each response's usage;
- the same prefill count from /metrics (`vllm:prefix_cache_queries_total` - `hits_total`, deltas over
  the run; batchtop serve exports both under vLLM's names), as a check of the first.
"""
from __future__ import annotations

import re
import signal
import sys

import httpx

from batchtop.engine.bench import serving as bs
from batchtop.engine.model.loading import smollm2_folder
from batchtop.engine.vllm.launch import LaunchedServer, VllmOptions, launch_vllm
from batchtop.telemetry import events as ev

from .vllm_scheduler import EventFollower
from .vllm_serve import _signal_group, only_running

BATCHTOP_PORT, VLLM_PORT = 8240, 8241
SERVERS = ("batchtop serve", "vLLM")
PREFIX_METRICS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


def prefix_counters(metrics_text: str) -> tuple[float, float]:
    """(queried, cached) tokens from a Prometheus page: vLLM's two prefix-cache counters, summed over
    their label sets."""
    totals = []
    for name in PREFIX_METRICS:
        pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+(\S+)", re.MULTILINE)
        totals.append(sum(float(value) for value in pattern.findall(metrics_text)))
    return totals[0], totals[1]


def read_counters(url: str) -> tuple[float, float]:
    response = httpx.get(url.rstrip("/") + "/metrics", timeout=30)
    response.raise_for_status()
    return prefix_counters(response.text)


def usage_figures(results: list[bs.RequestResult]) -> dict:
    """Prefill and hits from the responses' usage blocks (vLLM with --enable-prompt-tokens-details)."""
    prompt = cached = hit = 0
    for result in results:
        usage = result.usage or {}
        n = int(usage.get("prompt_tokens", result.prompt_len))
        c = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        prompt, cached, hit = prompt + n, cached + c, hit + (c > 0)
    return {"prefill": prompt - cached, "token_hit_rate": cached / prompt if prompt else 0.0,
            "request_hit_rate": hit / len(results) if results else 0.0}


def event_figures(events: list) -> dict:
    """Prefill and hits from batchtop's events of one run (first admissions count, as in vLLM)."""
    admitted = [e for e in events if isinstance(e, ev.RequestAdmitted) and not e.resumed]
    queried = sum(e.num_known_tokens for e in admitted)
    cached = sum(e.num_cached_tokens for e in admitted)
    return {"prefill": sum(e.num_tokens for e in events if isinstance(e, ev.PrefillChunk)),
            "token_hit_rate": cached / queried if queried else 0.0,
            "request_hit_rate": (sum(e.num_cached_tokens > 0 for e in admitted) / len(admitted)
                                 if admitted else 0.0)}


def run_figures(summary: dict, hits: dict, before: tuple[float, float], after: tuple[float, float]) -> dict:
    queried, cached = after[0] - before[0], after[1] - before[1]
    return {**hits, "metrics_prefill": int(queried - cached),
            "ttft_p50": summary["median_ttft_ms"], "ttft_p99": summary["p99_ttft_ms"],
            "out_tok_s": summary["output_throughput"], "failed": summary["failed"]}


def batchtop_server(port: int) -> LaunchedServer:
    command = [sys.executable, "-m", "batchtop.tui.cli", "serve", "--model", "smollm2", "--port", str(port),
               "--served-model-name", "smollm2"]
    return LaunchedServer(command, f"http://127.0.0.1:{port}")


def vllm_server(args) -> LaunchedServer:
    # --enable-prompt-tokens-details only adds cached_tokens to the usage block
    return launch_vllm(VllmOptions(model=str(smollm2_folder(lambda *_: None)), port=VLLM_PORT,
                                   scheduler_cls=None, enforce_eager=args.eager,
                                   omp_threads=args.vllm_omp_threads,
                                   extra_args=("--enable-prompt-tokens-details",)))


def run(args, make_traces) -> dict[tuple[str, str], list[dict]]:
    """Rounds of both traces on both servers, alternating which server goes first; round 0 warms up.
    `make_traces(seed)` gives {trace name: requests} (a new prefix per seed)."""
    servers = {SERVERS[0]: batchtop_server(BATCHTOP_PORT), SERVERS[1]: vllm_server(args)}
    runs: dict[tuple[str, str], list[dict]] = {}
    try:
        for server in servers.values():
            server.wait_healthy(900)
        follower = EventFollower(servers[SERVERS[0]].url, keep=True)
        for round_no in range(args.rounds + 1):
            traces = make_traces(1000 + round_no)
            order = SERVERS if round_no % 2 else SERVERS[::-1]
            for trace, requests in traces.items():
                for name in order:
                    server = servers[name]
                    with only_running(servers, name):
                        start = follower.settle() if name == SERVERS[0] else 0
                        before = read_counters(server.url)
                        results, duration = bs.bench_server(server.url, "smollm2", requests)
                        if name == SERVERS[0]:
                            hits = event_figures(follower.events[start:follower.settle()])
                        else:
                            hits = usage_figures(results)
                        figures = run_figures(bs.summarize(results, duration), hits, before,
                                              read_counters(server.url))
                    print(f"round {round_no} {trace:9} {name:14} {figures['out_tok_s']:.1f} out tok/s, "
                          f"TTFT p50 {figures['ttft_p50']:.0f} ms, prefill {figures['prefill']} "
                          f"(/metrics {figures['metrics_prefill']}), hits {figures['token_hit_rate']:.3f} "
                          f"tokens, {figures['request_hit_rate']:.2f} requests, {figures['failed']} failed",
                          file=sys.stderr)
                    if round_no:
                        runs.setdefault((trace, name), []).append(figures)
    finally:
        for server in servers.values():
            _signal_group(server, signal.SIGCONT)
            server.stop()
    return runs
