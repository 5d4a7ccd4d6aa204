"""A long, hostile run of the engine with its invariants checked after every step.

    python -m batchtop.engine.reliability.soak [--requests 10000] [--seed 0] [--kv-blocks 32] [--no-write]

On the tiny model: random arrivals and lengths; random aborts of waiting, mid-prefill and
mid-decode requests (and of finished ones, which must change nothing); a knob storm (every knob,
valid random values, and invalid ones that must be refused and change nothing); batching-mode and
preemption-mode switches; a KV pool small enough that preemption and retraction happen all the
time. After every step `check_invariants` must find nothing; after the drain the pool is whole
and every request retired exactly once. What is checked: invariants.INVARIANTS. Exit status 1 on any
violation. The figures go into docs/reliability.md's section (unless --no-write).
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass

from batchtop.engine.bench.figures import RELIABILITY, commit, publish
from batchtop.engine.core.config import EngineConfig
from batchtop.engine.core.engine import Engine
from batchtop.engine.core.knobs import KNOBS
from batchtop.engine.core.sampling import SamplingParams
from batchtop.telemetry import events as ev
from batchtop.telemetry.bus import EventLog

from .invariants import Violation, check_invariants
from .soak_report import SECTION, SoakReport, section

BATCH_CAPACITY = 32
VALID_VALUES = {
    "max_num_seqs": (1, 2, 3, 4, 8, 16, 32),
    "max_num_batched_tokens": (8, 16, 32, 64, 128, 256, 512),
    "long_prefill_token_threshold": (0, 0, 4, 16, 64),
    "static_batch_size": (1, 2, 4, 8),
    "dynamic_timeout_s": (0.0, 0.001, 0.005),
    "batching_mode": ("continuous", "continuous", "static", "dynamic"),
    "preemption_mode": ("recompute", "retract"),
}


def _beyond_each_knob(capacity: int) -> tuple:
    """For every knob of the table: just below and just above its range, or a choice it lacks."""
    return tuple(pair for k in KNOBS.values() for pair in (
        ((k.name, "turbo"),) if k.choices else ((k.name, k.low - 1), (k.name, k.upper(capacity) + 1))))


INVALID_VALUES = _beyond_each_knob(BATCH_CAPACITY) + (
    ("max_num_seqs", "many"), ("max_num_seqs", 2.5), ("max_num_seqs", True), ("max_num_seqs", None),
    ("dynamic_timeout_s", -0.1), ("dynamic_timeout_s", "soon"), ("dynamic_timeout_s", math.nan),
    ("dynamic_timeout_s", math.inf), ("no_such_knob", 1),
)


@dataclass(frozen=True)
class SoakConfig:
    num_requests: int = 10_000
    seed: int = 0
    num_kv_blocks: int = 32           # 512 tokens: a few requests fill it
    block_size: int = 16
    max_model_len: int = 512
    max_prompt_tokens: int = 160
    max_output_tokens: int = 96
    shared_prefix_share: float = 0.5  # arrivals whose prompt starts with one of two common prefixes
    shared_prefix_tokens: int = 40    # 2.5 blocks: two full blocks shared by reference, then a partial one
    arrivals_per_step: float = 0.15   # mean of a Poisson draw each round
    max_waiting: int = 16             # no arrivals while this many wait: clients with a concurrency cap
    abort_probability: float = 0.015  # per round: abort one unfinished request
    knob_every_steps: int = 4         # a storm round: one valid change and one invalid attempt
    num_threads: int = 1              # the tiny model gains nothing from more; a loaded machine loses a lot
    stall_rounds: int = 5_000         # rounds without a token, a first admission or a retirement: livelock
    stop_at_violation: bool = False   # stop after the first step that broke an invariant


class Soak:
    """One soak run over one engine; `run()` returns the report. A round is the storm's moves (arrivals,
    an abort, knobs) and then `step()`, the engine's step with its checks."""

    def __init__(self, config: SoakConfig, progress=None):
        self.config = config
        self.rng = random.Random(config.seed)
        self.log = EventLog(maxlen=None)
        self.engine = Engine(EngineConfig(
            model="tiny", num_kv_blocks=config.num_kv_blocks, block_size=config.block_size,
            max_model_len=config.max_model_len, max_num_seqs=16, max_num_batched_tokens=128,
            batch_capacity=BATCH_CAPACITY, dynamic_timeout_s=0.001,
            num_threads=config.num_threads), sink=self.log)
        self.report = SoakReport()
        self.progress = progress
        prefix_rng = random.Random(config.seed + 1)  # blocks shared by reference, a prompt's head
        self._prefixes = [[prefix_rng.randint(0, self.engine.vocab_size - 1)
                           for _ in range(config.shared_prefix_tokens)] for _ in range(2)]
        self._arrived: dict[str, int] = {}      # request id -> step of arrival
        self._admitted: set[str] = set()
        self._retired: Counter = Counter()
        self._admitted_this_step = False
        self._rounds_since_progress = 0
        self._storm_step = -1                   # the step of the last storm round: one per step it falls on

    def run(self) -> SoakReport:
        started = time.perf_counter()
        engine, report = self.engine, self.report
        drain_from = None
        while report.requests < self.config.num_requests or engine.has_unfinished():
            if report.requests < self.config.num_requests:
                self._arrivals()
            elif drain_from is None:
                drain_from = engine.step_count
            if self.rng.random() < self.config.abort_probability:
                self._abort_one()
            step = engine.step_count
            if step % self.config.knob_every_steps == 0 and step != self._storm_step:
                self._storm_step = step
                self._storm()
            step_before = engine.step_count
            if not self.step():
                break
            if self.progress and engine.step_count % 2000 == 0 and engine.step_count != step_before:
                self.progress(f"step {engine.step_count}: {report.requests} requests, "
                              f"{sum(report.finished.values())} retired")
        report.steps = engine.step_count
        report.drain_steps = engine.step_count - (drain_from if drain_from is not None else engine.step_count)
        if not report.stopped:
            self._final_checks()
        report.elapsed_s = time.perf_counter() - started
        return report

    def step(self) -> bool:
        """One engine step and every check on it; False when the run must stop (a step raised, a livelock,
        or the first violation where the config asks)."""
        engine, report = self.engine, self.report
        step_before = engine.step_count
        self._rounds_since_progress += 1
        try:
            outputs = engine.step()
        except Exception as error:                 # its StepFailed is in the log: _after_step reports it
            outputs = []
            report.stopped = f"step {engine.step_count} raised {type(error).__name__}"
        for output in outputs:
            if output.finished:
                engine.release(output.request_id)
        if engine.step_count == step_before:
            time.sleep(0.0005)                      # a dynamic batch fills on the wall clock
        self._after_step()
        if self._rounds_since_progress > self.config.stall_rounds:
            self._violation("livelock", f"no token, first admission or retirement in "
                                        f"{self.config.stall_rounds} rounds")
            report.stopped = report.stopped or "livelock"
        if self.config.stop_at_violation and report.violations:
            report.stopped = report.stopped or "a violation"
        return not report.stopped

    def _violation(self, invariant: str, detail: str) -> None:
        self.report.violations.append(Violation(invariant, f"step {self.engine.step_count}: {detail}"))

    # -- what the storm does --------------------------------------------------------------------

    def _arrivals(self) -> None:
        cfg, rng = self.config, self.rng
        for _ in range(_poisson(rng, cfg.arrivals_per_step)):
            num_waiting = len(self.engine.scheduler.waiting)
            if self.report.requests >= cfg.num_requests or num_waiting >= cfg.max_waiting:
                return
            prompt_len = rng.randint(1, cfg.max_prompt_tokens)
            sampling = SamplingParams(max_tokens=rng.randint(1, cfg.max_output_tokens),
                                      ignore_eos=rng.random() < 0.8, temperature=rng.choice((0.0, 0.0, 1.0)),
                                      seed=rng.randint(0, 99))
            prompt = [rng.randint(0, self.engine.vocab_size - 1) for _ in range(prompt_len)]
            if rng.random() < cfg.shared_prefix_share:
                prompt = (rng.choice(self._prefixes) + prompt)[: cfg.max_prompt_tokens]
            request_id = self.engine.add_request(prompt, sampling, priority=rng.randint(0, 3))
            self._arrived[request_id] = self.engine.step_count
            self.report.requests += 1

    def _abort_one(self) -> None:
        engine, rng = self.engine, self.rng
        running = engine.scheduler.running
        groups = {
            "waiting": list(engine.scheduler.waiting),
            "prefill": [r for r in running if r.num_output_tokens == 0],
            "decode": [r for r in running if r.num_output_tokens > 0],
        }
        kinds = [kind for kind, group in groups.items() if group]
        if not kinds:
            return
        kind = rng.choice(kinds)
        request = rng.choice(groups[kind])
        if not engine.abort(request.request_id):
            self._violation("abort", f"abort of {kind} {request.request_id} was refused")
            return
        self.report.aborts[kind] += 1
        if engine.kv.num_blocks_held(request.request_id):
            self._violation("abort", f"aborted {request.request_id} still holds blocks")
        free_before = engine.kv.num_free_blocks
        if engine.abort(request.request_id):          # twice: a double free would show here
            self._violation("double abort", f"second abort of {request.request_id} was accepted")
        else:
            self.report.aborts["finished"] += 1
        if engine.kv.num_free_blocks != free_before:
            self._violation("double abort", f"second abort of {request.request_id} changed the pool")
        engine.release(request.request_id)

    def _storm(self) -> None:
        engine, rng = self.engine, self.rng
        name = rng.choice(sorted(VALID_VALUES))
        value = rng.choice(VALID_VALUES[name])
        old = engine.knobs()[name]
        engine.set_knob(name, value, source="test")
        if value != old:
            self.report.knob_changes += 1
            self.report.mode_switches += name in ("batching_mode", "preemption_mode")
        name, value = rng.choice(INVALID_VALUES)
        before = engine.knobs()
        try:
            engine.set_knob(name, value, source="test")
        except ValueError:
            self.report.knobs_refused += 1
        else:
            self._violation("knob validation", f"invalid knob {name}={value!r} was accepted")
        if engine.knobs() != before:
            self._violation("knob validation", f"refused knob {name}={value!r} changed the knobs")

    # -- checks ------------------------------------------------------------------------------------

    def _after_step(self) -> None:
        engine, report = self.engine, self.report
        report.violations += [Violation(v.invariant, f"step {engine.step_count}: {v.detail}")
                              for v in check_invariants(engine)]
        for event in self.log.drain():
            kind = type(event)
            if kind is ev.StepPlanned:
                self._check_plan(event)
            elif kind is ev.RequestAdmitted:
                self._admitted_this_step = True
                if not event.resumed and event.request_id not in self._admitted:
                    self._progress()
                    self._admitted.add(event.request_id)
                    wait = event.step - self._arrived.get(event.request_id, event.step)
                    report.longest_wait_steps = max(report.longest_wait_steps, wait)
                    request = engine.requests.get(event.request_id)
                    if request is not None and request.admit_time is not None:
                        report.longest_wait_s = max(report.longest_wait_s,
                                                    request.admit_time - request.arrival_time)
            elif kind is ev.RequestRetired:
                if event.reason != "abort":     # a client's abort is no progress of the engine's
                    self._progress()
                self._retired[event.request_id] += 1
                report.finished[event.reason] += 1
                arrived = self._arrived.get(event.request_id)
                if arrived is not None:
                    report.longest_life_steps = max(report.longest_life_steps, event.step - arrived)
            elif kind is ev.StepFinished:
                if event.sampled_request_ids:
                    self._progress()
            elif kind is ev.RequestPreempted:
                report.preemptions += 1
            elif kind is ev.RequestRetracted:
                report.retractions += 1
            elif kind is ev.StepFailed:
                report.violations.append(Violation("step raised", f"step {event.step}: {event.error}"))

    def _check_plan(self, event: ev.StepPlanned) -> None:
        """The plan as the step ran it: its tokens within the budget, and, when it admitted, the running
        count right after admission (before this step's retirements) within the cap. The knobs in force
        are the scheduler's: the storm changes them only between steps."""
        scheduled = event.prefill_tokens + event.recompute_tokens + event.decode_tokens
        if scheduled > event.token_budget:
            self.report.violations.append(Violation("budget", f"step {event.step}: {scheduled} tokens "
                                                    f"scheduled over the budget {event.token_budget}"))
        admitted, self._admitted_this_step = self._admitted_this_step, False
        knobs = self.engine.scheduler.knobs
        cap = knobs.max_num_seqs if knobs.batching_mode == "continuous" else min(
            knobs.static_batch_size, knobs.max_num_seqs)
        if admitted and event.num_running > cap:
            self.report.violations.append(Violation("admission cap", f"step {event.step}: admitted to "
                                                    f"{event.num_running} running, cap {cap}"))

    def _progress(self) -> None:
        self._rounds_since_progress = 0

    def _final_checks(self) -> None:
        engine = self.engine
        if engine.kv.num_free_blocks != engine.kv.num_blocks:
            self._violation("pool whole", f"after the drain {engine.kv.num_used_blocks} blocks are still "
                                          "used")
        if engine.requests:
            self._violation("requests kept", f"after the drain the engine still keeps {len(engine.requests)} "
                                             f"requests: {sorted(engine.requests)[:5]}")
        twice = [rid for rid, n in self._retired.items() if n != 1]
        if twice:
            self._violation("retired twice", f"{twice[:5]}")
        never = set(self._arrived) - set(self._retired)
        if never:
            self._violation("starved", f"never retired: {sorted(never)[:5]}")


def _poisson(rng: random.Random, mean: float) -> int:
    """Knuth's draw; fine for the small means used here."""
    limit, k, p = math.exp(-mean), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def run_soak(config: SoakConfig = SoakConfig(), progress=None) -> SoakReport:
    return Soak(config, progress).run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchtop.engine.reliability.soak",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=SoakConfig.num_requests)
    parser.add_argument("--seed", type=int, default=SoakConfig.seed)
    parser.add_argument("--kv-blocks", type=int, default=SoakConfig.num_kv_blocks)
    parser.add_argument("--no-write", action="store_true", help="print; leave docs/reliability.md")
    args = parser.parse_args(argv)
    at = commit()                               # the code the figures come from: HEAD as the run starts
    config = SoakConfig(num_requests=args.requests, seed=args.seed, num_kv_blocks=args.kv_blocks)
    report = run_soak(config, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(report.text(), file=sys.stderr)
    publish(SECTION, section(report, config, at), write=not args.no_write, doc=RELIABILITY)
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
