"""The model's products on the CPU kernel's packed weights against torch's fp32 matmul, per row count.

    python -m batchtop.engine.bench.products [--model smollm2] [--threads 1] [--repeats 5] [--write]

Every linear of every layer (q/k/v, o, gate/up, down, as the forward fuses them) over an input of M
rows, the two ways alternated within each repeat, so a noisy machine slows both alike; the median
and the range of the repeats are printed with their ratio. It is what `cpu.products_pay()` decides:
the engine packs its weights only where the packed products win.
"""
from __future__ import annotations

import argparse
import statistics
import time
from datetime import date

import torch

from batchtop.kernels import cpu

from .figures import commit, cpu_name, publish

SECTION = "## CPU products: packed weights vs torch"
DOC_ROWS = (1, 4, 16, 64, 256)


def time_products(flat, rows: int) -> float:
    """Seconds for one pass of every layer's products over `rows` random rows."""
    inputs: dict[int, torch.Tensor] = {}
    start = time.perf_counter()
    for layer in flat.layers:
        for linear in layer.linears:
            width = linear.packed.panels.shape[1] if linear.packed is not None else linear.weight.shape[1]
            linear(inputs.setdefault(width, torch.randn(rows, width)))
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, nargs="+", default=list(DOC_ROWS))
    parser.add_argument("--write", action="store_true", help="write the section of docs/benchmarks.md")
    args = parser.parse_args(argv)
    if not cpu.available():
        parser.error(f"the C++ kernels are unavailable: {cpu.unavailable_reason()}")
    from batchtop.engine.model.forward import FlatForward
    from batchtop.engine.model.loading import load_model
    torch.set_num_threads(args.threads)
    model = load_model(args.model).model
    flats = {"packed": FlatForward(model, packed=True), "torch": FlatForward(model, packed=False)}
    for linear in (linear for layer in flats["packed"].layers for linear in layer.linears):
        linear.torch_from_rows = None          # the packed products at every row count, not the engine's choice
    lines = [SECTION, "",
             f"{date.today()}, commit {commit()}, {cpu_name()}, {args.threads} thread(s), {args.model}; "
             f"`python -m batchtop.engine.bench.products --threads {args.threads} --repeats {args.repeats}`. "
             f"`cpu.products_pay()` here: {cpu.products_pay()}.", "",
             "| rows | packed ms (median, range) | torch ms (median, range) | packed / torch |",
             "|---:|---:|---:|---:|"]
    with torch.inference_mode():
        for rows in args.rows:
            times = {name: [] for name in flats}
            for _ in range(args.repeats):
                for name, flat in flats.items():
                    times[name].append(time_products(flat, rows) * 1e3)
            median = {name: statistics.median(t) for name, t in times.items()}
            cells = [f"{median[n]:.1f} ({min(times[n]):.1f}-{max(times[n]):.1f})" for n in flats]
            lines.append(f"| {rows} | {cells[0]} | {cells[1]} | {median['packed'] / median['torch']:.2f} |")
    return publish(SECTION, "\n".join(lines) + "\n", write=args.write)


if __name__ == "__main__":
    raise SystemExit(main())
