"""Decode-attention bandwidth, triton vs torch, over batch sizes and context lengths.

    python -m batchtop.kernels.bench                    # on a CUDA machine, under 5 minutes
    python -m batchtop.kernels.bench --cpu-smoke        # tiny sizes on the CPU, triton interpreted
    python -m batchtop.kernels.bench --torch-cpu-calls  # per-call time of the torch path (CPU)

Bandwidth is effective: the bytes a decode step must read (each row's K and V up to its
seq_len, plus query and output) over the measured time. The torch path also writes and
re-reads a gathered copy of K/V, which this figure deliberately does not credit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

import torch

from batchtop.kernels import attention_torch


@dataclass(frozen=True)
class Shape:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype


@dataclass
class DecodeStep:
    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    block_size: int

    def step_tensors(self):
        return self.query_start_loc, self.seq_lens, self.block_table, self.block_size

    def bytes_read(self) -> int:
        kv = int(self.seq_lens.sum()) * self.k_cache.shape[2] * self.k_cache.shape[3] * 2
        return (kv + 2 * self.query.numel()) * self.query.element_size()


def make_decode_step(batch: int, context: int, shape: Shape, device: str, seed: int = 0) -> DecodeStep:
    """`batch` decode rows with KV lengths around `context`, blocks scattered over the cache."""
    gen = torch.Generator().manual_seed(seed)
    jitter = max(1, context // 16)
    seq_lens = (context - jitter + torch.randint(0, 2 * jitter + 1, (batch,), generator=gen)).clamp(min=1)
    blocks = (seq_lens + shape.block_size - 1) // shape.block_size
    num_blocks = int(blocks.sum()) + 1
    order = torch.randperm(num_blocks, generator=gen)
    block_table = torch.zeros(batch, int(blocks.max()), dtype=torch.int32)
    starts = torch.cumsum(blocks, 0) - blocks
    for b in range(batch):
        block_table[b, : blocks[b]] = order[starts[b] : starts[b] + blocks[b]]
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, dtype=shape.dtype, device=device)
    return DecodeStep(
        query=torch.randn(batch, shape.num_q_heads, shape.head_dim, dtype=shape.dtype, device=device),
        k_cache=k_cache,
        v_cache=torch.randn_like(k_cache),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=seq_lens.to(torch.int32).to(device),
        block_table=block_table.to(device),
        block_size=shape.block_size,
    )


def time_call(fn, device: str) -> float:
    """Median seconds per call; on CUDA through triton's do_bench, which flushes L2 between calls."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median") / 1e3
    return statistics.median(cpu_samples(fn))


def cpu_samples(fn, seconds: float = 0.5) -> list[float]:
    fn()
    samples = []
    deadline = time.perf_counter() + seconds
    while len(samples) < 5 or (time.perf_counter() < deadline and len(samples) < 200):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def bench_bandwidth(batches, contexts, shape: Shape, device: str) -> None:
    from batchtop.kernels import attention_triton  # after TRITON_INTERPRET is settled

    print(f"decode attention, {shape}, device={device}")
    print(f"{'batch':>6} {'context':>8} {'triton us':>10} {'GB/s':>8} {'torch us':>10} {'GB/s':>8} "
          f"{'max diff':>9}")
    scale = shape.head_dim**-0.5
    for context in contexts:
        for batch in batches:
            step = make_decode_step(batch, context, shape, device)
            impls = {"triton": attention_triton, "torch": attention_torch}
            outs, times = {}, {}
            for name, impl in impls.items():
                meta = impl.build_attention_metadata(*step.step_tensors())
                call = lambda: impl.paged_attention(step.query, step.k_cache, step.v_cache, meta, scale)
                outs[name] = call()
                times[name] = time_call(call, device)
            diff = (outs["triton"].float() - outs["torch"].float()).abs().max().item()
            gbs = {name: step.bytes_read() / t / 1e9 for name, t in times.items()}
            print(f"{batch:>6} {context:>8} {times['triton'] * 1e6:>10.1f} {gbs['triton']:>8.1f} "
                  f"{times['torch'] * 1e6:>10.1f} {gbs['torch']:>8.1f} {diff:>9.2e}")
            step = outs = None          # free the step's tensors before the next one
            if device == "cuda":
                torch.cuda.empty_cache()


def bench_torch_cpu_calls(shape: Shape, context: int, threads: int) -> None:
    """Per-call time of the torch path on the CPU, as the engine calls it (once per layer)."""
    torch.set_num_threads(threads)
    print(f"torch path on CPU, {threads} threads, {shape}, context ~{context}")
    print("microseconds per call, median (min) of up to 200 calls")
    print(f"{'decode rows':>11} {'paged_attention':>17} {'write_kv_cache':>15} {'build_metadata':>15}")
    for batch in (1, 16, 64, 256):
        step = make_decode_step(batch, context, shape, "cpu")
        meta = attention_torch.build_attention_metadata(*step.step_tensors())
        key = torch.randn(batch, shape.num_kv_heads, shape.head_dim, dtype=shape.dtype)
        last = step.seq_lens.long() - 1  # each row's newest token, as a decode step writes it
        block = step.block_table.long().gather(1, (last // shape.block_size)[:, None])[:, 0]
        slots = block * shape.block_size + last % shape.block_size
        attend = lambda: attention_torch.paged_attention(step.query, step.k_cache, step.v_cache, meta, 0.125)
        write = lambda: attention_torch.write_kv_cache(key, key, step.k_cache, step.v_cache, slots)
        build = lambda: attention_torch.build_attention_metadata(*step.step_tensors())
        cells = []
        for fn in (attend, write, build):
            samples = cpu_samples(fn)
            cells.append(f"{statistics.median(samples) * 1e6:.0f} ({min(samples) * 1e6:.0f})")
        print(f"{batch:>11} {cells[0]:>17} {cells[1]:>15} {cells[2]:>15}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU, triton interpreted")
    parser.add_argument("--torch-cpu-calls", action="store_true", help="per-call time of the torch path")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], metavar=("HQ", "HKV", "D"))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="torch threads for --torch-cpu-calls")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if args.torch_cpu_calls:  # SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64
        bench_torch_cpu_calls(Shape(9, 3, 64, args.block_size, dtype), context=150, threads=args.threads)
    elif args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        bench_bandwidth([1, 4], [64, 200], Shape(4, 2, 32, args.block_size, dtype), "cpu")
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device; use --cpu-smoke or --torch-cpu-calls")
        bench_bandwidth(args.batches, args.contexts, Shape(*args.heads, args.block_size, dtype), "cuda")


if __name__ == "__main__":
    main()
