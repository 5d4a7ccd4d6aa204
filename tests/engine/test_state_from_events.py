"""The request state folded from events alone equals the engine's own, after every step.

Under both preemption modes, chunked prefill, a static stretch, aborts and all three layouts,
for a consumer that folds from the start and for one that joins mid-run from a snapshot (and
loses events once, then resyncs from the next snapshot).
"""
import random

import pytest

from batchtop.engine.core.config import EngineConfig
from batchtop.engine.core.engine import Engine
from batchtop.engine.core.sampling import SamplingParams
from batchtop.engine.model.loading import load_model
from batchtop.telemetry import events as ev
from batchtop.telemetry.state import BatchState

STEPS_PER_LAYOUT = 700
SHARED_PREFIX = list(range(200, 213))


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def engine_state(engine: Engine) -> dict[str, tuple]:
    """(status, slot, computed, output, blocks) per request, read from the engine's internals."""
    scheduler, slot_of, kv = engine.scheduler, engine.batch.slot_of, engine.kv
    members = ([(r, "running") for r in scheduler.running] + [(r, "padding") for r in scheduler.padding]
               + [(r, r.status.value) for r in scheduler.waiting])
    return {r.request_id: (status, slot_of.get(r.request_id, -1), r.num_computed_tokens, r.num_output_tokens,
                           kv.num_blocks_held(r.request_id)) for r, status in members}


# (step, knob, value): preemption mode both ways, chunked prefill on and off, a static stretch.
KNOB_PLAN = [(60, "long_prefill_token_threshold", 8), (120, "preemption_mode", "retract"),
             (200, "max_num_batched_tokens", 24), (260, "batching_mode", "static"),
             (330, "batching_mode", "continuous"), (380, "long_prefill_token_threshold", 0),
             (450, "preemption_mode", "recompute"), (520, "max_num_batched_tokens", 64),
             (580, "long_prefill_token_threshold", 5)]


@pytest.mark.parametrize("layout", ["condense", "indexmap", "gather"])
def test_folded_state_equals_the_engines_after_every_step(tiny, layout):
    events: list = []
    engine = Engine(EngineConfig(model="tiny", layout=layout, num_kv_blocks=40, block_size=4, max_num_seqs=6,
                                 max_num_batched_tokens=48, static_batch_size=4, snapshot_interval_steps=97,
                                 batch_capacity=8, max_model_len=128),
                    sink=events.append, loaded=tiny)
    rng = random.Random(layout)
    full = BatchState()                  # folds from the first event
    late = None                          # joins at step 150 from a snapshot, loses events at 400
    plan = dict(((s, (k, v)) for s, k, v in KNOB_PLAN))
    counts = {"preempted": 0, "retracted": 0, "recompute_chunks": 0, "aborted_running": 0, "chunked": 0,
              "padding": 0, "cached": 0, "evicted": 0}
    for step in range(1, STEPS_PER_LAYOUT + 1):
        for _ in range(rng.choice((0, 0, 1, 1, 2))):
            prompt = [rng.randrange(100, 5000) for _ in range(rng.randint(1, 40))]
            if rng.random() < 0.4:                 # a shared prefix: cached blocks, hits, evictions
                prompt = SHARED_PREFIX + prompt[:20]
            engine.add_request(prompt, SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=True))
        if rng.random() < 0.04:
            live = engine.scheduler.running if rng.random() < 0.5 else list(engine.scheduler.waiting)
            if live:
                victim = rng.choice(live)
                counts["aborted_running"] += victim.status.value == "running"
                engine.abort(victim.request_id)
        if step in plan:
            engine.set_knob(*plan[step], source="test")
        if step == 150:
            late = BatchState(synced=False)
            engine.emit_snapshot("subscribe")
        if step == 400:
            # marks where the late consumer loses some
            events.insert(len(events) // 2 + len(events) // 4, None)
        engine.step()
        batch, events[:] = [e for e in events if e is not None], []
        full.feed(batch)
        if late is not None:
            if step == 400:
                late.feed([ev.EventsDropped(step=step, t=0.0, count=len(batch) // 2)]
                          + batch[len(batch) // 2:])
                assert not late.synced
            else:
                late.feed(batch)
        for e in batch:
            kind = type(e)
            counts["preempted"] += kind is ev.RequestPreempted
            counts["retracted"] += kind is ev.RequestRetracted
            counts["recompute_chunks"] += kind is ev.PrefillChunk and e.recompute
            counts["chunked"] += kind is ev.PrefillChunk and e.num_computed_tokens < e.num_known_tokens
            counts["padding"] += kind is ev.PaddingReleased
        expected = engine_state(engine)
        assert full.keys() == expected, f"step {step}"
        kv = engine.kv
        if full.pool is not None:        # after the first step
            assert full.pool == (kv.num_used_blocks, kv.num_cached_blocks, kv.num_blocks), f"step {step}"
        assert full.pool_problems() == [] and kv.audit() == []
        counts["cached"] += sum(e.num_cached_tokens for e in batch if type(e) is ev.RequestAdmitted)
        counts["evicted"] += sum(len(e.block_ids) for e in batch if type(e) is ev.BlocksEvicted)
        if late is not None and late.synced:
            assert late.keys() == expected, f"late consumer, step {step}"
    assert late.synced and late.num_snapshots >= 2       # joined from one, resynced from a later one
    assert full.num_snapshots >= STEPS_PER_LAYOUT // 97
    assert all(counts.values()), counts                 # every situation the test is about happened
