"""`batchtop serve`: the OpenAI-compatible server over the embedded engine.

`COMMANDS` maps the command's name to the function that adds its parser; FastAPI, uvicorn
and the engine are imported when the server starts, not when the parser is built.
"""
from __future__ import annotations

import os
import sys

from batchtop.engine.flags import add_engine_flags, engine_config


def add_serve(sub) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible server with telemetry events and live control")
    serve.add_argument("--host", default="127.0.0.1", help="without --api-key only loopback is allowed")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=os.environ.get("BATCHTOP_API_KEY"),
                       help="require `Authorization: Bearer KEY` on every endpoint (env BATCHTOP_API_KEY)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model name clients send (default: --model)")
    serve.add_argument("--event-history", type=int, default=100_000, help="events kept for stream resumption")
    serve.add_argument("--max-body-bytes", type=int, default=2 * 2**20,
                       help="larger request bodies get 413 (default 2 MiB)")
    serve.add_argument("--access-log", action="store_true")
    add_engine_flags(serve)
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from batchtop.engine.server.app import build_server, serve
    from batchtop.telemetry.stream import check_bind
    check_bind(args.host, args.api_key)          # before the model load: fail fast
    server = build_server(engine_config(args), api_key=args.api_key, model_name=args.served_model_name,
                          event_history=args.event_history, max_body_bytes=args.max_body_bytes)
    print(f"batchtop: serving {server.model_name} on http://{args.host}:{args.port}", file=sys.stderr)
    serve(server, args.host, args.port, access_log=args.access_log)
    return 0


COMMANDS = {"serve": add_serve}
