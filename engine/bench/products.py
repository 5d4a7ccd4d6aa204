"""The model's products on the CPU kernel's packed weights against torch's fp32 matmul, per row count.

    python -m batchtop.engine.bench.products [--model smollm2] [--threads 1] [--repeats 5]
        [--engine-repeats 2] [--write]

Every linear of every layer (q/k/v, o, gate/up, down, as the forward fuses them) over an input of M
rows, the two ways alternated within each repeat, so a noisy machine slows both alike; the median
and the range of the repeats are printed with their ratio. It is what `cpu.products_pay()` and
`cpu.torch_products_from_rows()` decide: the engine packs its weights where the packed products win,
and where they lose from some row count on, those steps' products are torch's.
With `--engine-repeats N`, the engine itself (max_num_seqs 16) on two traces, its forward as it
chooses against torch's products throughout, alternated N times.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from datetime import date

import torch

from batchtop.kernels import cpu

from .engine import make_trace, run_batchtop
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
    parser.add_argument("--engine-repeats", type=int, default=0,
                        help="also time the engine on two traces: its forward against torch's products")
    parser.add_argument("--write", action="store_true", help="write the section of docs/benchmarks.md")
    args = parser.parse_args(argv)
    if not cpu.available():
        parser.error(f"the C++ kernels are unavailable: {cpu.unavailable_reason()}")
    from batchtop.engine.model.forward import FlatForward
    from batchtop.engine.model.loading import load_model
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    model = loaded.model
    flats = {"packed": FlatForward(model, packed=True), "torch": FlatForward(model, packed=False)}
    for linear in (linear for layer in flats["packed"].layers for linear in layer.linears):
        linear.torch_from_rows = None          # the packed products at every row count
    lines = [SECTION, "",
             f"{date.today()}, commit {commit()}, {cpu_name()}, {args.threads} thread(s), {args.model}; "
             f"`python -m batchtop.engine.bench.products --threads {args.threads} --repeats {args.repeats}"
             f"{'' if args.rows == list(DOC_ROWS) else ' --rows ' + ' '.join(map(str, args.rows))}"
             f"{f' --engine-repeats {args.engine_repeats}' if args.engine_repeats else ''}`. "
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
    if args.engine_repeats:
        lines += ["", *engine_table(loaded, args.engine_repeats)]
    return publish(SECTION, "\n".join(lines) + "\n", write=args.write)


def engine_traces() -> dict[str, tuple[list, list]]:
    rng = random.Random(1)
    prompts = [[rng.randrange(1000, 30000) for _ in range(rng.randint(300, 700))] for _ in range(16)]
    return {"48 requests, prompts 16-128 tokens, outputs mean 64 (the engine benchmark's)": make_trace(0, 48),
            "16 requests, prompts 300-700 tokens, outputs 8": (prompts, [8] * 16)}


def engine_table(loaded, repeats: int) -> list[str]:
    """Wall seconds of the engine on each trace: the forward it builds (`FlatForward(model)`) against one
    with torch's products, alternated. The runner takes the model's forward from `runner._flat_forwards`."""
    from batchtop.engine.model import runner
    from batchtop.engine.model.forward import FlatForward
    forwards = {"chosen": FlatForward(loaded.model), "torch": FlatForward(loaded.model, packed=False)}
    lines = ["The engine (max_num_seqs 16) with the forward it builds on this CPU "
             f"(`cpu.torch_products_from_rows()`: {cpu.torch_products_from_rows()}) against torch's products "
             f"throughout, {repeats} alternated runs:", "",
             "| trace | its forward s (median, range) | torch's products s | ratio |", "|---|---:|---:|---:|"]
    for name, (prompts, lengths) in engine_traces().items():
        times = {arm: [] for arm in forwards}
        for r in range(repeats):
            for arm in (list(forwards) if r % 2 == 0 else list(forwards)[::-1]):
                runner._flat_forwards[loaded.model] = forwards[arm]
                times[arm].append(run_batchtop(loaded, prompts, lengths, max_num_seqs=16))
        median = {arm: statistics.median(t) for arm, t in times.items()}
        cells = [f"{median[a]:.2f} ({min(times[a]):.2f}-{max(times[a]):.2f})" for a in forwards]
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {median['chosen'] / median['torch']:.2f} |")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
