"""Each scenario, run headless for a bounded number of steps, shows its phenomenon in the events (counts)."""
import pytest

from batchtop.engine.model.loading import load_model
from batchtop.engine.workload.scenarios import SCENARIOS, run_scenario
from batchtop.telemetry import events as ev


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def of(events, kind):
    return [e for e in events if isinstance(e, kind)]


def utilisation(steps):
    return sum(len(e.sampled_request_ids) for e in steps) / sum(e.num_rows for e in steps)


def test_static_batches_pay_the_padding_tax_continuous_does_not(tiny):
    events = run_scenario(SCENARIOS["static-vs-continuous"], 200, loaded=tiny)
    switch = of(events, ev.KnobChanged)[0].step
    steps = of(events, ev.StepFinished)
    static, continuous = [e for e in steps if e.step < switch], [e for e in steps if e.step > switch]
    assert sum(e.num_padding_rows for e in of(events, ev.StepPlanned) if e.step < switch) > 0
    assert utilisation(static) < 0.8 < utilisation(continuous)


def test_kv_exhaustion_preempts_and_recomputes(tiny):
    events = run_scenario(SCENARIOS["kv-exhaustion"], 150, loaded=tiny)
    assert of(events, ev.RequestPreempted)
    assert any(e.recompute for e in of(events, ev.PrefillChunk))
    assert any(e.reason == "kv" for e in of(events, ev.AdmissionBlocked))


def test_a_long_prefill_shares_a_step_with_every_decode_row_until_the_threshold_caps_it(tiny):
    scenario = SCENARIOS["long-prefill"]
    events = run_scenario(scenario, 100, loaded=tiny)
    threshold_step = scenario.phases[0][0]
    planned = of(events, ev.StepPlanned)
    assert any(p.prefill_tokens == 1536 and p.num_decode_rows >= 8
               for p in planned if p.step < threshold_step)
    after = [p for p in planned if p.step >= threshold_step]
    # the second long prompt, chunked
    assert max(p.prefill_tokens + p.recompute_tokens for p in after) == 64
    assert sum(1 for p in after if p.prefill_tokens == 64 and p.num_decode_rows >= 8) >= 1536 // 64


@pytest.mark.parametrize("layout", ["condense", "indexmap"])
def test_alternating_rows_move_under_condense_and_never_under_the_index_map(tiny, layout):
    events = run_scenario(SCENARIOS["alternating"], 80, loaded=tiny, layout=layout)
    steps = of(events, ev.StepFinished)
    steps_with_moves = {e.step for e in of(events, ev.RowMoved)}
    if layout == "condense":
        assert len(steps_with_moves) >= 0.4 * len(steps)
    else:
        assert not steps_with_moves and not any(e.rows_moved for e in of(events, ev.BatchRebuilt))


def test_raising_max_num_seqs_without_kv_turns_into_preemptions(tiny):
    scenario = SCENARIOS["max-num-seqs"]
    events = run_scenario(scenario, 120, loaded=tiny)
    raised = scenario.phases[0][0]
    preempted = of(events, ev.RequestPreempted)
    assert not [e for e in preempted if e.step < raised]
    assert len([e for e in preempted if e.step >= raised]) >= 3


def first_admissions(events):
    return [e for e in of(events, ev.RequestAdmitted) if not e.resumed]


def hit_rate(admitted):
    return sum(e.num_cached_tokens for e in admitted) / sum(e.num_known_tokens for e in admitted)


def test_a_shared_system_prompt_is_computed_once(tiny):
    scenario = SCENARIOS["shared-system-prompt"]
    on, off = (run_scenario(scenario, 60, loaded=tiny, enable_prefix_caching=caching)
               for caching in (True, False))
    admitted = first_admissions(on)
    assert len(admitted) >= 6 and hit_rate(admitted) > 0.7
    # after the first, every block of the system prompt hits; the request's own full blocks are new
    assert all(e.num_hit_blocks == 24 and e.miss_reason in ("", "partial") for e in admitted[1:])
    computed = [sum(e.num_tokens for e in of(events, ev.PrefillChunk)) for events in (on, off)]
    assert computed[0] < 0.3 * computed[1]


def test_a_prefix_below_one_block_never_hits_and_says_so(tiny):
    admitted = first_admissions(run_scenario(SCENARIOS["below-block"], 80, loaded=tiny))
    assert len(admitted) >= 4 and sum(e.num_cached_tokens for e in admitted) == 0
    assert {e.miss_reason for e in admitted[1:]} == {"below_block"}
    assert all(e.num_matched_tokens == 15 for e in admitted[1:])


def test_a_small_pool_evicts_and_evicted_misses_climb(tiny):
    events = run_scenario(SCENARIOS["cache-eviction"], 120, loaded=tiny)
    admitted = first_admissions(events)
    assert of(events, ev.BlocksEvicted)
    half = len(admitted) // 2
    evicted = [sum(e.miss_reason == "evicted" for e in part) for part in (admitted[:half], admitted[half:])]
    assert evicted[1] >= max(3, evicted[0])
    assert hit_rate(admitted) > 0
