"""`batchtop serve`: the OpenAI-compatible server over the embedded engine.

`COMMANDS` maps the command's name to the function that adds its parser; FastAPI, uvicorn
and the engine are imported when the server starts, not when the parser is built.
"""
from __future__ import annotations

import os
import sys

from batchtop.engine.flags import add_engine_flags, engine_config
from batchtop.telemetry.protocol.limits import MAX_BODY_BYTES, MAX_PROMPTS, MAX_WAITING


def add_serve(sub) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible server with telemetry events and live control")
    serve.add_argument("--host", default="127.0.0.1", help="without --api-key only loopback is allowed")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=os.environ.get("BATCHTOP_API_KEY"),
                       help="require `Authorization: Bearer KEY` on every endpoint (env BATCHTOP_API_KEY)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model name clients send (default: --model)")
    serve.add_argument("--event-history", type=int, default=100_000, help="events kept for stream resumption")
    serve.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                       help="larger request bodies get 413 (default 2 MiB)")
    serve.add_argument("--max-waiting", type=int, default=MAX_WAITING,
                       help=f"requests waiting for admission before new ones get 429 (default {MAX_WAITING})")
    serve.add_argument("--max-prompts-per-request", type=int, default=MAX_PROMPTS,
                       help=f"prompts one completion request may carry (default {MAX_PROMPTS})")
    serve.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                       help="a name clients may send as Host besides IP addresses, localhost and --host "
                            "(repeatable; * allows any): other names get 421 (DNS rebinding)")
    serve.add_argument("--allowed-origin", action="append", default=[], metavar="ORIGIN",
                       help="a web origin (https://dash.example) whose pages may control or read the server "
                            "(repeatable); other browser origins get 403")
    serve.add_argument("--access-log", action="store_true")
    add_engine_flags(serve)
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from batchtop.engine.server.app import build_server, serve
    from batchtop.telemetry.protocol.guard import check_bind
    check_bind(args.host, args.api_key)          # before the model load: fail fast
    for flag in ("max_body_bytes", "max_waiting", "max_prompts_per_request"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    server = build_server(engine_config(args), api_key=args.api_key, model_name=args.served_model_name,
                          event_history=args.event_history, max_body_bytes=args.max_body_bytes,
                          host=args.host, allowed_hosts=tuple(args.allowed_host),
                          allowed_origins=tuple(args.allowed_origin), max_waiting=args.max_waiting,
                          max_prompts=args.max_prompts_per_request)
    print(f"batchtop: serving {server.model_name} on http://{args.host}:{args.port}", file=sys.stderr)
    serve(server, args.host, args.port, access_log=args.access_log)
    return 0


COMMANDS = {"serve": add_serve}
