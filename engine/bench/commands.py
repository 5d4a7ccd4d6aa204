"""`batchtop bench` and `batchtop sweep`: the serving benchmark of `serving.py` on the command line.

`COMMANDS` maps each command's name to the function that adds its parser; the benchmark
(numpy, httpx, the engine) is imported when a command runs, not when its parser is built.
"""
from __future__ import annotations

import json
import math
import sys

from batchtop.engine.flags import add_engine_flags, engine_config


def add_bench_flags(parser) -> None:
    g = parser.add_argument_group("benchmark")
    g.add_argument("--base-url", default=None,
                   help="an OpenAI-compatible server; default: the embedded engine")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="server endpoint (chat needs text prompts: the sharegpt dataset)")
    g.add_argument("--api-key", default=None, help="bearer token for the server")
    g.add_argument("--served-model-name", default=None, help="model name to send (default: the server's)")
    g.add_argument("--dataset-name", choices=["random", "sharegpt"], default="random")
    g.add_argument("--dataset-path", default=None, help="ShareGPT JSON file")
    g.add_argument("--tokenizer", default=None,
                   help="HF tokenizer folder for sharegpt lengths (default: SmolLM2's)")
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument("--random-input-len", type=int, default=128)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--sharegpt-output-len", type=int, default=None, help="fixed output length for sharegpt")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s (default inf: all at once)")
    g.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape of the gaps (1: Poisson)")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-ignore-eos", action="store_true", help="let EOS end requests early")
    g.add_argument("--goodput", nargs="+", default=None, metavar="SLO",
                   help="SLOs in ms for goodput: ttft:500 tpot:50 e2el:5000")
    g.add_argument("--save-result", default=None, metavar="PATH", help="write the result as JSON")


def add_bench(sub) -> None:
    bench = sub.add_parser("bench",
                           help="serving benchmark against a server (--base-url) or the embedded engine")
    add_bench_flags(bench)
    add_engine_flags(bench)
    bench.set_defaults(func=cmd_bench)


def add_sweep(sub) -> None:
    # conflict_handler: the sweep's --max-num-seqs (a list of values) replaces the engine's
    sweep = sub.add_parser("sweep", conflict_handler="resolve",
                           help="the same trace at several max_num_seqs: the embedded engine, or a server "
                                "started per value (--launch)")
    add_bench_flags(sweep)
    add_engine_flags(sweep)
    sweep.add_argument("--max-num-seqs", dest="values", default="1,4,16,64,256",
                       help="comma-separated max_num_seqs values (default 1,4,16,64,256)")
    sweep.add_argument("--no-color", action="store_true", help="plain plot (for files)")
    sweep.add_argument("--launch", default=None, metavar="COMMAND",
                       help="a server command with {max_num_seqs} (and optionally {port}, from --base-url, "
                            "default http://127.0.0.1:8000): started, benchmarked and stopped for each value")
    sweep.add_argument("--startup-timeout", type=float, default=600.0, metavar="SECONDS",
                       help="with --launch: how long a server may take to answer /health")
    sweep.set_defaults(func=cmd_sweep, max_num_seqs=1)


def dataset_from_args(args):
    from .serving import random_dataset, sharegpt_dataset
    if args.dataset_name == "random":
        return random_dataset(args.num_prompts, args.random_input_len, args.random_output_len,
                              args.random_range_ratio, args.seed)
    if not args.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path")
    return sharegpt_dataset(args.dataset_path, args.num_prompts, _tokenizer(args.tokenizer), args.seed,
                            args.sharegpt_output_len)


def _tokenizer(path: str | None):
    import transformers

    from batchtop.engine.model.loading import cache_dir
    folder = path or str(cache_dir() / "smollm2")
    return transformers.AutoTokenizer.from_pretrained(folder)


def _pacing(args) -> dict:
    """How requests are sent: the keyword arguments of `serving.run_benchmark` besides the requests."""
    return dict(request_rate=args.request_rate, burstiness=args.burstiness,
                max_concurrency=args.max_concurrency, seed=args.seed)


def cmd_bench(args) -> int:
    """Print the table; --save-result writes the JSON. Exit 1 when a request failed."""
    from . import serving as bs
    config = engine_config(args)
    requests = dataset_from_args(args)
    slos = bs.parse_goodput(args.goodput)
    if args.base_url:
        model = args.served_model_name or bs.served_model(args.base_url, args.api_key)
        results, duration = bs.bench_server(args.base_url, model, requests, chat=args.endpoint == "chat",
                                            api_key=args.api_key, ignore_eos=not args.no_ignore_eos,
                                            **_pacing(args))
        backend = f"openai {args.base_url}"
    else:
        model, backend = config.model, "embedded"
        results, duration, _ = bs.bench_embedded(config, requests, **_pacing(args))
    settings = {"backend": backend, "model": model, "dataset": args.dataset_name,
                "num_prompts": len(requests), "request_rate": args.request_rate,
                "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "seed": args.seed}
    summary = bs.summarize(results, duration, slos=slos, extra={"max_concurrency": args.max_concurrency})
    print(bs.format_table(summary))
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(bs.result_json(summary, results, settings), f, indent=2, default=str)
    return 0 if summary["failed"] == 0 else 1


def cmd_sweep(args) -> int:
    """The same trace at each --max-num-seqs value; table and plot. Exit 1 when a point failed."""
    from . import serving as bs
    config = engine_config(args)
    values = sorted({int(v) for v in args.values.split(",") if v.strip()})
    if not values or values[0] < 1:
        raise ValueError(f"--max-num-seqs values must be integers >= 1, got {args.values!r}")
    requests = dataset_from_args(args)
    if args.launch:
        from .sweep_launch import sweep_launched
        points = sweep_launched(args.launch, values, requests, base_url=args.base_url or "http://127.0.0.1:8000",
                                model=args.served_model_name, api_key=args.api_key,
                                startup_timeout_s=args.startup_timeout, ignore_eos=not args.no_ignore_eos,
                                log=lambda line: print(line, file=sys.stderr, flush=True), **_pacing(args))
    else:
        points = bs.sweep(config, requests, values, **_pacing(args))
    print(bs.sweep_table(points))
    print(bs.sweep_plot(points, color=not args.no_color))
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(points, f, indent=2, default=str)
    return 1 if any("error" in p for p in points) else 0


COMMANDS = {"bench": add_bench, "sweep": add_sweep}
