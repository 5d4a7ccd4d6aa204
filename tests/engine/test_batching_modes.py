"""Batching modes, batch layouts, preemption modes and knobs, read from the engine's own events."""
import random

import pytest

from batchtop.engine.core.batch import PersistentBatch
from batchtop.engine.core.config import EngineConfig
from batchtop.engine.core.engine import Engine
from batchtop.engine.core.sampling import SamplingParams
from batchtop.engine.model.loading import load_model
from batchtop.telemetry import events as ev
from batchtop.telemetry.recorder import Recorder, read_log
from batchtop.telemetry.run_stats import summarize


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def make_engine(tiny, events, **config):
    return Engine(EngineConfig(model="tiny", **config), sink=events.append, loaded=tiny)


def run(engine, lengths, prompt_len=4):
    ids = [engine.add_request([100 + i] * prompt_len, SamplingParams(max_tokens=n, ignore_eos=True))
           for i, n in enumerate(lengths)]
    while engine.has_unfinished():
        engine.step()
    return ids


def of(events, kind):
    return [e for e in events if isinstance(e, kind)]


def test_reference_static_batch_counts_padding_as_row_steps(tiny, tmp_path):
    lengths = [1024, 200, 180, 150, 140, 120, 84, 70]
    log = tmp_path / "static.jsonl"
    events = []
    with Recorder(log, model="tiny") as recorder:
        engine = Engine(EngineConfig(model="tiny", batching_mode="static", static_batch_size=8,
                                     max_num_seqs=8),
                        sink=lambda e: (events.append(e), recorder.sink(e)), loaded=tiny)
        run(engine, lengths)
    _, replayed = read_log(log)
    assert replayed == events
    summary = summarize(replayed)
    assert summary.row_steps_total == 8192
    assert summary.row_steps_useful == 1968
    assert round(summary.batch_utilisation, 3) == 0.240
    assert summary.num_steps == 1024
    # the whole batch was admitted at once, into slots 0..7, and left together
    assert sorted(e.slot for e in of(events, ev.RequestAdmitted)) == list(range(8))
    assert max(e.num_padding_rows for e in of(events, ev.StepPlanned)) == 7


@pytest.mark.parametrize("batch_size, num_batches", [(8, 40), (32, 16)])
def test_static_utilisation_is_near_one_over_harmonic_number(tiny, batch_size, num_batches):
    rng = random.Random(batch_size)
    lengths = [max(1, round(rng.expovariate(1 / 32))) for _ in range(batch_size * num_batches)]
    events = []
    engine = make_engine(tiny, events, batching_mode="static", static_batch_size=batch_size,
                         max_num_seqs=batch_size, max_num_batched_tokens=4096)
    run(engine, lengths, prompt_len=2)
    measured = summarize(events).batch_utilisation
    harmonic = sum(1 / k for k in range(1, batch_size + 1))
    # exact count of what the engine computed: sum of lengths over B x longest, batch by batch
    batches = [lengths[i:i + batch_size] for i in range(0, len(lengths), batch_size)]
    assert measured == pytest.approx(sum(lengths) / sum(batch_size * max(b) for b in batches), abs=1e-9)
    assert measured == pytest.approx(1 / harmonic, rel=0.12)


def test_continuous_batching_wastes_no_row_steps(tiny):
    events = []
    engine = make_engine(tiny, events, max_num_seqs=8)
    run(engine, [1024, 200, 180, 150, 140, 120, 84, 70])
    summary = summarize(events)
    assert summary.row_steps_useful == 1968 and summary.row_steps_total == 1968


def test_dynamic_batch_forms_when_full_or_after_timeout(tiny):
    events = []
    engine = make_engine(tiny, events, batching_mode="dynamic", static_batch_size=4, max_num_seqs=4,
                         dynamic_timeout_s=60)
    for i in range(3):
        engine.add_request([5 + i], SamplingParams(max_tokens=3, ignore_eos=True))
    assert engine.step() == [] and engine.step_count == 0, "3 of 4 waiting: the batch keeps filling"
    engine.add_request([9], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    assert len(of(events, ev.RequestAdmitted)) == 4
    engine.set_knob("dynamic_timeout_s", 0)
    while engine.has_unfinished():
        engine.step()
    engine.add_request([9], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    assert len(of(events, ev.RequestAdmitted)) == 5, "timeout expired: a partial batch forms"


def test_batching_mode_switch_waits_for_the_static_batch_to_end(tiny):
    events = []
    engine = make_engine(tiny, events, batching_mode="static", static_batch_size=2, max_num_seqs=4)
    engine.add_request([5], SamplingParams(max_tokens=6, ignore_eos=True))
    engine.add_request([6], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    engine.set_knob("batching_mode", "continuous", source="test")
    assert not of(events, ev.KnobChanged), "not at a batch boundary yet"
    engine.add_request([7], SamplingParams(max_tokens=2, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert len(of(events, ev.RequestAdmitted)) == 2, "static: the new request waits for the batch to end"
    while engine.has_unfinished():
        engine.step()
    change = of(events, ev.KnobChanged)[0]
    assert (change.name, change.old, change.new, change.source) == ("batching_mode", "static",
                                                                    "continuous", "test")


def test_condense_steady_state_refill_moves_nothing_and_removal_moves_live_prefix(tiny):
    events = []
    engine = make_engine(tiny, events, max_num_seqs=8, layout="condense")
    lengths = [2, 30, 30, 8, 30, 30, 30, 30]
    ids = [engine.add_request([50 + i] * 5, SamplingParams(max_tokens=n, ignore_eos=True))
           for i, n in enumerate(lengths)]
    engine.step()
    assert [engine.batch.slot_of[i] for i in ids] == list(range(8))
    engine.step()                          # R0 samples its 2nd and last token
    assert engine.requests[ids[0]].finished
    r8 = engine.add_request([99] * 5, SamplingParams(max_tokens=30, ignore_eos=True))
    mark = len(events)
    engine.step()
    admitted = of(events[mark:], ev.RequestAdmitted)
    assert [(a.request_id, a.slot) for a in admitted] == [(r8, 0)]
    assert not of(events[mark:], ev.RowMoved)
    rebuilt = of(events[mark:], ev.BatchRebuilt)[0]
    assert (rebuilt.rows_removed, rebuilt.rows_added, rebuilt.rows_moved, rebuilt.num_bytes) == (1, 1, 0, 0)
    while not engine.requests[ids[3]].finished:   # R3 (slot 3) finishes with nobody waiting
        engine.step()
    highest = engine.batch.request_ids[7]
    request = engine.requests[highest]
    mark = len(events)
    engine.step()
    moved = of(events[mark:], ev.RowMoved)
    assert [(m.request_id, m.from_slot, m.to_slot) for m in moved] == [(highest, 7, 3)]
    # only the live prefix moved: known tokens before this step's token, and the block ids
    tokens_before = request.num_tokens - 1
    blocks = engine.kv.blocks_needed(tokens_before)
    assert moved[0].num_bytes == 4 * tokens_before + 4 * blocks
    assert moved[0].num_bytes < engine.batch.token_ids.shape[1] * 4


def alternate(layout, steps=40):
    """Two disjoint sets (8 rows and 3 rows) take turns in the batch, as under some priority or
    multi-LoRA schedules, while long-lived requests keep arriving (one joins, the oldest leaves,
    every step) and so sit above the alternating rows."""
    batch = PersistentBatch(layout, capacity=64, max_model_len=256, max_blocks_per_seq=16)
    sets = [[(f"a{i}", [1] * (20 + i)) for i in range(8)], [(f"b{i}", [2] * (30 + i)) for i in range(3)]]
    batch.update([], [(f"k{i}", [3] * 40) for i in range(4)])
    members, updates = [], []
    for step in range(steps):
        turn = sets[step % 2]
        arriving = (f"k{step + 4}", [3] * 40)
        updates.append(batch.update(members + [f"k{step}"], turn + [arriving]))
        members = [rid for rid, _ in turn]
    return updates


def test_alternating_sets_move_rows_under_condense_but_not_under_indexmap():
    condense, indexmap, gather = alternate("condense"), alternate("indexmap"), alternate("gather")
    steps_with_moves = sum(1 for u in condense if u.moves)
    rows_moved = sum(len(u.moves) for u in condense)
    assert steps_with_moves >= 0.5 * len(condense) and rows_moved >= steps_with_moves
    assert sum(len(u.moves) for u in indexmap) == 0 and sum(u.num_bytes for u in indexmap) == 0
    assert all(u.num_bytes > 0 for u in gather), "gather re-copies every kept row when membership changes"


@pytest.mark.parametrize("mode", ["recompute", "retract"])
def test_kv_exhaustion_preempts_completes_and_keeps_greedy_outputs(tiny, mode):
    rng = random.Random(3)
    prompts = [[rng.randrange(10, 40000) for _ in range(rng.randint(5, 20))] for _ in range(16)]
    lengths = [rng.randint(40, 80) for _ in prompts]
    params = [SamplingParams(max_tokens=n) for n in lengths]
    relaxed = Engine(EngineConfig(model="tiny", max_num_seqs=8), loaded=tiny).generate(prompts, params)
    events = []
    pressed = make_engine(tiny, events, max_num_seqs=8, num_kv_blocks=10, preemption_mode=mode)
    completions = pressed.generate(prompts, params)
    assert [c.token_ids for c in completions] == [c.token_ids for c in relaxed]
    kind = ev.RequestPreempted if mode == "recompute" else ev.RequestRetracted
    other = ev.RequestRetracted if mode == "recompute" else ev.RequestPreempted
    assert of(events, kind) and not of(events, other)
    assert len(of(events, ev.RequestRetired)) == len(prompts)
    assert pressed.kv.num_free_blocks == pressed.kv.num_blocks
    if mode == "retract":
        ratios = [e.new_token_ratio for e in of(events, ev.RequestRetracted)]
        assert all(0 < r <= 1 for r in ratios)
        assert pressed.scheduler.new_token_ratio < max(ratios), "the ratio decays back after retractions"


def test_knob_change_applies_next_step_and_invalid_value_changes_nothing(tiny):
    events = []
    engine = make_engine(tiny, events, max_num_seqs=2)
    for i in range(6):
        engine.add_request([5 + i] * 3, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    assert len(engine.scheduler.running) == 2
    with pytest.raises(ValueError, match=r"max_num_seqs must be an integer in \[1, 256\]"):
        engine.set_knob("max_num_seqs", 0)
    with pytest.raises(ValueError, match="batching_mode must be one of"):
        engine.set_knob("batching_mode", "turbo")
    assert engine.knobs()["max_num_seqs"] == 2 and not of(events, ev.KnobChanged)
    engine.set_knob("max_num_seqs", "5", source="test")
    change = of(events, ev.KnobChanged)[-1]
    assert (change.name, change.old, change.new, change.source) == ("max_num_seqs", 2, 5, "test")
    engine.step()
    assert len(engine.scheduler.running) == 5
    engine.set_knob("max_num_seqs", 1)
    mark = len(events)
    engine.step()
    assert len(engine.scheduler.running) == 5, "lowering the cap drops nobody"
    assert not of(events[mark:], ev.RequestAdmitted)
