"""What-if predictions against real runs on `batchtop serve`: whatif_check's trace and table, with a
launched server (the default model) as the engine and the vLLM check's HTTP client as the load.

    .venv/bin/python -m batchtop.engine.bench.whatif_serve --requests 300 --rate 5 --prompt-mean 16
        --output-mean 48 --repeats 3 --write

(one command, the published run: requests wait at 4 rows and not from 8; the default 16/s overloads
every point).

Each round launches `batchtop serve` at the recorded max_num_seqs, replays the fixed trace with one
streaming client (completions, token-id prompts, ignore_eos, max_tokens the trace's output length, each
request sent at its arrival time) while following the server's event stream from its first step, and
writes those events as a recording (the header's `engine` entry from the server's `/v1/knobs`, as
`batchtop record URL` writes it). batchtop's scheduler on a virtual clock predicts every point from that
recording (what `batchtop whatif REC --set ...` runs); then each point is launched and replayed once with
the same client, in alternating order from round to round (each real run kept as a recording too).
Measured TTFT, ITL and throughput are the client's; preemptions the server's events. A server's startup
(the model's load) is not in its figures. Writes its section of docs/whatif.md.
"""
from __future__ import annotations

import json
import shlex
import sys
import time
from datetime import date
from pathlib import Path

from batchtop.engine.vllm.launch import LaunchedServer
from batchtop.engine.whatif.grid import predict
from batchtop.engine.whatif.replay import fit_steps, replay_identity
from batchtop.telemetry.recorder import make_header

from .figures import commit, cpu_name, publish, span
from .whatif_check import (
    DOC,
    LoadWatch,
    check_parser,
    comparison_table,
    kernels_words,
    label_flag,
    labelled,
    recordings_table,
    round_summary,
    trace_flags,
    trace_of,
    trace_words,
)
from .whatif_vllm import (
    check_args,
    http_path_words,
    launched_check_flags,
    load_words,
    rendered_args,
    repredict,
    repredicted_words,
    run_launched,
    run_rounds,
    server_table,
    trace_requests,
    with_http_path,
)

SECTION = "## Predicted against measured: batchtop serve"
PORT = 8190


def serve_command(args, knobs: dict) -> list[str]:
    """`batchtop serve` at the recorded knobs with `knobs` changed (the words after `batchtop`), without
    prefix caching, as in the published runs (the trace's random prompts share no block)."""
    command = ["serve", "--model", args.model, "--port", str(args.port),
               "--max-num-seqs", str(knobs.get("max_num_seqs", args.recorded)), "--no-enable-prefix-caching"]
    if "max_num_batched_tokens" in knobs:
        command += ["--max-num-batched-tokens", str(knobs["max_num_batched_tokens"])]
    if args.num_kv_blocks:
        command += ["--num-kv-blocks", str(args.num_kv_blocks)]
    return command


def run_serve(args, knobs: dict, trace, requests, log_path: Path, load: LoadWatch) -> dict:
    """One launch of `batchtop serve` replaying the trace (`whatif_vllm.run_launched`)."""
    url = f"http://127.0.0.1:{args.port}"
    command = [sys.executable, "-m", "batchtop.tui.cli", *serve_command(args, knobs)]
    return run_launched(lambda: LaunchedServer(command, url, log_path=log_path), (args.port,), url, trace,
                        requests, load, model=args.model)


def serve_header(state: dict) -> dict:
    """A recording's header from batchtop serve's `/v1/knobs`: its knobs and its engine's set-up."""
    return make_header(state.get("model"), state["knobs"], engine=state["engine_setup"])


def predict_points(rec, points: list[dict]) -> tuple[dict, list[tuple[dict, float]]]:
    """Every point predicted from the recording by batchtop's scheduler on a virtual clock (as `batchtop
    whatif REC --set` runs it), each timed: the round's summary, every point's row and seconds."""
    identity = replay_identity(rec)
    model = fit_steps(rec, identity)
    rows = []
    for changed in points:
        began = time.perf_counter()
        rows.append((predict(rec, model, changed).row(), time.perf_counter() - began))
    return round_summary(rec, identity, model), rows


def make_parser():
    parser = check_parser(__doc__.splitlines()[0], rate=16.0)
    parser.add_argument("--model", default="smollm2", help="the model batchtop serve loads")
    parser.add_argument("--port", type=int, default=PORT, help="the port every launched server listens on")
    parser.add_argument("--num-kv-blocks", type=int, help="the KV pool in blocks of 16 (small: preemptions)")
    return launched_check_flags(parser, "/tmp/batchtop-whatif-serve")


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        args = rendered_args(args, saved, section)
        if args.repredict:
            changed = [point["knobs"] for point in saved["points"]]
            repredict(saved, lambda rec: predict_points(rec, changed), args.json)
        return publish(section(args), report(args, saved), write=args.write, doc=DOC)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = trace_of(args)
    requests = trace_requests(trace, args.seed)
    load = LoadWatch()
    points = [{"max_num_seqs": value} for value in point_values(args)]
    points.append({"max_num_batched_tokens": args.budget})
    saved = {"section": section(args), "started": time.time(), "commit": commit(), "args": check_args(args),
             "kernels": kernels_words(),
             "command": shlex.join(["batchtop", *serve_command(args, {})]), "rounds": [],
             "points": [{"knobs": changed, "predicted": [], "measured": [], "compute_s": []}
                        for changed in points]}

    run_rounds(args, saved, lambda knobs, log: run_serve(args, knobs, trace, requests, log, load),
               serve_header, lambda rec: predict_points(rec, points), load)
    return publish(section(args), report(args, saved), write=args.write, doc=DOC)


def section(args) -> str:
    pool = f", a pool of {args.num_kv_blocks} blocks" if args.num_kv_blocks else ""
    return labelled(SECTION + pool, args)


def point_values(args) -> list[int]:
    """The max_num_seqs values the check runs (`--values`)."""
    return [int(v) for v in args.values.split(",") if v]


def control_words(args) -> str:
    """The recorded value among the points is the check's control: predicted at the shapes the law was
    fitted on, its error is what the machine drifted between a recording and its real runs."""
    if args.recorded not in point_values(args):
        return ""
    return (f" max_num_seqs={args.recorded}, the recorded value run again, is the control: its error is "
            "the law's at the shapes it was fitted on and the machine's drift from the recording to the real "
            "runs.")


def report(args, saved: dict) -> str:
    rounds, results = saved["rounds"], saved["points"]
    pool = f", a pool of {args.num_kv_blocks} blocks of 16 tokens" if args.num_kv_blocks else ""
    command = ("`.venv/bin/python -m batchtop.engine.bench.whatif_serve "
               f"--requests {args.requests} --rate {args.rate:g} --recorded {args.recorded} "
               f"--values {args.values} --budget {args.budget} "
               + (f"--model {args.model} " if args.model != "smollm2" else "")
               + (f"--num-kv-blocks {args.num_kv_blocks} " if args.num_kv_blocks else "")
               + trace_flags(args) + f"--repeats {args.repeats} {label_flag(args)}--write`")
    startup = [r["startup_s"] for r in rounds] + [m["startup_s"] for p in results for m in p["measured"]]
    lines = [section(args), "",
             f"{date.today().isoformat()}, commit {saved['commit']}, {cpu_name()}, {load_words(saved)}, "
             f"{args.model}, {saved['kernels']}. Command: {command} ({saved['seconds'] / 60:.0f} min). Each "
             f"server: `{saved['command']}` (the point's `--max-num-seqs`, or `--max-num-batched-tokens`; "
             f"each healthy {span(startup)} after its launch).", "",
             f"Trace: {trace_words(args)}; prompts random token ids, `ignore_eos`, no prefix caching{pool}; "
             "one streaming completions client sends each request at its arrival time, in this process "
             f"beside the server's. {args.repeats} rounds, each: the server launched at "
             f"max_num_seqs={args.recorded} and the trace recorded from its event stream, every point "
             "predicted from that recording by batchtop's scheduler on a virtual clock (as `batchtop "
             "whatif REC --set max_num_seqs=...` does), then each point launched and run once for real "
             "(the points in alternating order from round to round). Measured TTFT, ITL and throughput "
             "are the client's, preemptions the server's events." + control_words(args), "",
             *repredicted_words(saved), "The recordings:", "",
             *recordings_table(rounds), "", http_path_words(rounds), "",
             *comparison_table(with_http_path(results, rounds)), "", *server_table(results)]
    speed = [s for p in results for s in p["compute_s"]]
    wall = [r["wall_s"] for r in rounds]
    lines += ["", f"What-if compute time per point: {min(speed):.2f}-{max(speed):.2f} s for {args.requests} "
                  f"requests, against {min(wall):.1f}-{max(wall):.1f} s recorded."]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
