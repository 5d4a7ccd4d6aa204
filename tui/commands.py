"""The dashboard's commands: `batchtop dashboard` (also plain `batchtop`), `batchtop replay` and
`batchtop top`.

`COMMANDS` maps each command's name to the function that adds its parser; Textual, the
engine and httpx are imported when a command runs, not when its parser is built.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from batchtop.engine.flags import add_engine_flags, engine_config
from batchtop.engine.workload.arrivals import DISTRIBUTIONS
from batchtop.engine.workload.scenarios import SCENARIOS

# The dashboard's redraw period over a live engine (like top's delay): drawing is the UI thread's
# main cost and takes CPU and the GIL from the engine (docs/benchmarks.md, Dashboard overhead).
LIVE_REFRESH_S = 0.5


def _refresh_seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 60:
        raise argparse.ArgumentTypeError(f"must be between 0 and 60 seconds, got {text}")
    return value


def add_refresh_flag(parser) -> None:
    parser.add_argument("--refresh", type=_refresh_seconds, default=LIVE_REFRESH_S, metavar="SECONDS",
                        help=f"redraw at most this often while events flow (default {LIVE_REFRESH_S}; "
                             "keys redraw at once)")


# -- the dashboard over the embedded engine ----------------------------------------------------------

def add_dashboard(sub) -> None:
    dash = sub.add_parser("dashboard",
                          help="the live dashboard over the embedded engine and its load generator")
    add_engine_flags(dash)
    load = dash.add_argument_group("load generator")
    load.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second (0: none)")
    load.add_argument("--length-dist", choices=DISTRIBUTIONS, default="exponential",
                      help="prompt and output length distribution")
    load.add_argument("--prompt-mean", type=float, default=64.0)
    load.add_argument("--output-mean", type=float, default=64.0)
    load.add_argument("--seed", type=int, default=0)
    dash.add_argument("--record", metavar="LOG", help="record every event to this JSONL log from the start")
    dash.add_argument("--scenario", choices=list(SCENARIOS),
                      help="set the load and knobs that make one phenomenon of the reference text happen "
                           "(docs/scenarios.md); z cycles them in the dashboard")
    add_refresh_flag(dash)
    dash.set_defaults(func=cmd_dashboard)


def cmd_dashboard(args) -> int:
    from .app import BatchtopApp
    from .sources.engine import EngineSource
    config = engine_config(args)
    message = ""
    if args.scenario:
        scenario = SCENARIOS[args.scenario]
        config = dataclasses.replace(config, **scenario.config)
        message = f"scenario {scenario.name}: {scenario.watch}"

    def build():
        source = EngineSource.create(config, load_rate=args.rate, length_dist=args.length_dist,
                                     prompt_mean=args.prompt_mean, output_mean=args.output_mean,
                                     seed=args.seed)
        if args.scenario:
            source.start_scenario(args.scenario, "cli")
        return source
    BatchtopApp(source_factory=build, loading_what=f"model {args.model}", record_path=args.record,
                refresh_s=args.refresh, message=message).run()
    return 0


# -- the dashboard over a recorded log ---------------------------------------------------------------

def add_replay(sub) -> None:
    replay = sub.add_parser("replay", help="the dashboard over a recorded event log")
    replay.add_argument("log", help="a JSONL event log (batchtop --record, or r in the dashboard)")
    replay.add_argument("--speed", type=float, default=1.0, help="playback speed")
    replay.add_argument("--paused", action="store_true", help="start paused at the beginning")
    replay.add_argument("--engine", metavar="NAME", help="of a fleet recording (batchtop top over several "
                                                         "engines): the engine to show")
    replay.add_argument("--beside", metavar="LOG2", help="a second recording played beside it on one clock "
                                                          "(e.g. a what-if output beside its original): the "
                                                          "plots draw both")
    replay.add_argument("--beside-engine", metavar="NAME", help="of a fleet recording given to --beside: the "
                                                                "engine to draw (default --engine's)")
    replay.set_defaults(func=cmd_replay)


def cmd_replay(args) -> int:
    from .app import BatchtopApp
    from .sources import ReplaySource
    if args.beside_engine and not args.beside:
        raise ValueError("--beside-engine names the engine of the --beside recording: give --beside LOG2")
    try:
        if args.beside is None:
            source = ReplaySource.from_file(args.log, speed=args.speed, paused=args.paused,
                                            engine=args.engine)
        else:
            from .sources.pair import ReplayPair
            source = ReplayPair.from_files(args.log, args.beside, args.engine, args.beside_engine,
                                           speed=args.speed, paused=args.paused)
    except OSError as error:
        print(f"batchtop: error: cannot read {error.filename or args.log}: {error.strerror}", file=sys.stderr)
        return 2
    BatchtopApp(source).run()
    return 0


# -- the dashboard over a running server ---------------------------------------------------------------

def add_top(sub) -> None:
    top = sub.add_parser("top", help="the dashboard over a running server (batchtop serve, batchtop's "
                                     "scheduler in vLLM, or any vLLM / SGLang through /metrics); over "
                                     "several, the fleet table")
    top.add_argument("urls", nargs="*", metavar="URL", help="a server, e.g. http://127.0.0.1:8000")
    top.add_argument("--url", action="append", default=[], dest="more_urls", metavar="URL",
                     help="a server (repeatable: two or more open the fleet table)")
    top.add_argument("--urls-file", metavar="FILE",
                     help="servers, one `URL [NAME] [key=VAR]` a line (VAR: an environment variable holding "
                          "that server's API key), # comments")
    top.add_argument("--base-port", type=int, metavar="P",
                     help="a data-parallel vLLM: rank r serves batchtop's endpoint on P + r (with --ranks)")
    top.add_argument("--ranks", type=int, metavar="N", help="the data-parallel ranks behind --base-port")
    top.add_argument("--host", default="127.0.0.1", help="the host of --base-port (default 127.0.0.1)")
    top.add_argument("--api-key", default=os.environ.get("BATCHTOP_API_KEY"))
    top.add_argument("--period", type=float, default=1.0, metavar="SECONDS",
                     help="over /metrics: scrape every SECONDS (default 1)")
    top.add_argument("--engine", default=None,
                     help="over /metrics: the engine to show first, e.g. engine=1 (e cycles; default the "
                          "first)")
    add_refresh_flag(top)
    top.set_defaults(func=cmd_top)


def cmd_top(args) -> int:
    """One server: its dashboard (batchtop's events where it publishes them, else its /metrics). Several:
    the fleet table."""
    from .fleet.targets import targets
    found = targets(args.urls + args.more_urls, args.urls_file, args.base_port, args.ranks, args.host)
    if args.period <= 0:
        raise ValueError(f"--period must be > 0 s, got {args.period:g}")
    if len(found) > 1:
        from .fleet.commands import run_fleet
        return run_fleet(found, args.api_key, period_s=args.period)
    url, api_key = found[0].url, found[0].key(args.api_key)
    from .sources.scrape import MetricsSource, NotAServer, detect
    try:
        kind = detect(url, api_key)
    except NotAServer as error:
        print(f"batchtop: {error}", file=sys.stderr)
        return 2
    from .app import BatchtopApp
    if kind == "events":
        from .sources.remote import RemoteSource
        BatchtopApp(source_factory=lambda: RemoteSource(url, api_key), loading_what=url,
                    refresh_s=args.refresh).run()
        return 0
    BatchtopApp(MetricsSource(url, kind, api_key, period_s=args.period), engine=args.engine).run()
    return 0


COMMANDS = {"dashboard": add_dashboard, "replay": add_replay, "top": add_top}
