"""Engine benchmark: one seeded trace, side by side in one run, written to docs/benchmarks.md.

    python -m batchtop.engine.bench.engine            (make bench-engine)

Trace: 64 requests at once, prompts uniform 16..128 tokens, outputs exponential (mean 64)
clipped to [4, 256], EOS ignored so every request produces exactly its length. Contenders:
batchtop (continuous), transformers `generate` one request at a time, `generate` on
left-padded static batches of 16, and transformers' own continuous batching. Also: the
trace's compute floor (its matmul FLOPs over the best fp32 GEMM rate measured here, MKL's or
the engine's own kernel's), and the decode step time at 1..256 rows against the weight-streaming floor.

    python -m batchtop.engine.bench.engine --device cuda --dtype bfloat16 --random-weights

runs the same contenders on a GPU (its own section, without the CPU floors); --random-weights
builds SmolLM2's architecture with seeded random weights for a machine that has the tokenizer
in the cache but not the weights (the same work per token; the text is meaningless). On a GPU
batchtop runs with its decode steps replayed from CUDA graphs and again without them
(`--cuda-graphs both`, the default there; `on` or `off` runs one), the decode step times side by
side, with the graphs' capture cost and the share of tokens they padded.
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from batchtop.engine.core.config import EngineConfig
from batchtop.engine.core.engine import Engine
from batchtop.engine.core.sampling import SamplingParams
from batchtop.engine.model.forward import supports
from batchtop.engine.model.loading import LoadedModel, load_model, smollm2_folder
from batchtop.engine.model.runner import flat_forward_for
from batchtop.kernels import cpu
from batchtop.telemetry import events as ev
from batchtop.telemetry.weights import weight_macs

from .figures import commit, cpu_name, publish

SECTION = "## Engine: batchtop vs transformers"
CUDA_SECTION = "## Engine on CUDA: batchtop vs transformers"


def make_trace(seed: int = 0, num_requests: int = 64, vocab=(1000, 30000)):
    rng = random.Random(seed)
    prompts = [[rng.randrange(*vocab) for _ in range(rng.randint(16, 128))] for _ in range(num_requests)]
    lengths = [min(256, max(4, round(rng.expovariate(1 / 64)))) for _ in range(num_requests)]
    return prompts, lengths


def best_gemm_rates(model, rows=(64, 128, 256), repeats=20) -> tuple[float, float]:
    """(FMA, tiles): the best fp32 FLOP/s over the model's own weights on the FMA units -- MKL's
    F.linear and the engine's packed kernel (kernels/cpu.py) on fp32 panels and, for weights in block
    form, on their blocks, whichever is fastest -- and of the engine's block weights on the AMX tile
    unit (fp32-accurate through exact bf16 parts; 0 where there is no AMX or no weight in block form)."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weights = {tuple(m.weight.shape): m.weight.detach() for m in linears}
    fma, tiles = [F.linear], []
    if cpu.available():
        fp32 = {shape: cpu.pack_linear(weight, blocks=False) for shape, weight in weights.items()}
        fma.append(lambda x, weight: cpu.packed_linear(x, fp32[tuple(weight.shape)]))
        blocks = {shape: cpu.pack_linear(weight) for shape, weight in weights.items()}
        if any(p.scale is not None for p in blocks.values()):     # else the fp32 panels again
            fma.append(lambda x, weight: cpu.packed_linear(x, blocks[tuple(weight.shape)], amx_min_rows=None))
            if cpu.amx_available():
                tiles.append(lambda x,
                             weight: cpu.packed_linear(x, blocks[tuple(weight.shape)], amx_min_rows=1))
    return best_rate(fma, weights.values(), rows, repeats), best_rate(tiles, weights.values(), rows, repeats)


def best_rate(gemms, weights, rows, repeats) -> float:
    """The best FLOP/s of any of `gemms(x, weight)` over the weights at each row count (0: none)."""
    best = 0.0
    for m in rows:
        for weight in weights:
            x = torch.randn(m, weight.shape[1])
            for gemm in gemms:
                gemm(x, weight)
                start = time.perf_counter()
                for _ in range(repeats):
                    gemm(x, weight)
                elapsed = (time.perf_counter() - start) / repeats
                best = max(best, 2 * m * weight.numel() / elapsed)
    return best


def step_roofline(tokens: int, rows: int, per_layer: float, per_head: float, gemm: float,
                  stream_s: float) -> float:
    """A step's bound: its matmul FLOPs (every token through the layers, the sampled rows through
    the LM head) at the GEMM rate, never under the weight-streaming floor."""
    return max(stream_s, (tokens * per_layer + rows * per_head) / gemm)


def roofline_floor(prompts, lengths, per_layer: float, per_head: float, gemm: float,
                   stream_s: float) -> float:
    """Seconds for the trace if every step ran at its own bound: the prompts at the GEMM rate, then
    decode step t with the rows whose output is longer than t."""
    prefill = sum(map(len, prompts)) * per_layer / gemm
    decode = 0.0
    for t in range(1, max(lengths)):
        rows = sum(1 for n in lengths if n > t)
        decode += step_roofline(rows, rows, per_layer, per_head, gemm, stream_s)
    return prefill + decode


def step_records(loaded, prompts, lengths, **config) -> list[tuple[int, int, float]]:
    """Another batchtop run, its steps timed through the engine's StepFinished events:
    (tokens computed, rows sampled, seconds) of each step."""
    records = []

    def sink(event):
        if isinstance(event, ev.StepFinished):
            records.append((event.num_tokens, len(event.sampled_request_ids), event.step_s))

    engine = Engine(EngineConfig(model=loaded.name, **config), loaded=loaded, sink=sink)
    engine.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])
    return records


PROMPT_STEPS = "carry prompt tokens"
DECODE_STEPS = ((8, "decode 1-8 rows"), (16, "decode 9-16 rows"), (32, "decode 17-32 rows"),
                (math.inf, "decode 33+ rows"))


def breakdown_table(records, per_layer: float, per_head: float, gemm: float, stream_s: float) -> list[str]:
    """The steps by kind, each against its own bound (`step_roofline`)."""
    totals = {kind: [0, 0.0, 0.0] for kind in (PROMPT_STEPS, *(name for _, name in DECODE_STEPS))}
    for tokens, rows, seconds in records:
        total = totals[PROMPT_STEPS if tokens > rows
                       else next(name for most, name in DECODE_STEPS if rows <= most)]
        total[0] += 1
        total[1] += seconds
        total[2] += step_roofline(tokens, rows, per_layer, per_head, gemm, stream_s)
    return (["| steps that | steps | seconds | their roofline s | reached |", "|---|---:|---:|---:|---:|"]
            + [f"| {kind} | {n} | {seconds:.2f} | {roof:.2f} | {roof / seconds:.0%} |"
               for kind, (n, seconds, roof) in totals.items() if n])


def streamed_weight_bytes(model) -> int:
    """Bytes of weights a decode step reads: the projections and the LM head as the engine packed
    them (engine/model/forward.py), plus the norms; the embedding is read a row per token, not counted."""
    flat = flat_forward_for(model) if supports(model) else None
    if flat is None or flat.lm_head.packed is None:
        return sum(p.numel() * p.element_size() for p in model.parameters())
    packed = flat.lm_head.packed.nbytes + sum(linear.packed.nbytes for layer in flat.layers
                                              for linear in layer.linears)
    norms = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "norm" in name)
    return packed + norms


def machine_rates(model) -> tuple[float, float, float]:
    """(best fp32 GEMM FLOP/s on the FMA units, read bytes/s, best on the AMX tile unit) at this moment."""
    fma, tiles = best_gemm_rates(model)
    return fma, read_bandwidth(), tiles


def read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s of streaming a tensor larger than the caches (a sum reads every byte once)."""
    x = torch.ones(num_bytes // 4)
    x.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return num_bytes / min(times)


def random_smollm2(dtype: torch.dtype) -> LoadedModel:
    """SmolLM2's architecture and tokenizer with seeded random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    folder = smollm2_folder(print)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=dtype)
    return LoadedModel("smollm2", model.eval(), AutoTokenizer.from_pretrained(folder))


def _finish(model) -> float:
    """perf_counter once the model's device has finished its queued work."""
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return time.perf_counter()


def run_batchtop(loaded, prompts, lengths, **config) -> float:
    engine = Engine(EngineConfig(model=loaded.name, **config), loaded=loaded)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    engine.generate(prompts[:2], params[:2])                      # warm-up
    start = time.perf_counter()
    completions = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert [len(c.token_ids) for c in completions] == lengths
    return elapsed


@torch.inference_mode()
def run_hf_serial(model, prompts, lengths) -> float:
    start = time.perf_counter()
    for ids, n in zip(prompts, lengths):
        out = model.generate(torch.tensor([ids], device=model.device),
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=model.device),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False)
        assert out.shape[1] == len(ids) + n
    return _finish(model) - start


@torch.inference_mode()
def run_hf_static(model, pad_id, prompts, lengths, batch_size=16) -> tuple[float, float]:
    """Left-padded batches run to their longest row; returns (seconds, utilisation)."""
    start = time.perf_counter()
    row_steps = 0
    for i in range(0, len(prompts), batch_size):
        batch, ns = prompts[i:i + batch_size], lengths[i:i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max(ns), min_new_tokens=max(ns),
                             do_sample=False, pad_token_id=pad_id)
        row_steps += len(batch) * (out.shape[1] - width)
    return _finish(model) - start, sum(lengths) / row_steps


@torch.inference_mode()
def run_hf_continuous(model, prompts, lengths) -> float:
    from transformers import GenerationConfig
    config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(lengths))
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        start = time.perf_counter()
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, lengths)]
        produced = {}
        while len(produced) < len(ids):
            result = manager.get_result(timeout=60)
            if result is not None and result.is_finished():
                produced[result.request_id] = len(result.generated_tokens)
        elapsed = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    assert sorted(produced[i] for i in ids) == sorted(lengths)
    return elapsed


def telemetry_overhead(loaded, prompts, lengths, rounds: int = 5, **config) -> dict[str, list[float]]:
    """The same trace with telemetry off (no sink, no flight recorder) and with the recorder writing a
    log (and the flight recorder on, as always), alternated to share the machine's noise; the wall time of
    every run of each (off, recorder)."""
    import tempfile

    from batchtop.telemetry.recorder import Recorder
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    runs: dict[str, list[float]] = {"off": [], "recorder": []}
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(rounds):
            for mode in ("off", "recorder") if round_ % 2 == 0 else ("recorder", "off"):
                recorder = Recorder(Path(folder) / f"{round_}.jsonl",
                                    model=loaded.name) if mode == "recorder" else None
                off = {"flight_recorder_steps": 0} if mode == "off" else {}     # off: no event is built
                engine = Engine(EngineConfig(model=loaded.name, **{**config, **off}), loaded=loaded,
                                sink=recorder.sink if recorder else None)
                start = time.perf_counter()
                engine.generate(prompts, params)
                runs[mode].append(time.perf_counter() - start)
                if recorder:
                    recorder.close()
    return runs


DECODE_ROWS = (1, 4, 16, 64, 256)


def decode_engine(loaded, rows_list=DECODE_ROWS, **config) -> Engine:
    """An engine sized for `decode_step_times` (on a GPU its graphs are captured here)."""
    return Engine(EngineConfig(model=loaded.name, max_num_seqs=max(rows_list), max_num_batched_tokens=8192,
                               kv_cache_mb=4096, **config), loaded=loaded)


def decode_step_times(engine, rows_list=DECODE_ROWS, context=128, steps=8) -> dict[int, float]:
    """The median wall time of a decode step (sampled tokens read back included) at each row count."""
    times = {}
    for rows in rows_list:
        ids = [engine.add_request([1000 + i] * context, SamplingParams(max_tokens=steps + 4, ignore_eos=True))
               for i in range(rows)]
        while any(engine.requests[i].num_output_tokens == 0 for i in ids):
            engine.step()
        samples = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            samples.append(time.perf_counter() - start)
        times[rows] = statistics.median(samples)
        for i in ids:
            engine.abort(i)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--skip-serial", action="store_true", help="skip the slowest contender (~4 min)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    parser.add_argument("--telemetry", action="store_true", help="only the telemetry-overhead comparison")
    parser.add_argument("--device", default="cpu",
                        help="cpu (default), or cuda: its own section, no CPU floors")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--random-weights", action="store_true",
                        help="SmolLM2's architecture with seeded random weights (needs only its tokenizer)")
    parser.add_argument("--cuda-graphs", choices=["both", "on", "off"], default="both",
                        help="on a GPU: batchtop with decode steps from CUDA graphs, without, or both "
                             "(default)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.telemetry:
        return telemetry_main(args)
    dtype = getattr(torch, args.dtype)
    load = (lambda: random_smollm2(dtype)) if args.random_weights else (lambda: load_model("smollm2", dtype))
    loaded = load()
    reference = load()                          # plain transformers attention for the baselines
    reference.model.to(args.device)
    engine_config = dict(device=args.device, dtype=args.dtype)
    prompts, lengths = make_trace()
    useful = sum(lengths)
    on_cpu = args.device == "cpu"
    if on_cpu:
        per_layer, per_head = (2 * macs for macs in weight_macs(loaded.model.config))   # FLOPs
        flops = sum(len(p) for p in prompts) * per_layer + useful * (per_layer + per_head)
        # the machine's rates, sampled before, between and after the contenders: this VM drifts by tens of
        # percent from minute to minute, and a floor measured in a slow minute would flatter the fraction
        rates = [machine_rates(loaded.model)]
        print(f"trace: {len(prompts)} requests, {sum(map(len, prompts))} prompt + {useful} output tokens; "
              f"{flops / 1e12:.2f} TFLOP; best GEMM now {rates[0][0] / 1e9:.0f} GFLOP/s", flush=True)

    if not on_cpu:
        engine_config["cuda_graphs"] = "off" if args.cuda_graphs == "off" else "on"
    batchtop_config = dict(max_num_seqs=64, max_num_batched_tokens=args.max_num_batched_tokens,
                           **engine_config)
    batchtop_runs = [run_batchtop(loaded, prompts, lengths, **batchtop_config)]
    print(f"batchtop {batchtop_runs[0]:.1f} s", flush=True)
    results = {"batchtop (continuous)": batchtop_runs[0]}
    if on_cpu:
        rates.append(machine_rates(loaded.model))
    results["transformers continuous batching"] = run_hf_continuous(reference.model, prompts, lengths)
    print(f"hf continuous {results['transformers continuous batching']:.1f} s", flush=True)
    static_s, static_util = run_hf_static(reference.model, reference.tokenizer.pad_token_id or 0,
                                          prompts, lengths)
    results["transformers static batches of 16"] = static_s
    print(f"hf static {static_s:.1f} s (utilisation {static_util:.3f})", flush=True)
    if not args.skip_serial:
        results["transformers serial"] = run_hf_serial(reference.model, prompts, lengths)
        print(f"hf serial {results['transformers serial']:.1f} s", flush=True)
    # batchtop again after the transformers runs: the mean of the two brackets them, so a drift of the
    # machine's speed in between cancels to first order
    batchtop_runs.append(run_batchtop(loaded, prompts, lengths, **batchtop_config))
    print(f"batchtop again {batchtop_runs[1]:.1f} s", flush=True)
    ours = results["batchtop (continuous)"] = statistics.mean(batchtop_runs)
    if not on_cpu and args.cuda_graphs == "both":
        results["batchtop, CUDA graphs off"] = run_batchtop(loaded, prompts, lengths,
                                                           **{**batchtop_config, "cuda_graphs": "off"})
        print(f"batchtop without CUDA graphs {results['batchtop, CUDA graphs off']:.2f} s", flush=True)
    bracket = ("batchtop's row is the mean of a run before the transformers contenders "
               f"({batchtop_runs[0]:.1f} s) and one after them ({batchtop_runs[1]:.1f} s), so a drift of the "
               "machine's speed cancels to first order.")

    if not on_cpu:
        text = cuda_section(args, torch.cuda.get_device_name(args.device), loaded, prompts, lengths, results,
                            static_util, batchtop_config, bracket)
        return publish(CUDA_SECTION, text, write=not args.no_write)
    steps = decode_step_times(decode_engine(loaded, **engine_config))
    records = step_records(loaded, prompts, lengths, **batchtop_config)
    param_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    packed_bytes = streamed_weight_bytes(loaded.model)
    rates.append(machine_rates(loaded.model))
    gemm, bandwidth, tile_gemm = (max(sample) for sample in zip(*rates))
    floor_s = flops / gemm
    param_floor, stream_floor = param_bytes / bandwidth, packed_bytes / bandwidth

    lines = [SECTION, "",
             f"`make bench-engine` (python -m batchtop.engine.bench.engine), SmolLM2-135M fp32, "
             f"{args.threads} threads, measured {time.strftime('%Y-%m-%d')} at commit {commit()} "
             f"on {cpu_name()}.",
             f"Trace: {len(prompts)} requests at once, prompts uniform 16..128 tokens "
             f"({sum(map(len, prompts))} in all), outputs exponential mean 64 clipped to [4, 256] "
             f"({useful} in all), EOS ignored.", ""]
    lines += contender_table(results, useful, digits=1)
    lines += ["", bracket,
              f"Static batches of 16: utilisation {static_util:.3f} (useful row-steps / row-steps).",
              f"Compute floor: {flops / 1e12:.2f} TFLOP of matmuls ({per_layer / 1e6:.0f} MFLOP per prompt "
              f"token, {(per_layer + per_head) / 1e6:.0f} per generated token) at the best GEMM rate "
              f"measured here ({gemm / 1e9:.0f} GFLOP/s, the best of three samples through the run) = "
              f"{floor_s:.1f} s, i.e. {useful / floor_s:.0f} useful tok/s; "
              f"batchtop reaches {floor_s / ours:.0%} of it."]
    if tile_gemm:
        lines += [f"The engine's block-weight products of {cpu.AMX_MIN_ROWS} rows or more run on the AMX "
                  "tile unit instead (fp32-accurate: the q and three bf16 parts of x multiply exactly, "
                  f"docs/kernels.md), at up to {tile_gemm / 1e9:.0f} GFLOP/s on these shapes "
                  f"({tile_gemm / gemm:.2f}x the rate above); at that rate the floor would be "
                  f"{flops / tile_gemm:.1f} s and batchtop reaches {flops / tile_gemm / ours:.0%} of it."]
    lines += [""]
    lines += step_table(steps, digits=1)
    roofline_s = roofline_floor(prompts, lengths, per_layer, per_head, gemm, stream_floor)
    lines += ["", f"Weight-streaming floor of one step: {param_bytes / 1e6:.0f} MB of fp32 parameters at "
              f"{bandwidth / 1e9:.1f} GB/s read bandwidth (likewise the best of three samples) = "
              f"{param_floor * 1e3:.1f} ms; the 1-row step takes {steps[1] / param_floor:.2f}x that. "
              f"The engine streams {packed_bytes / 1e6:.0f} MB a step (its packed weights: the GGUF blocks "
              f"where a weight is in that form, docs/kernels.md) = {stream_floor * 1e3:.1f} ms; the 1-row "
              f"step takes {steps[1] / stream_floor:.2f}x that.", "",
              "Roofline floor of the trace: its prompts at the best GEMM rate, then one decode step per "
              f"output position ({max(lengths)} steps, the rows still running), each at least the streaming "
              f"floor of the engine's packed weights: "
              f"{roofline_s:.1f} s; batchtop reaches {roofline_s / ours:.0%} of it. (The compute floor above "
              f"ignores that the trace's long tail of few-row steps is bound by streaming the weights.)", "",
              f"Where the time goes: another batchtop run ({sum(r[2] for r in records):.1f} s), its "
              f"{len(records)} steps timed through the engine's StepFinished events, each against its own "
              f"roofline (its matmul FLOPs at the GEMM rate, at least the weight-streaming floor):", ""]
    lines += breakdown_table(records, per_layer, per_head, gemm, stream_floor) + [""]
    text = "\n".join(lines)
    return publish(SECTION, text, write=not args.no_write)


def contender_table(results: dict[str, float], useful: int, digits: int) -> list[str]:
    ours = results["batchtop (continuous)"]
    return (["| contender | wall s | useful out tok/s | batchtop is x faster |", "|---|---:|---:|---:|"]
            + [f"| {name} | {seconds:.{digits}f} | {useful / seconds:.1f} | {seconds / ours:.2f} |"
               for name, seconds in results.items()])


def step_table(steps: dict[int, float], digits: int) -> list[str]:
    return (["| decode rows | step ms | ms per row |", "|---:|---:|---:|"]
            + [f"| {rows} | {seconds * 1e3:.{digits}f} | {seconds * 1e3 / rows:.{digits + 1}f} |"
               for rows, seconds in steps.items()])


def graph_padding(loaded, prompts, lengths, **config) -> tuple[int, int]:
    """(tokens padded to fill replayed graphs, tokens computed) over one more run of the trace."""
    padded = computed = 0

    def sink(event):
        nonlocal padded, computed
        if isinstance(event, ev.StepFinished):
            padded += event.num_padded_tokens
            computed += event.num_tokens

    engine = Engine(EngineConfig(model=loaded.name, **config), loaded=loaded, sink=sink)
    engine.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])
    return padded, computed


# the CUDA graphs' targets: a decode step of at most 3 ms at 1-64 rows, the trace 4x faster than the first GPU
# measurement (5.73 s, before graphs existed)
TARGET_STEP_S, TARGET_STEP_ROWS, EAGER_TRACE_S, TARGET_SPEEDUP = 3e-3, 64, 5.73, 4.0


def cuda_section(args, device_name, loaded, prompts, lengths, results, static_util, batchtop_config,
                 bracket: str) -> str:
    useful = sum(lengths)
    weights = "seeded random weights" if args.random_weights else "its weights"
    command = " ".join(["python -m batchtop.engine.bench.engine", f"--device {args.device}",
                        f"--dtype {args.dtype}"]
                       + (["--random-weights"] if args.random_weights else [])
                       + (["--skip-serial"] if args.skip_serial else [])
                       + ([f"--cuda-graphs {args.cuda_graphs}"] if args.cuda_graphs != "both" else []))
    lines = [CUDA_SECTION, "",
             f"`{command}`, SmolLM2-135M's architecture with {weights}, {args.dtype}, on one {device_name}, "
             f"measured {time.strftime('%Y-%m-%d')} at commit {commit()}. The same trace as above: "
             f"{len(prompts)} requests, "
             f"{sum(map(len, prompts))} prompt and {useful} output tokens.", ""]
    lines += contender_table(results, useful, digits=2)
    lines += ["", bracket, f"Static batches of 16: utilisation {static_util:.3f}.", ""]
    modes = ("on", "off") if args.cuda_graphs == "both" else (batchtop_config["cuda_graphs"],)
    steps, capture = {}, None
    for mode in modes:
        engine = decode_engine(loaded, device=args.device, dtype=args.dtype, cuda_graphs=mode)
        steps[mode] = decode_step_times(engine)
        if engine.runner.decode_graphs is not None:
            capture = engine.runner.decode_graphs.capture
        del engine
    lines += graph_step_table(steps)
    if capture is not None:
        padded, computed = graph_padding(loaded, prompts, lengths, **batchtop_config)
        lines += ["",
                  f"CUDA graphs captured at start for decode steps of {', '.join(map(str, capture.sizes))} "
                  f"rows: {capture.memory_bytes / 2**20:.0f} MiB of device memory, {capture.seconds:.1f} s "
                  "(for the decode-step engine, batch capacity 256). Over the trace the graphs padded "
                  f"{padded} tokens to {computed} computed ({padded / (padded + computed):.1%} of the work)."]
    if "on" in steps:
        slowest = max(seconds for rows, seconds in steps["on"].items() if rows <= TARGET_STEP_ROWS)
        speedup = EAGER_TRACE_S / results["batchtop (continuous)"]
        lines += ["",
                  f"Targets: a decode step of at most {TARGET_STEP_S * 1e3:.0f} ms at 1-{TARGET_STEP_ROWS} "
                  f"rows: {'met' if slowest <= TARGET_STEP_S else 'not met'} (slowest {slowest * 1e3:.2f} "
                  f"ms); the trace at least {TARGET_SPEEDUP:.0f}x faster than the first GPU run's "
                  f"{EAGER_TRACE_S} s: {'met' if speedup >= TARGET_SPEEDUP else 'not met'} ({speedup:.1f}x)."]
    return "\n".join(lines + [""])


def graph_step_table(steps: dict[str, dict[int, float]]) -> list[str]:
    """Decode step times by rows, a column per CUDA-graphs mode, and their ratio when both ran."""
    modes = list(steps)
    header = "| decode rows | " + " | ".join(f"graphs {mode}: step ms" for mode in modes)
    lines = [header + (" | off / on |" if len(modes) == 2 else " |"),
             "|---:|" + "---:|" * (len(modes) + (len(modes) == 2))]
    for rows in steps[modes[0]]:
        cells = [f"{steps[mode][rows] * 1e3:.2f}" for mode in modes]
        if len(modes) == 2:
            cells.append(f"{steps['off'][rows] / steps['on'][rows]:.1f}x")
        lines.append(f"| {rows} | " + " | ".join(cells) + " |")
    return lines


def telemetry_main(args) -> int:
    loaded = load_model("smollm2")
    prompts, lengths = make_trace(num_requests=32)
    runs = telemetry_overhead(loaded, prompts, lengths, max_num_seqs=32,
                              max_num_batched_tokens=args.max_num_batched_tokens)
    off = statistics.median(runs["off"])
    rows = [f"| {mode} | {statistics.median(walls):.2f} | {min(walls):.2f}-{max(walls):.2f} "
            f"| {statistics.median(walls) / off:.3f} |" for mode, walls in runs.items()]
    text = "\n".join([
        TELEMETRY_SECTION, "",
        f"`python -m batchtop.engine.bench.engine --telemetry`, SmolLM2 fp32, {args.threads} threads, "
        f"{time.strftime('%Y-%m-%d')}, commit {commit()}, {cpu_name()}: the first 32 requests of the engine "
        "trace, telemetry off and the recorder writing every event to a JSONL log, alternated "
        f"{len(runs['off'])} times: the median wall time and the range. A difference within the ranges is "
        "more than this run can resolve; the recorder's cost per event is timed by itself in "
        "docs/events.md, \"Overhead\" (`python -m batchtop.telemetry.bench`).", "",
        "| telemetry | wall s | range | relative |", "|---|---:|---:|---:|", *rows, ""])
    return publish(TELEMETRY_SECTION, text, write=not args.no_write)


TELEMETRY_SECTION = "## Telemetry overhead"


if __name__ == "__main__":
    raise SystemExit(main())
