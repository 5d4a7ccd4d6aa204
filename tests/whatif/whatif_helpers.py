"""Seeded tiny-model recordings for the what-if tests: chunked prefill, preemption, aborts, priority."""
from __future__ import annotations

import random

from batchtop.engine.core.config import EngineConfig
from batchtop.engine.core.engine import Engine
from batchtop.engine.core.sampling import SamplingParams
from batchtop.engine.whatif.recording import Recording, engine_header, recording_from
from batchtop.telemetry.recorder import make_header


def record_engine(loaded, *, steps: int = 300, seed: int = 0, knob_plan=(), abort_share: float = 0.04,
                  **config) -> Recording:
    """A tiny-model run of `steps` steps under random arrivals (prompts 1-40 tokens, outputs 1-30, some
    ending on a stop id), random aborts of running and waiting requests, and `knob_plan` changes."""
    settings = dict(model="tiny", num_kv_blocks=40, block_size=4, max_num_seqs=6, max_num_batched_tokens=48,
                    long_prefill_token_threshold=16, batch_capacity=8, max_model_len=128,
                    snapshot_interval_steps=97, flight_recorder_steps=0)
    settings.update(config)
    events: list = []
    engine = Engine(EngineConfig(**settings), sink=events.append, loaded=loaded)
    header = make_header("tiny", engine.knobs(),
                         engine=engine_header(engine.config, engine.kv.num_blocks, engine.max_model_len))
    rng = random.Random(seed)
    plan = {step: (name, value) for step, name, value in knob_plan}
    for step in range(1, steps + 1):
        for _ in range(rng.choice((0, 0, 1, 1, 2))):
            prompt = [rng.randrange(100, 5000) for _ in range(rng.randint(1, 40))]
            engine.add_request(prompt, SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=True),
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
