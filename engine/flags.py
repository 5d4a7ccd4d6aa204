"""The embedded engine's command-line flags and the `EngineConfig` they build.

Every command that starts an engine in this process takes them: generate, demo, record,
serve, bench, sweep and the dashboard. Cheap to import: the parser of every command is built
at each start.
"""
from __future__ import annotations

import argparse

from batchtop.engine.core.batch import LAYOUTS
from batchtop.engine.core.config import DTYPES, EngineConfig
from batchtop.engine.core.knobs import KNOBS, POLICIES, START_KNOBS
from batchtop.engine.model import CUDA_GRAPH_MODES
from batchtop.kernels import BACKENDS

DEFAULT = EngineConfig          # its fields' defaults are the flags' defaults


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT.model,
                   help="smollm2 (default), tiny, an HF folder or a .gguf file")
    for name in ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold",
                 "static_batch_size"):
        g.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(DEFAULT, name),
                       help=KNOBS[name].help)
    kv = g.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-mb", type=float, default=DEFAULT.kv_cache_mb, help="KV pool size in MiB")
    kv.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks")
    g.add_argument("--block-size", type=int, default=DEFAULT.block_size, help="tokens per KV block")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=DEFAULT.enable_prefix_caching, help=START_KNOBS["enable_prefix_caching"].help)
    g.add_argument("--policy", choices=POLICIES, default=DEFAULT.policy)
    for name in ("preemption_mode", "batching_mode"):
        g.add_argument(f"--{name.replace('_', '-')}", choices=KNOBS[name].choices,
                       default=getattr(DEFAULT, name), help=KNOBS[name].help)
    g.add_argument("--layout", choices=LAYOUTS, default=DEFAULT.layout, help="persistent batch layout")
    g.add_argument("--attention-backend", choices=BACKENDS, default=DEFAULT.attention_backend)
    g.add_argument("--dtype", choices=DTYPES, default=DEFAULT.dtype)
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g.add_argument("--device", default=DEFAULT.device, help="cpu (default), cuda or cuda:N")
    g.add_argument("--cuda-graphs", choices=CUDA_GRAPH_MODES, default=DEFAULT.cuda_graphs,
                   help="on: on CUDA, decode steps replay graphs captured at start (default off: no GPU "
                        "run has validated them yet); eager: the graphs' buffers and padding without "
                        "capture, any device")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The config of the flags above; raises ValueError on a value out of range."""
    return EngineConfig(
        model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold, block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        num_kv_blocks=args.num_kv_blocks, kv_cache_mb=args.kv_cache_mb, policy=args.policy,
        preemption_mode=args.preemption_mode, batching_mode=args.batching_mode,
        static_batch_size=args.static_batch_size, layout=args.layout,
        attention_backend=args.attention_backend, num_threads=args.threads, device=args.device,
        cuda_graphs=args.cuda_graphs,
    )
