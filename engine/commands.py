"""`batchtop generate`, `batchtop demo` and `batchtop record`: the embedded engine, headless.

`COMMANDS` maps each command's name to the function that adds its parser; the engine,
the model and torch are imported when a command runs, not when its parser is built.
"""
from __future__ import annotations

import json
import sys
import time

from .flags import add_engine_flags, engine_config
from .workload.arrivals import DISTRIBUTIONS

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for writing clear code.",
    "What is 17 times 23?",
    "Name the planets of the solar system in order.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "How does a hash table work?",
]


def add_sampling_flags(parser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true")


# -- generate and demo -------------------------------------------------------------------------------

def add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="run prompts through the engine at once and print the answers")
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    add_sampling_flags(gen)
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt, in order")
    add_engine_flags(gen)
    gen.set_defaults(func=cmd_generate)


def add_demo(sub) -> None:
    demo = sub.add_parser("demo", help="headless run over built-in chat prompts")
    add_sampling_flags(demo)
    add_engine_flags(demo)
    demo.set_defaults(func=cmd_demo)


def cmd_generate(args) -> int:
    from batchtop.engine.core.engine import Engine
    from batchtop.engine.core.sampling import SamplingParams
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    engine = Engine(engine_config(args))
    started = time.perf_counter()
    completions = engine.generate(args.prompt, sampling, chat=args.chat)
    elapsed = time.perf_counter() - started
    for c in completions:
        if args.json:
            print(json.dumps({"request_id": c.request_id, "token_ids": c.token_ids, "text": c.text,
                              "finish_reason": c.finish_reason, "num_preemptions": c.num_preemptions}))
        else:
            print(f"--- {c.request_id} ({len(c.token_ids)} tokens, {c.finish_reason})\n{c.text.strip()}\n")
    if not args.json:
        print(throughput_line(completions, elapsed, engine.step_count))
    return 0


def cmd_demo(args) -> int:
    """Headless: the default model answers the built-in chat prompts, all through the engine at once."""
    args.prompt, args.chat, args.json = DEMO_PROMPTS, True, False
    return cmd_generate(args)


def throughput_line(completions, elapsed: float, steps: int) -> str:
    prompt = sum(len(c.prompt_token_ids) for c in completions)
    output = sum(len(c.token_ids) for c in completions)
    return (f"{len(completions)} requests, {prompt} prompt + {output} output tokens in {elapsed:.2f} s "
            f"over {steps} steps: {output / elapsed:.1f} output tok/s, {(prompt + output) / elapsed:.1f} "
            "total tok/s")


# -- record ------------------------------------------------------------------------------------------

def add_record(sub) -> None:
    record = sub.add_parser("record",
                            help="run the embedded engine headless under a load and record its events")
    record.add_argument("--out", required=True, help="the JSONL event log to write")
    record.add_argument("--duration", type=float, default=None,
                        help="seconds to run (default: until a --trace is served and drained)")
    load = record.add_argument_group("load (a generator, or --trace)")
    load.add_argument("--trace", help='JSONL, one request a line: {"arrival_s", "prompt_tokens" or "prompt", '
                                      '"output_tokens"}')
    load.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second")
    for what, mean, high in (("prompt", 64, 1024), ("output", 64, 1024)):
        load.add_argument(f"--{what}-dist", choices=DISTRIBUTIONS, default="exponential")
        load.add_argument(f"--{what}-mean", type=float, default=mean, help="fixed and exponential")
        load.add_argument(f"--{what}-low", type=int, default=1, help="uniform low, pareto scale, clip low")
        load.add_argument(f"--{what}-high", type=int, default=high, help="uniform high, clip high")
        load.add_argument(f"--{what}-alpha", type=float, default=1.5, help="pareto shape")
    load.add_argument("--seed", type=int, default=0)
    add_engine_flags(record)
    record.set_defaults(func=cmd_record)


def load_from_args(args):
    """The trace of --trace, else a Poisson load with the length flags."""
    from batchtop.engine.workload.arrivals import LengthDist, PoissonLoad, TraceLoad
    if args.trace:
        return TraceLoad.from_file(args.trace)
    dists = [LengthDist(getattr(args, f"{w}_dist"), getattr(args, f"{w}_mean"), getattr(args, f"{w}_low"),
                        getattr(args, f"{w}_high"),
                        getattr(args, f"{w}_alpha")) for w in ("prompt", "output")]
    return PoissonLoad(args.rate, *dists, seed=args.seed)


def cmd_record(args) -> int:
    if args.duration is None and not args.trace:
        raise ValueError("give --duration, or a --trace to serve to the end")
    load = load_from_args(args)              # a bad trace is named before torch and the model load
    from batchtop.engine.core.engine import Engine
    from batchtop.engine.core.loop import EngineLoop
    from batchtop.engine.whatif.recording import engine_header
    from batchtop.telemetry.bus import EventBus
    from batchtop.telemetry.recorder import Recorder
    bus = EventBus()
    engine = Engine(engine_config(args), sink=bus)
    setup = engine_header(engine)
    with Recorder(args.out, model=args.model, knobs=engine.knobs(), bus=bus,
                  header_extra={"engine": setup}) as recorder:
        loop = EngineLoop(engine, load=load, load_seed=args.seed).start()
        try:
            _wait_for_end(args, loop)
        except KeyboardInterrupt:
            pass
        loop.stop()
        if loop.error is not None:
            raise loop.error
    print(f"recorded {recorder.num_written} events over {engine.step_count} steps to {args.out}",
          file=sys.stderr)
    return 0


def _wait_for_end(args, loop) -> None:
    """Until --duration has passed, or a --trace is all served and no request is left, or the loop died."""
    started = time.monotonic()
    while loop.running:
        if args.duration is not None and time.monotonic() - started >= args.duration:
            return
        if args.trace and loop.served_load():
            return
        time.sleep(0.05)


COMMANDS = {"generate": add_generate, "demo": add_demo, "record": add_record}
