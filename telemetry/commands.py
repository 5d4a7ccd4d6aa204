"""`batchtop export`: a recorded event log as a Chrome/Perfetto trace, a CSV or a text summary.

Uses only telemetry, like the rest of this package. `COMMANDS` maps the command's name to
the function that adds its parser.
"""
from __future__ import annotations

import json
import sys

FORMATS = ["chrome", "csv", "summary"]


def add_export(sub) -> None:
    export = sub.add_parser("export",
                            help="turn a recorded log into a Chrome/Perfetto trace, a CSV or a summary")
    export.add_argument("log")
    export.add_argument("--format", choices=FORMATS, default="summary")
    export.add_argument("--out", help="file to write (default: stdout)")
    export.add_argument("--engine", metavar="NAME",
                        help="of a fleet recording: this engine alone (default: every engine, each named)")
    export.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
    from .export import summary_text, to_chrome_trace, to_csv
    from .fleet_log import engine_names
    from .recorder import read_header, read_log
    if engine_names(read_header(args.log)) is not None and args.engine is None:
        text = _export_fleet(args.log, args.format)
    else:
        header, events = read_log(args.log, args.engine)
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


def _export_fleet(path: str, format: str) -> str:
    from .fleet_export import fleet_chrome_trace, fleet_csv, fleet_summary
    from .fleet_log import read_fleet_log
    header, engines = read_fleet_log(path)
    if format == "chrome":
        return json.dumps(fleet_chrome_trace(header, engines))
    return fleet_csv(engines) if format == "csv" else fleet_summary(engines)


COMMANDS = {"export": add_export}
