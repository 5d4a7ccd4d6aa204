"""`batchtop whatif`, `batchtop diff` and `batchtop tune`: a recording re-scheduled under other knobs, two
runs aligned request by request, knobs chosen for an SLO. No model is loaded: the scheduler runs on
a virtual clock (engine/whatif/virtual.py)."""
from __future__ import annotations

import json
import os
import sys


def add_whatif(sub) -> None:
    p = sub.add_parser("whatif", help="re-schedule a recording under other knobs, on step times fitted "
                                      "from the recording itself")
    p.add_argument("recording", help="a batchtop event log (batchtop record, the dashboard's recording)")
    p.add_argument("--engine", metavar="NAME", help="of a fleet recording: the engine to re-schedule")
    p.add_argument("--set", action="append", default=[], metavar="KNOB=V1,V2",
                   help="knob values to run (repeat for a grid over several knobs)")
    p.add_argument("--step-time", metavar="F1,F2",
                   help="run every point again with the fitted forward times at these multiples (1.1: a "
                        "machine 10%% slower than the recording's), for how far each figure moves with them")
    p.add_argument("--json", action="store_true", help="one JSON object: fit, identity, a row per run")
    p.add_argument("--record", metavar="OUT", help="write each what-if run as a recording (OUT, or OUT "
                                                   "with the values in its name for several)")
    p.set_defaults(func=cmd_whatif)


def add_diff(sub) -> None:
    p = sub.add_parser("diff", help="two recordings of one trace aligned request by request")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--engine", metavar="NAME", help="of fleet recordings: the engine compared in both")
    p.add_argument("--engine-a", metavar="NAME", help="A's engine, where it differs from --engine")
    p.add_argument("--engine-b", metavar="NAME", help="B's engine, where it differs from --engine")
    p.add_argument("--json", action="store_true", help="the summary and every request's deltas")
    p.add_argument("--top", type=int, default=5, help="requests listed among those that gained and lost most")
    p.set_defaults(func=cmd_diff)


def add_tune(sub) -> None:
    p = sub.add_parser("tune", help="the knobs with the most throughput within an SLO, from what-if runs")
    p.add_argument("recording")
    p.add_argument("--engine", metavar="NAME", help="of a fleet recording: the engine to tune")
    p.add_argument("--slo", action="append", default=[], metavar="METRIC=DURATION",
                   help="ttft_p50|ttft_p99|itl_p50|itl_p99|e2e_p50|e2e_p99 bound, e.g. ttft_p99=2s")
    p.add_argument("--knob", action="append", default=[], metavar="KNOB=LOW..HIGH",
                   help="a knob to tune over a range (or V1,V2,...)")
    p.add_argument("--step-time", metavar="F1,F2",
                   help="the SLO must hold with the fitted forward times at each of these multiples too "
                        "(1.1: a margin for a machine 10%% slower than the recording's)")
    p.add_argument("--apply", metavar="URL", help="set the chosen knobs live on this server (batchtop serve, "
                                                  "or batchtop inside vLLM)")
    p.add_argument("--verify", type=float, default=0.0, metavar="N",
                   help="after --apply, read the server's events for N seconds and report them beside the "
                        "prediction")
    p.add_argument("--api-key", default=os.environ.get("BATCHTOP_API_KEY"))
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_tune)


def cmd_whatif(args) -> int:
    from .grid import format_table, parse_settings, parse_step_scales, whatif, write_runs
    from .recording import read_recording
    scales = parse_step_scales(args.step_time)
    rec = read_recording(args.recording, args.engine)
    grid = parse_settings(args.set, _capacity(rec))
    if rec.setup.vllm is not None:
        from .vllm_replay import whatif_vllm
        result = whatif_vllm(rec, grid, keep_events=bool(args.record), step_scales=scales)
    else:
        result = whatif(rec, grid, scales)
    grid = result.runs[2:]
    paths = write_runs(result, args.record) if args.record and grid else []
    if args.json:
        print(json.dumps({**result.to_dict(), "recorded_to": paths}, default=str))
    else:
        print(format_table(result))
        for path in paths:
            print(f"recorded {path}", file=sys.stderr)
    return 0


def _capacity(rec) -> int:
    """The largest max_num_seqs a what-if of the recording may ask: its engine's batch capacity, or what
    a fresh vLLM scheduler takes."""
    if rec.setup.vllm is not None:
        from .vllm_replay import VLLM_MAX_NUM_SEQS
        return VLLM_MAX_NUM_SEQS
    return rec.setup.batch_capacity


def cmd_diff(args) -> int:
    from .diff import diff_files, format_diff, run_name
    engine_a, engine_b = args.engine_a or args.engine, args.engine_b or args.engine
    result, header_a, header_b = diff_files(args.a, args.b, engine_a, engine_b)
    if args.json:
        print(json.dumps({"summary": result.summary(), "knob_changes": result.knob_changes,
                          "requests": [vars(d) for d in result.deltas]}, default=str))
    else:
        print(format_diff(result, (header_a, header_b),
                          (run_name(args.a, engine_a), run_name(args.b, engine_b)), args.top))
    return 0


def cmd_tune(args) -> int:
    from .grid import format_rows, parse_step_scales
    from .recording import read_recording
    from .tune import apply_knobs, live_events, parse_knob_range, parse_slo, tune
    if not args.slo:
        raise ValueError("give at least one --slo, e.g. --slo ttft_p99=2s")
    if args.verify and not args.apply:
        raise ValueError("--verify needs --apply URL")
    rec = read_recording(args.recording, args.engine)
    slo = parse_slo(args.slo)
    scales = parse_step_scales(args.step_time)
    grid = parse_knob_range(args.knob, _capacity(rec))
    result = tune(rec, grid, slo, scales)
    best = result.best
    report = {"slo_s": slo, "step_scales": scales, "heldout_mape": result.heldout_mape,
              "in_flight_at_start": rec.num_in_flight,
              "best": best.row() if best else None, "runs": [run.row() for run in result.runs]}
    lines = [f"tuned {', '.join(grid)} over {len(result.runs)} what-if runs of {rec.path} "
             f"(step-time fit: held-out MAPE {result.heldout_mape:.1%}); SLO "
             + ", ".join(f"{k} <= {v:g}s" for k, v in slo.items())
             + (" at step times " + ", ".join(f"{f:g}x" for f in scales) if scales != (1.0,) else "")]
    lines += rec.replay_words()
    lines.append("no value meets the SLO" if best is None else
                 "best: " + ", ".join(f"{k}={v}" for k, v in best.knobs.items())
                 + f" ({best.summary.throughput_out_tok_s:.1f} output tok/s predicted)")
    if best is not None and best.extrapolation:
        lines.append(best.extrapolation)
    if args.apply:
        if best is None:
            raise ValueError("no value meets the SLO: nothing to apply")
        apply_knobs(args.apply, best.knobs, args.api_key)
        lines.append(f"applied to {args.apply}")
        if args.verify:
            from .grid import run_of
            measured = run_of(f"measured live, {args.verify:g} s", best.knobs,
                              live_events(args.apply, args.verify, args.api_key))
            report["measured"] = measured.row()
            lines += ["", format_rows([best, measured])]
    if args.json:
        print(json.dumps(report, default=str))
    else:
        print("\n".join(lines))
    return 0


COMMANDS = {"whatif": add_whatif, "diff": add_diff, "tune": add_tune}
