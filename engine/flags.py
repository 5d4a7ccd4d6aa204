"""The embedded engine's command-line flags and the `EngineConfig` they build.

Every command that starts an engine in this process takes them: generate, demo, record,
serve, bench, sweep and the dashboard. Cheap to import: the parser of every command is built
at each start.
"""
from __future__ import annotations

import argparse

from batchtop.engine.core.config import BATCHING_MODES, POLICIES, PREEMPTION_MODES, EngineConfig


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default="smollm2", help="smollm2 (default), tiny, an HF folder or a .gguf file")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of one step")
    g.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="most prompt tokens one request may take in a step (0: no cap)")
    kv = g.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-mb", type=float, default=1024.0, help="KV pool size in MiB")
    kv.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--policy", choices=POLICIES, default="fcfs")
    g.add_argument("--preemption-mode", choices=PREEMPTION_MODES, default="recompute")
    g.add_argument("--batching-mode", choices=BATCHING_MODES, default="continuous")
    g.add_argument("--static-batch-size", type=int, default=8, help="B of static and dynamic batching")
    g.add_argument("--layout", choices=["condense", "indexmap", "gather"], default="condense",
                   help="persistent batch layout")
    g.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    g.add_argument("--cuda-graphs", choices=["on", "off", "eager"], default="on",
                   help="on CUDA, decode steps replay graphs captured at start (default on; eager: the graphs' "
                        "buffers and padding without capture, any device)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The config of the flags above; raises ValueError on a value out of range."""
    return EngineConfig(
        model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, kv_cache_mb=args.kv_cache_mb, policy=args.policy,
        preemption_mode=args.preemption_mode, batching_mode=args.batching_mode,
        static_batch_size=args.static_batch_size, layout=args.layout,
        attention_backend=args.attention_backend, num_threads=args.threads, device=args.device,
        cuda_graphs=args.cuda_graphs, batch_capacity=max(256, args.max_num_seqs),
    )
