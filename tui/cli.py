"""The one entry point: `batchtop [COMMAND] ...`."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
import time

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
    g.add_argument("--policy", choices=["fcfs", "priority"], default="fcfs")
    g.add_argument("--preemption-mode", choices=["recompute", "retract"], default="recompute")
    g.add_argument("--batching-mode", choices=["continuous", "static", "dynamic"], default="continuous")
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


def engine_config(args):
    from batchtop.engine.core.config import EngineConfig
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
        print(_throughput_line(completions, elapsed, engine.step_count))
    return 0


def cmd_demo(args) -> int:
    """Headless: the default model answers the built-in chat prompts, all through the engine at once."""
    args.prompt, args.chat, args.json = DEMO_PROMPTS, True, False
    return cmd_generate(args)


def _throughput_line(completions, elapsed: float, steps: int) -> str:
    prompt = sum(len(c.prompt_token_ids) for c in completions)
    output = sum(len(c.token_ids) for c in completions)
    return (f"{len(completions)} requests, {prompt} prompt + {output} output tokens in {elapsed:.2f} s "
            f"over {steps} steps: {output / elapsed:.1f} output tok/s, {(prompt + output) / elapsed:.1f} total tok/s")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchtop", description="top for the batch of an LLM inference engine")
    sub = parser.add_subparsers(dest="command")

    gen = sub.add_parser("generate", help="run prompts through the engine at once and print the answers")
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    _add_sampling_flags(gen)
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt, in order")
    add_engine_flags(gen)
    gen.set_defaults(func=cmd_generate)

    demo = sub.add_parser("demo", help="headless run over built-in chat prompts")
    _add_sampling_flags(demo)
    add_engine_flags(demo)
    demo.set_defaults(func=cmd_demo)
    _add_server_commands(sub)
    _add_vllm_commands(sub)
    add_dashboard_commands(sub)
    _add_record_commands(sub)
    return parser


# -- record and export ------------------------------------------------------------------------------

def _add_record_commands(sub) -> None:
    record = sub.add_parser("record", help="run the embedded engine headless under a load and record its events")
    record.add_argument("--out", required=True, help="the JSONL event log to write")
    record.add_argument("--duration", type=float, default=None,
                        help="seconds to run (default: until a --trace is served and drained)")
    load = record.add_argument_group("load (a generator, or --trace)")
    load.add_argument("--trace", help='JSONL, one request a line: {"arrival_s", "prompt_tokens" or "prompt", '
                                      '"output_tokens"}')
    load.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second")
    for what, mean, high in (("prompt", 64, 1024), ("output", 64, 1024)):
        load.add_argument(f"--{what}-dist", choices=["fixed", "uniform", "exponential", "pareto"],
                          default="exponential")
        load.add_argument(f"--{what}-mean", type=float, default=mean, help="fixed and exponential")
        load.add_argument(f"--{what}-low", type=int, default=1, help="uniform low, pareto scale, clip low")
        load.add_argument(f"--{what}-high", type=int, default=high, help="uniform high, clip high")
        load.add_argument(f"--{what}-alpha", type=float, default=1.5, help="pareto shape")
    load.add_argument("--seed", type=int, default=0)
    add_engine_flags(record)
    record.set_defaults(func=cmd_record)

    export = sub.add_parser("export", help="turn a recorded log into a Chrome/Perfetto trace, a CSV or a summary")
    export.add_argument("log")
    export.add_argument("--format", choices=["chrome", "csv", "summary"], default="summary")
    export.add_argument("--out", help="file to write (default: stdout)")
    export.set_defaults(func=cmd_export)


def _load_from_args(args):
    from batchtop.engine.workload.arrivals import LengthDist, PoissonLoad, TraceLoad
    if args.trace:
        return TraceLoad.from_file(args.trace)
    dists = [LengthDist(getattr(args, f"{w}_dist"), getattr(args, f"{w}_mean"), getattr(args, f"{w}_low"),
                        getattr(args, f"{w}_high"), getattr(args, f"{w}_alpha")) for w in ("prompt", "output")]
    return PoissonLoad(args.rate, *dists, seed=args.seed)


def cmd_record(args) -> int:
    from batchtop.engine.core.engine import Engine
    from batchtop.engine.core.loop import EngineLoop
    from batchtop.telemetry.bus import EventBus
    from batchtop.telemetry.recorder import Recorder
    if args.duration is None and not args.trace:
        raise ValueError("give --duration, or a --trace to serve to the end")
    load = _load_from_args(args)
    bus = EventBus()
    engine = Engine(engine_config(args), sink=bus)
    with Recorder(args.out, model=args.model, knobs=engine.knobs(), bus=bus) as recorder:
        loop = EngineLoop(engine, load=load, load_seed=args.seed).start()
        started = time.monotonic()
        try:
            while loop.running:
                elapsed = time.monotonic() - started
                if args.duration is not None and elapsed >= args.duration:
                    break
                if args.trace and load.exhausted and not loop.call(engine.has_unfinished):
                    break
                time.sleep(0.05)
        except KeyboardInterrupt:
            pass
        loop.stop()
        if loop.error is not None:
            raise loop.error
    print(f"recorded {recorder.num_written} events over {engine.step_count} steps to {args.out}", file=sys.stderr)
    return 0


def cmd_export(args) -> int:
    from batchtop.telemetry.export import summary_text, to_chrome_trace, to_csv
    from batchtop.telemetry.recorder import read_log
    header, events = read_log(args.log)
    if args.format == "chrome":
        text = json.dumps(to_chrome_trace(header, events))
    elif args.format == "csv":
        text = to_csv(events)
    else:
        text = summary_text(header, events)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0


def cmd_serve(args) -> int:
    from batchtop.engine.server.app import build_server, serve
    from batchtop.telemetry.stream import check_bind
    check_bind(args.host, args.api_key)          # before the model load: fail fast
    server = build_server(engine_config(args), api_key=args.api_key, model_name=args.served_model_name,
                          event_history=args.event_history, max_body_bytes=args.max_body_bytes)
    print(f"batchtop: serving {server.model_name} on http://{args.host}:{args.port}", file=sys.stderr)
    serve(server, args.host, args.port, access_log=args.access_log)
    return 0


def cmd_bench(args) -> int:
    from batchtop.engine.bench.serving import run_bench
    return run_bench(args, engine_config(args))


def cmd_sweep(args) -> int:
    from batchtop.engine.bench.serving import run_sweep
    return run_sweep(args, engine_config(args))


def cmd_top(args) -> int:
    from batchtop.tui.metrics.source import MetricsSource, NotAServer, detect
    try:
        kind = detect(args.url, args.api_key)
    except NotAServer as error:
        print(f"batchtop: {error}", file=sys.stderr)
        return 2
    if kind == "events":
        from .app import BatchtopApp
        from .remote_source import RemoteSource
        BatchtopApp(source_factory=lambda: RemoteSource(args.url, args.api_key), loading_what=args.url,
                    refresh_s=args.refresh).run()
        return 0
    from batchtop.tui.metrics.app import MetricsApp
    source = MetricsSource(args.url, kind, args.api_key, period_s=args.period).start()
    MetricsApp(source, engine=args.engine).run()
    return 0


def _add_server_commands(sub) -> None:
    import os
    from batchtop.engine.bench.serving import add_bench_flags
    serve = sub.add_parser("serve", help="OpenAI-compatible server with telemetry events and live control")
    serve.add_argument("--host", default="127.0.0.1", help="without --api-key only loopback is allowed")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=os.environ.get("BATCHTOP_API_KEY"),
                       help="require `Authorization: Bearer KEY` on every endpoint (env BATCHTOP_API_KEY)")
    serve.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    serve.add_argument("--event-history", type=int, default=100_000, help="events kept for stream resumption")
    serve.add_argument("--max-body-bytes", type=int, default=2 * 2**20,
                       help="larger request bodies get 413 (default 2 MiB)")
    serve.add_argument("--access-log", action="store_true")
    add_engine_flags(serve)
    serve.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="serving benchmark against a server (--base-url) or the embedded engine")
    add_bench_flags(bench)
    add_engine_flags(bench)
    bench.set_defaults(func=cmd_bench)

    sweep = sub.add_parser("sweep", conflict_handler="resolve",
                           help="the same trace at several max_num_seqs: the embedded engine, or a server "
                                "started per value (--launch)")
    add_bench_flags(sweep)
    add_engine_flags(sweep)
    sweep.add_argument("--max-num-seqs", dest="values", default="1,4,16,64,256",
                       help="comma-separated max_num_seqs values (default 1,4,16,64,256)")
    sweep.add_argument("--no-color", action="store_true", help="plain plot (for files)")
    sweep.add_argument("--launch", default=None, metavar="COMMAND",
                       help="a server command with {max_num_seqs} (and optionally {port}, from --base-url, default "
                            "http://127.0.0.1:8000): started, benchmarked and stopped for each value")
    sweep.add_argument("--startup-timeout", type=float, default=600.0, metavar="SECONDS",
                       help="with --launch: how long a server may take to answer /health")
    sweep.set_defaults(func=cmd_sweep, max_num_seqs=1)

    top = sub.add_parser("top", help="the dashboard over a running server: batchtop serve, batchtop's "
                                     "scheduler in vLLM, or any vLLM / SGLang through /metrics")
    top.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    top.add_argument("--api-key", default=os.environ.get("BATCHTOP_API_KEY"))
    top.add_argument("--period", type=float, default=1.0, metavar="SECONDS",
                     help="over /metrics: scrape every SECONDS (default 1)")
    top.add_argument("--engine", default=None,
                     help="over /metrics: the engine to show first, e.g. engine=1 (e cycles; default the first)")
    _add_refresh_flag(top)
    top.set_defaults(func=cmd_top)


def _add_sampling_flags(parser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true")


# -- dashboard and replay (owned by tui/; keep these functions together) --------------------------

# The dashboard's redraw period over a live engine (like top's delay): drawing is the UI thread's
# main cost and takes CPU and the GIL from the engine (docs/benchmarks.md, Dashboard overhead).
LIVE_REFRESH_S = 0.5


def _refresh_seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 60:
        raise argparse.ArgumentTypeError(f"must be between 0 and 60 seconds, got {text}")
    return value


def _add_refresh_flag(parser) -> None:
    parser.add_argument("--refresh", type=_refresh_seconds, default=LIVE_REFRESH_S, metavar="SECONDS",
                        help=f"redraw at most this often while events flow (default {LIVE_REFRESH_S}; "
                             "keys redraw at once)")


def add_dashboard_commands(sub) -> None:
    dash = sub.add_parser("dashboard", help="the live dashboard over the embedded engine and its load generator")
    add_engine_flags(dash)
    load = dash.add_argument_group("load generator")
    load.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second (0: none)")
    load.add_argument("--length-dist", choices=["fixed", "uniform", "exponential", "pareto"], default="exponential",
                      help="prompt and output length distribution")
    load.add_argument("--prompt-mean", type=float, default=64.0)
    load.add_argument("--output-mean", type=float, default=64.0)
    load.add_argument("--seed", type=int, default=0)
    dash.add_argument("--record", metavar="LOG", help="record every event to this JSONL log from the start")
    from batchtop.engine.workload.scenarios import SCENARIOS
    dash.add_argument("--scenario", choices=list(SCENARIOS),
                      help="set the load and knobs that make one phenomenon of the reference text happen "
                           "(docs/scenarios.md); z cycles them in the dashboard")
    _add_refresh_flag(dash)
    dash.set_defaults(func=cmd_dashboard)
    replay = sub.add_parser("replay", help="the dashboard over a recorded event log")
    replay.add_argument("log", help="a JSONL event log (batchtop --record, or r in the dashboard)")
    replay.add_argument("--speed", type=float, default=1.0, help="playback speed")
    replay.add_argument("--paused", action="store_true", help="start paused at the beginning")
    replay.set_defaults(func=cmd_replay)


def _add_vllm_commands(sub) -> None:
    vllm = sub.add_parser("vllm", help="vLLM (from .venv-vllm) with batchtop's scheduler class inside")
    vsub = vllm.add_subparsers(dest="vllm_command", required=True)
    serve = vsub.add_parser("serve", help="start vLLM's OpenAI server with batchtop's scheduler class and its "
                                          "event endpoint (then: batchtop top --url http://HOST:EVENTS_PORT)")
    serve.add_argument("--model", default="smollm2", help="smollm2 (batchtop's converted copy) or a model folder")
    serve.add_argument("--served-model-name", default="smollm2")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8100, help="vLLM's OpenAI API")
    serve.add_argument("--events-port", type=int, default=None,
                       help="batchtop's event endpoint (default: PORT + 1; + the data-parallel rank)")
    serve.add_argument("--max-num-seqs", type=int, default=64)
    serve.add_argument("--max-model-len", type=int, default=2048)
    serve.add_argument("--num-gpu-blocks-override", type=int, default=None, help="a small KV pool, in vLLM blocks")
    serve.add_argument("--kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    serve.add_argument("--enforce-eager", action="store_true", help="no torch.compile: a faster start")
    kind = serve.add_mutually_exclusive_group()
    kind.add_argument("--async-scheduling", action="store_true",
                      help="BatchtopAsyncScheduler (vLLM's async scheduling; vLLM's CPU build schedules synchronously)")
    kind.add_argument("--stock", action="store_true", help="vLLM's own scheduler: /metrics only")
    serve.add_argument("--print-command", action="store_true", help="print the command line and exit")
    serve.add_argument("vllm_args", nargs="*", help="more vLLM arguments, after --")
    serve.set_defaults(func=cmd_vllm_serve)


def cmd_vllm_serve(args) -> int:
    from batchtop.engine.vllm.launch import serve_vllm
    return serve_vllm(args)


def cmd_dashboard(args) -> int:
    from .app import BatchtopApp
    from .sources import EngineSource
    config = engine_config(args)
    message = ""
    if args.scenario:
        from batchtop.engine.workload.scenarios import SCENARIOS
        scenario = SCENARIOS[args.scenario]
        config = dataclasses.replace(config, **scenario.config)
        message = f"scenario {scenario.name}: {scenario.watch}"

    def build():
        source = EngineSource.create(config, load_rate=args.rate, length_dist=args.length_dist,
                                     prompt_mean=args.prompt_mean, output_mean=args.output_mean, seed=args.seed)
        if args.scenario:
            source.start_scenario(args.scenario, "cli")
        return source
    BatchtopApp(source_factory=build, loading_what=f"model {args.model}", record_path=args.record,
                refresh_s=args.refresh, message=message).run()
    return 0


def cmd_replay(args) -> int:
    from .app import BatchtopApp
    from .sources import ReplaySource
    try:
        source = ReplaySource.from_file(args.log, speed=args.speed, paused=args.paused)
    except OSError as error:
        print(f"batchtop: error: cannot read {args.log}: {error.strerror}", file=sys.stderr)
        return 2
    BatchtopApp(source).run()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["dashboard", *argv]
    args = parser.parse_args(argv)
    from batchtop.telemetry import flight
    if threading.current_thread() is threading.main_thread():
        flight.install_signal_handlers()        # SIGTERM, SIGINT: the engine's last steps are written out
    try:
        return args.func(args)
    except (ValueError, OSError) as error:
        print(f"batchtop: error: {error}", file=sys.stderr)
        flight.dump_all(f"batchtop {args.command} exited with an error", str(error))
        return 2
    except Exception as error:
        flight.dump_all(f"batchtop {args.command} exited with an error", f"{type(error).__name__}: {error}")
        raise


if __name__ == "__main__":
    sys.exit(main())
