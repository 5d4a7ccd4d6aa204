"""Is this vLLM environment ready for batchtop's scheduler class? Run it with vLLM's Python:

    python -m batchtop.engine.vllm.check [--events-port 8101] [--host 127.0.0.1] [--data-parallel-size 1]

(`batchtop vllm check` runs it with `.venv-vllm`'s Python, or $BATCHTOP_VLLM_PYTHON.) It says
whether this vLLM is a version batchtop was tested on, which class to pass to `--scheduler-cls`
for vLLM's async-scheduling setting on this machine, and whether the events port (one per
data-parallel rank) is free. Exit status 0: ready; 1: not ready (the lines say why); 2: bad input.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

SYNC_CLS = "batchtop.engine.vllm.scheduler.BatchtopScheduler"
ASYNC_CLS = "batchtop.engine.vllm.scheduler.BatchtopAsyncScheduler"


def port_problem(host: str, port: int) -> str | None:
    """None when `host:port` can be bound now, else why not."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        try:
            sock.bind((host, port))
        except OSError as error:
            return f"{host}:{port} cannot be bound ({error.strerror or error})"
    return None


def scheduler_advice() -> tuple[str, str]:
    """(the class to pass, why), from the platform vLLM detects here: vLLM schedules asynchronously
    by default (a class that subclasses the plain `Scheduler` switches that off), except on its CPU
    build and where no device is found."""
    from vllm.platforms import current_platform

    device = getattr(current_platform, "device_type", "") or "none"
    if current_platform.is_cpu():
        return SYNC_CLS, "vLLM's CPU build schedules synchronously"
    if device in ("", "none") or type(current_platform).__name__ == "UnspecifiedPlatform":
        return (
            SYNC_CLS,
            "vLLM finds no device here (it cannot serve on this machine); where it serves on "
            f"a GPU, vLLM schedules asynchronously by default: pass {ASYNC_CLS} there, or "
            f"{SYNC_CLS} with --no-async-scheduling",
        )
    return (
        ASYNC_CLS,
        f"vLLM schedules asynchronously by default on {device}; with --no-async-scheduling pass {SYNC_CLS}",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m batchtop.engine.vllm.check", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--events-port",
        type=int,
        default=None,
        help="batchtop's side endpoint (default: $BATCHTOP_EVENTS_PORT)",
    )
    parser.add_argument("--host", default=os.environ.get("BATCHTOP_EVENTS_HOST", "127.0.0.1"))
    parser.add_argument("--data-parallel-size", type=int, default=1, help="one port per rank: PORT + rank")
    args = parser.parse_args(argv)
    port = args.events_port
    if port is None and os.environ.get("BATCHTOP_EVENTS_PORT"):
        raw = os.environ["BATCHTOP_EVENTS_PORT"]
        if not raw.isdigit():
            print(f"check: BATCHTOP_EVENTS_PORT must be a port number, got {raw!r}", file=sys.stderr)
            return 2
        port = int(raw)
    if port is not None and not 0 < port < 65536 - args.data_parallel_size or args.data_parallel_size < 1:
        print(
            "check: the events port must be 1..65535 (with room for every data-parallel rank) and "
            "--data-parallel-size at least 1",
            file=sys.stderr,
        )
        return 2
    try:
        import vllm
    except ImportError as error:
        print(f"vLLM: not importable in {sys.executable} ({error}): run this with vLLM's Python")
        return 1
    from .scheduler import TESTED_VLLM, version_problem

    ready = True
    problem = version_problem(vllm.__version__)
    if problem is None:
        print(f"vLLM {vllm.__version__}: supported (tested: {', '.join(TESTED_VLLM)})")
    else:
        ready = False
        print(f"vLLM {vllm.__version__}: not supported. {problem}")
    cls, why = scheduler_advice()
    print(f"--scheduler-cls {cls}  ({why})")
    if port is None:
        ready = False
        print(
            "events port: not set: export BATCHTOP_EVENTS_PORT=PORT (or pass --events-port) before vLLM "
            "starts, else batchtop's class runs as vLLM's own scheduler and nobody can read its events"
        )
    for rank in range(args.data_parallel_size if port is not None else 0):
        taken = port_problem(args.host, port + rank)
        ready &= taken is None
        print(f"events port {port + rank} (rank {rank}): " + ("free" if taken is None else f"taken: {taken}"))
    print("ready" if ready else "not ready")
    return 0 if ready else 1


if __name__ == "__main__":
    sys.exit(main())
