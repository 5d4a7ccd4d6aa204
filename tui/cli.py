"""The one entry point: `batchtop [COMMAND] ...`; without a command (or with flags first), the dashboard.

Each command lives in the package it drives; `COMMANDS` says which module adds each one's
parser (its `COMMANDS[name]`), in the order `batchtop --help` lists them. Building the parser
imports those modules, so they keep their heavy imports inside the functions that run a command.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import threading

COMMANDS = {
    "generate": "batchtop.engine.commands",
    "demo": "batchtop.engine.commands",
    "serve": "batchtop.engine.server.commands",
    "bench": "batchtop.engine.bench.commands",
    "sweep": "batchtop.engine.bench.commands",
    "top": "batchtop.tui.commands",
    "vllm": "batchtop.engine.vllm.commands",
    "dashboard": "batchtop.tui.commands",
    "replay": "batchtop.tui.commands",
    "record": "batchtop.engine.commands",
    "export": "batchtop.telemetry.commands",
    "whatif": "batchtop.engine.whatif.commands",
    "diff": "batchtop.engine.whatif.commands",
    "tune": "batchtop.engine.whatif.commands",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchtop",
                                     description="top for the batch of an LLM inference engine")
    sub = parser.add_subparsers(dest="command")
    for name, module in COMMANDS.items():
        importlib.import_module(module).COMMANDS[name](sub)
    return parser


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
