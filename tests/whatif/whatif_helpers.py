"""Seeded tiny-model recordings for the what-if tests: chunked prefill, preemption, aborts, priority."""
from __future__ import annotations

import json
import random

from batchtop.engine.core.config import EngineConfig
from batchtop.engine.core.engine import Engine
from batchtop.engine.core.sampling import SamplingParams
from batchtop.engine.whatif.recording import (
    EngineSetup,
    Recording,
    TraceRequest,
    engine_header,
    recording_from,
)
from batchtop.engine.whatif.replay import run_whatif
from batchtop.engine.whatif.virtual import PhaseTimes, StepShape
from batchtop.telemetry import events as ev
from batchtop.telemetry.recorder import encode_event, make_header

# (step, knob, value): chunked prefill tightened, both preemption modes, a static stretch, the budget.
KNOB_PLAN = [(20, "long_prefill_token_threshold", 8), (35, "preemption_mode", "retract"),
             (50, "max_num_batched_tokens", 24), (60, "batching_mode", "static"),
             (80, "batching_mode", "continuous"), (90, "preemption_mode", "recompute"),
             (95, "max_num_batched_tokens", 64)]


def record_engine(loaded, *, steps: int = 300, seed: int = 0, knob_plan=(), abort_share: float = 0.04,
                  join_at: int = 0, num_prefixes: int = 0, **config) -> Recording:
    """A tiny-model run of `steps` steps under random arrivals (prompts 1-40 tokens, outputs 1-30, some
    ending on a stop id), random aborts of running and waiting requests, and `knob_plan` changes;
    with `join_at`, what a recorder that joined before that step holds (the engine's snapshot first, as
    a dashboard that joins a running engine asks for). With `num_prefixes`, the engine caches prefixes
    and each prompt is one of that many shared prefixes (2-6 blocks) and a tail of its own (0-10 tokens)."""
    settings = dict(model="tiny", num_kv_blocks=40, block_size=4, max_num_seqs=6, max_num_batched_tokens=48,
                    long_prefill_token_threshold=16, batch_capacity=8, max_model_len=128,
                    snapshot_interval_steps=97, flight_recorder_steps=0,
                    enable_prefix_caching=num_prefixes > 0)
    settings.update(config)
    events: list = []
    joined = [not join_at]
    engine = Engine(EngineConfig(**settings), sink=lambda e: joined[0] and events.append(e), loaded=loaded)
    header = make_header("tiny", engine.knobs(),
                         engine=engine_header(engine))
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 5000) for _ in range(settings["block_size"] * rng.randint(2, 6))]
                for _ in range(num_prefixes)]

    def prompt() -> list[int]:
        if not prefixes:
            return [rng.randrange(100, 5000) for _ in range(rng.randint(1, 40))]
        return rng.choice(prefixes) + [rng.randrange(100, 5000) for _ in range(rng.randint(0, 10))]
    plan = {step: (name, value) for step, name, value in knob_plan}
    for step in range(1, steps + 1):
        if step == join_at:
            joined[0] = True
            header = make_header("tiny", engine.knobs(), engine=engine_header(engine))
            events.append(engine.snapshot("subscribe"))
        for _ in range(rng.choice((0, 0, 1, 1, 2))):
            engine.add_request(prompt(), SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=True),
                               priority=rng.randint(0, 2))
        if rng.random() < abort_share:
            live = engine.scheduler.running if rng.random() < 0.5 else list(engine.scheduler.waiting)
            if live:
                engine.abort(rng.choice(live).request_id)
        if step in plan:
            engine.set_knob(*plan[step], source="test")
        engine.step()
    while engine.has_unfinished():
        engine.step()
    return recording_from(header, events)


def synthetic_recording(law, *, num_requests: int = 120, rate: float = 40.0, seed: int = 0, num_kv_blocks=64,
                        abort_share: float = 0.05, gap=None, **knobs) -> Recording:
    """A recording made by the virtual engine itself, each step's phases from `law(shape)` and the gap
    before it from `gap(num_arrived, num_retired)` (default `linear_gap`): a run whose true step-time
    and gap laws are known. Some requests stop early, some are aborted."""
    settings = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "long_prefill_token_threshold": 0,
                "batching_mode": "continuous", "static_batch_size": 4, "dynamic_timeout_s": 0.5,
                "preemption_mode": "recompute"}
    settings.update(knobs)
    setup = EngineSetup(num_kv_blocks, 4, "fcfs", "condense", 32, 256, settings)
    rng = random.Random(seed)
    t, items = 0.0, []
    for i in range(num_requests):
        t += rng.expovariate(rate)
        max_tokens = rng.randint(2, 40)
        roll = rng.random()
        if roll < abort_share:
            items.append(TraceRequest(f"q{i}", t, rng.randint(1, 60), max_tokens, 0, max_tokens, "abort",
                                      rng.uniform(0.0, 0.3)))
        elif roll < 0.3:
            items.append(TraceRequest(f"q{i}", t, rng.randint(1, 60), max_tokens, 0,
                                      rng.randint(1, max_tokens), "stop", None))
        else:
            items.append(TraceRequest(f"q{i}", t, rng.randint(1, 60), max_tokens, 0, max_tokens, "length",
                                      None))
    bare = Recording("<synthetic>", {}, [], 0.0, items, setup)
    _, events = run_whatif(bare, settings, law, gap=linear_gap if gap is None else gap)
    header = make_header("synthetic", settings, engine=setup.to_dict())
    return recording_from(header, events, "<synthetic>")


def linear_law(shape: StepShape) -> PhaseTimes:
    """A known step-time law: 2 ms + 30 us a prefill token + 400 us a decode row + 2 us a context token."""
    forward = 2e-3 + 30e-6 * shape.prefill_tokens + 400e-6 * shape.decode_rows + 2e-6 * shape.context_tokens
    return PhaseTimes(1e-4, 2e-4 + 1e-5 * shape.num_rows, forward, 1e-4, 5e-5)


def linear_gap(num_arrived: int, num_retired: int) -> float:
    """A known gap law between steps: 150 us + 250 us an arrival taken in + 60 us a retirement."""
    return 150e-6 + 250e-6 * num_arrived + 60e-6 * num_retired


def write_recording(path, rec, events=None):
    with open(path, "w") as f:
        f.write(json.dumps(rec.header) + "\n")
        f.writelines(encode_event(e) + "\n" for e in (rec.events if events is None else events))
    return str(path)


def cached_at_admission(events) -> list[tuple[str, int]]:
    """Each admission's request and the tokens the prefix cache gave it, in order."""
    return [(e.request_id, e.num_cached_tokens) for e in events if isinstance(e, ev.RequestAdmitted)]
