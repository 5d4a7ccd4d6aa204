"""`batchtop vllm serve`: vLLM's OpenAI server, from its own environment, with batchtop's scheduler inside.

Runs on batchtop's side. `COMMANDS` maps the command's name to the function that adds its
parser; `launch.py` (httpx, the model's conversion) is imported when the command runs.
"""
from __future__ import annotations

import os

from batchtop.engine.core.knobs import KNOBS


def add_vllm(sub) -> None:
    vllm = sub.add_parser("vllm", help="vLLM (from .venv-vllm) with batchtop's scheduler class inside")
    vsub = vllm.add_subparsers(dest="vllm_command", required=True)
    serve = vsub.add_parser("serve",
                            help="start vLLM's OpenAI server with batchtop's scheduler class and its "
                                          "event endpoint (then: batchtop top --url http://HOST:EVENTS_PORT)")
    serve.add_argument("--model", default="smollm2",
                       help="smollm2 (batchtop's converted copy) or a model folder")
    serve.add_argument("--served-model-name", default="smollm2")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8100, help="vLLM's OpenAI API")
    serve.add_argument("--events-port", type=int, default=None,
                       help="batchtop's event endpoint (default: PORT + 1; + the data-parallel rank)")
    serve.add_argument("--max-num-seqs", type=int, default=None,
                       help=f"{KNOBS['max_num_seqs'].help} (default: vLLM's own); the knob's upper limit "
                            "while vLLM runs")
    serve.add_argument("--max-model-len", type=int, default=2048)
    serve.add_argument("--num-gpu-blocks-override", type=int, default=None,
                       help="a small KV pool, in vLLM blocks")
    serve.add_argument("--kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    serve.add_argument("--enforce-eager", action="store_true", help="no torch.compile: a faster start")
    kind = serve.add_mutually_exclusive_group()
    kind.add_argument("--async-scheduling", action="store_true",
                      help="BatchtopAsyncScheduler (vLLM's async scheduling; vLLM's CPU build schedules "
                           "synchronously)")
    kind.add_argument("--stock", action="store_true", help="vLLM's own scheduler: /metrics only")
    serve.add_argument("--print-command", action="store_true", help="print the command line and exit")
    serve.add_argument("vllm_args", nargs="*", help="more vLLM arguments, after --")
    serve.set_defaults(func=cmd_vllm_serve)
    check = vsub.add_parser("check", help="is vLLM's environment ready for batchtop's class: version, the "
                                          "class for its async setting, the events port (runs vLLM's Python)")
    check.add_argument("--events-port", type=int, default=None, help="default: $BATCHTOP_EVENTS_PORT")
    check.add_argument("--host", default=None, help="default: $BATCHTOP_EVENTS_HOST or 127.0.0.1")
    check.add_argument("--data-parallel-size", type=int, default=1)
    check.set_defaults(func=cmd_vllm_check)


def cmd_vllm_serve(args) -> int:
    """Print the command, then become vLLM (Ctrl+C stops it as it stops vLLM)."""
    from .launch import shell_line, vllm_available, vllm_command, vllm_env
    reason = vllm_available()
    if reason:
        raise ValueError(reason)
    options = vllm_options(args)
    print(shell_line(options), flush=True)
    if args.print_command:
        return 0
    if options.events_port is not None:
        print(f"batchtop: the dashboard: batchtop top --url http://{options.host}:{options.events_port}",
              flush=True)
    command = vllm_command(options)
    os.execve(command[0], command, vllm_env(options))


def cmd_vllm_check(args) -> int:
    """`python -m batchtop.engine.vllm.check` in vLLM's environment (.venv-vllm or $BATCHTOP_VLLM_PYTHON)."""
    import subprocess

    from .launch import vllm_available, vllm_python
    reason = vllm_available()
    if reason:
        raise ValueError(reason)
    command = [str(vllm_python()), "-m", "batchtop.engine.vllm.check",
               "--data-parallel-size", str(args.data_parallel_size)]
    if args.events_port is not None:
        command += ["--events-port", str(args.events_port)]
    if args.host is not None:
        command += ["--host", args.host]
    return subprocess.run(command).returncode


def vllm_options(args):
    """The `VllmOptions` of the flags; `--model smollm2` is converted (once) to a folder vLLM reads."""
    from .launch import ASYNC_SCHEDULER_CLS, SCHEDULER_CLS, VllmOptions
    model = args.model
    if model == "smollm2":
        from batchtop.engine.model.loading import smollm2_folder
        model = str(smollm2_folder(print))
    scheduler = None if args.stock else ASYNC_SCHEDULER_CLS if args.async_scheduling else SCHEDULER_CLS
    return VllmOptions(model=model, served_model_name=args.served_model_name, port=args.port, host=args.host,
                       scheduler_cls=scheduler,
                       events_port=None if args.stock else args.events_port or args.port + 1,
                       max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                       num_gpu_blocks_override=args.num_gpu_blocks_override, kv_cache_gib=args.kv_cache_gib,
                       enforce_eager=args.enforce_eager,
                       extra_args=tuple(args.vllm_args)
                       + (("--async-scheduling",) if args.async_scheduling else ()))


COMMANDS = {"vllm": add_vllm}
