"""Benchmark (not a test): server overhead and a max_num_seqs sweep, written to docs/benchmarks.md.

    .venv/bin/python -m batchtop.engine.bench.server_overhead [--model smollm2] [--quick]

1. Server overhead: the same random trace at 32 concurrent streams, once through
   `batchtop serve` (a subprocess; the client streams over HTTP from this process) and once
   on the embedded engine (the same client harness, no HTTP), alternating, best of `--repeats`.
   Target: the server keeps >= 85% of the embedded output throughput.
2. Sweep: the same trace at several max_num_seqs on the embedded engine, with a KV pool small
   enough that the top of the sweep has to preempt.

Only the section "## Server overhead and sweep" of docs/benchmarks.md is rewritten.
"""
from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import sys
import time

from batchtop.engine.bench import serving as bs
from batchtop.engine.core.config import EngineConfig
from batchtop.engine.vllm.launch import LaunchedServer, free_port

from .figures import commit, cpu_name, publish

SECTION = "## Server overhead and sweep"


def serve_command(model: str, port: int, max_num_seqs: int) -> list[str]:
    return [sys.executable, "-m", "batchtop.tui.cli", "serve", "--model", model, "--port", str(port),
            "--max-num-seqs", str(max_num_seqs)]


def overhead(args) -> dict:
    requests = bs.random_dataset(args.num_prompts, args.input_len, args.output_len, seed=0)
    run = dict(max_concurrency=args.concurrency, seed=0)
    config = EngineConfig(model=args.model, max_num_seqs=args.concurrency)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    best = {"server": None, "embedded": None, "runs": {"server": [], "embedded": []}}
    with LaunchedServer(serve_command(args.model, port, args.concurrency), url) as server:
        server.wait_healthy(300)
        bs.bench_server(url, args.model, requests[: args.concurrency], **run)        # warm-up
        for _ in range(args.repeats):
            results, duration = bs.bench_server(url, args.model, requests, **run)
            summary = bs.summarize(results, duration)
            best["runs"]["server"].append(summary["output_throughput"])
            if best["server"] is None or summary["output_throughput"] > best["server"]["output_throughput"]:
                best["server"] = summary
            print(f"server   {summary['output_throughput']:.1f} tok/s", file=sys.stderr)
            # SIGSTOP: the idle server must not take CPU from the embedded run
            server.process.send_signal(signal.SIGSTOP)
            try:
                import torch

                from batchtop.engine.model.loading import load_model
                loaded = best.get("_loaded") or load_model(args.model, getattr(torch, config.dtype))
                best["_loaded"] = loaded
                bs.bench_embedded(config, requests[: args.concurrency], loaded=loaded, **run)   # warm-up
                results, duration, _ = bs.bench_embedded(config, requests, loaded=loaded, **run)
            finally:
                server.process.send_signal(signal.SIGCONT)
            summary = bs.summarize(results, duration)
            best["runs"]["embedded"].append(summary["output_throughput"])
            fastest = best["embedded"]
            if fastest is None or summary["output_throughput"] > fastest["output_throughput"]:
                best["embedded"] = summary
            print(f"embedded {summary['output_throughput']:.1f} tok/s", file=sys.stderr)
    best["ratio"] = best["server"]["output_throughput"] / best["embedded"]["output_throughput"]
    best["requests"] = (args.num_prompts, args.input_len, args.output_len, args.concurrency)
    return best


def run_sweep(args, loaded) -> list[dict]:
    requests = bs.random_dataset(args.sweep_prompts, args.input_len, args.output_len, seed=1)
    config = EngineConfig(model=args.model, num_kv_blocks=args.sweep_kv_blocks,
                          batch_capacity=max(256, max(args.values)))
    return bs.sweep(config, requests, args.values, loaded=loaded)


def render(args, result: dict, points: list[dict]) -> str:
    server, embedded = result["server"], result["embedded"]
    n, i, o, c = result["requests"]
    lines = [SECTION, "",
             f"Measured with `python -m batchtop.engine.bench.server_overhead"
             f"{' --quick' if args.quick else ''} --model {args.model}` at commit {commit()} on "
             f"{cpu_name()} ({os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end), "
             f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d')}. Best of {args.repeats} "
             "alternating runs each, every run listed.", "",
             f"**Server overhead.** {n} requests, {i} prompt tokens and {o} output tokens each (EOS "
             f"ignored), {c} concurrent streams, all sent at once. `server`: `batchtop serve` in a "
             "subprocess, streamed over HTTP (SSE) by the bench client; `embedded`: the same client harness "
             f"feeding the engine loop in-process.", "",
             "| backend | out tok/s | every run's out tok/s | req/s | mean TTFT ms | mean TPOT ms "
             "| p99 ITL ms |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, s in (("embedded", embedded), ("server", server)):
        every = ", ".join(f"{v:.1f}" for v in result["runs"][name])
        lines.append(f"| {name} | {s['output_throughput']:.1f} | {every} | {s['request_throughput']:.2f} | "
                     f"{s['mean_ttft_ms']:.0f} | {s['mean_tpot_ms']:.1f} | {s['p99_itl_ms']:.1f} |")
    verdict = "meets" if result["ratio"] >= 0.85 else "misses"
    medians = statistics.median(result["runs"]["server"]) / statistics.median(result["runs"]["embedded"])
    lines += ["",
              f"Server / embedded output throughput: **{result['ratio']:.1%}** of the best runs, "
              f"{medians:.1%} of the medians ({verdict} the 85% target).",
              "", f"**Sweep.** {args.sweep_prompts} requests ({args.input_len} in / {args.output_len} out), "
              f"all at once, on the embedded engine with a KV pool of {args.sweep_kv_blocks} blocks of 16 "
              f"tokens (room for about {args.sweep_kv_blocks * 16 // (args.input_len + args.output_len)} "
              f"whole requests), so the top of the sweep must preempt.", "", "```", bs.sweep_table(points),
              "```", "", "```", bs.sweep_plot(points).rstrip(), "```", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--quick", action="store_true", help="smaller traces")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--values", type=lambda s: [int(v) for v in s.split(",")],
                        default=[1, 4, 16, 64, 256])
    parser.add_argument("--no-write", action="store_true", help="print, do not touch docs/benchmarks.md")
    args = parser.parse_args(argv)
    args.num_prompts, args.input_len, args.output_len = (64, 32, 32) if args.quick else (128, 64, 64)
    args.sweep_prompts, args.sweep_kv_blocks = (64, 96) if args.quick else (256, 192)
    result = overhead(args)
    points = run_sweep(args, result.pop("_loaded"))
    text = render(args, result, points)
    return publish(SECTION, text, write=not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
