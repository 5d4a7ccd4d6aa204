"""EngineLoop: commands between steps, no observer or failed step stops the engine, and the built-in
load's requests arrive at their due time; what is alive at the start is frozen."""
import gc
import threading
import time
import weakref

import pytest

from batchtop.engine.core.config import EngineConfig
from batchtop.engine.core.engine import Engine
from batchtop.engine.core.loop import EngineLoop
from batchtop.engine.core.sampling import SamplingParams
from batchtop.engine.model.loading import load_model
from batchtop.engine.workload.arrivals import TraceItem, TraceLoad
from batchtop.telemetry import events as ev


@pytest.fixture
def loop():
    events = []
    engine = Engine(EngineConfig(model="tiny", max_num_seqs=4), sink=events.append, loaded=load_model("tiny"))
    loop = EngineLoop(engine).start()
    loop.events = events
    yield loop
    loop.stop()


def collect(loop, prompt, max_tokens=5, **kwargs):
    done, outputs = threading.Event(), []

    def on_output(output):
        outputs.append(output)
        if output.finished:
            done.set()
    loop.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                     on_output=on_output, **kwargs)
    assert done.wait(60)
    return outputs


def test_a_failing_step_retires_its_batch_and_the_engine_goes_on(loop):
    forward = loop.engine.runner.forward
    calls = []

    def broken_once(inputs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulated kernel failure")
        return forward(inputs)
    loop.call(lambda: setattr(loop.engine.runner, "forward", broken_once))
    failed = collect(loop, [5, 6, 7])
    assert failed[-1].finish_reason == "error"
    ok = collect(loop, [5, 6, 7])
    assert [o.finish_reason for o in ok][-1] == "length" and sum(len(o.new_token_ids) for o in ok) == 5
    assert loop.error is None and loop.running
    failed_steps = [e for e in loop.events if isinstance(e, ev.StepFailed)]
    assert [e.error for e in failed_steps] == ["RuntimeError: simulated kernel failure"]
    assert loop.call(lambda: loop.engine.kv.num_free_blocks == loop.engine.kv.num_blocks)


def test_a_raising_output_callback_does_not_stop_the_engine(loop):
    def bad_listener(output):
        raise ValueError("observer bug")
    loop.add_request([9, 9], SamplingParams(max_tokens=3, ignore_eos=True), on_output=bad_listener)
    outputs = collect(loop, [1, 2, 3])
    assert outputs[-1].finished and loop.running and loop.error is None


def test_vanishing_temperature_and_top_p_sample_without_error(loop):
    for params in (SamplingParams(max_tokens=4, temperature=1e-30),
                   SamplingParams(max_tokens=4, temperature=1.0, top_p=5e-324)):
        done = threading.Event()
        loop.add_request([3, 4], params, on_output=lambda o: o.finished and done.set())
        assert done.wait(60)
    assert loop.running and loop.error is None


def test_seeded_sampling_is_reproducible_whatever_the_batch(loop):
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, top_k=50, seed=123)
    engine = Engine(EngineConfig(model="tiny"), loaded=loop.engine.loaded)
    alone = engine.generate([[5, 6, 7]], params)[0].token_ids
    crowd = Engine(EngineConfig(model="tiny"), loaded=loop.engine.loaded).generate(
        [[5, 6, 7], [8] * 20, [9] * 3], [params, SamplingParams(max_tokens=8, temperature=1.0, seed=1),
                                          SamplingParams(max_tokens=8)])[0].token_ids
    assert alone == crowd
    unseeded = Engine(EngineConfig(model="tiny"), loaded=loop.engine.loaded).generate(
        [[5, 6, 7]] * 2, SamplingParams(max_tokens=8, temperature=5.0))
    assert unseeded[0].token_ids != unseeded[1].token_ids


def test_load_knobs_are_checked_by_the_load_itself(loop):
    """The loop refuses what the load's own check refuses, with the same words, and changes nothing."""
    from batchtop.engine.workload.arrivals import LengthDist, PoissonLoad, check_load_knob
    loop.load = PoissonLoad(0.0, LengthDist(), LengthDist())
    for name, value in (("load_rate", -1), ("load_rate", "fast"), ("load_rate", float("inf")),
                        ("length_dist", "normal"), ("burst", 3)):
        with pytest.raises(ValueError) as refused:
            check_load_knob(name, value)
        assert loop.set_load_knob(name, value) == str(refused.value)
    assert loop.load.rate == 0.0 and loop.load.output.kind == "exponential"
    assert check_load_knob("load_rate", "2.5") == 2.5


def run_load(items, before_start=None, while_running=None) -> list:
    """The tiny engine's loop over a trace load until every request finished; its events."""
    events = []
    engine = Engine(EngineConfig(model="tiny", max_num_seqs=4), sink=events.append, loaded=load_model("tiny"))
    loop = EngineLoop(engine, load=TraceLoad(items))
    if before_start is not None:
        before_start(loop)
    loop.start()
    try:
        if while_running is not None:
            while_running(loop)
        deadline = time.monotonic() + 60
        while not loop.served_load():
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        loop.stop()
    return events


def test_a_load_request_due_while_a_step_ran_counts_its_ttft_from_its_due_time():
    """The built-in load behaves as a server's clients: a request due while a step runs arrived then,
    not when the loop took it in after the step, so a what-if of the recording (which takes it in at
    the first boundary after its arrival) counts the same wait."""
    slow_s = 0.2

    def slow_first_forward(loop):
        forward, calls = loop.engine.runner.forward, []

        def slow(inputs):
            calls.append(1)
            if len(calls) == 1:
                time.sleep(slow_s)
            return forward(inputs)
        loop.engine.runner.forward = slow
    events = run_load([TraceItem(0.0, 3, 4), TraceItem(0.05, 3, 4)], before_start=slow_first_forward)
    first, second = [e for e in events if isinstance(e, ev.RequestArrived)]
    assert first.since_arrival_s < 0.05
    assert second.since_arrival_s > slow_s - 0.05 - 0.02           # taken in after the slow step
    assert second.arrival_t - first.arrival_t == pytest.approx(0.05, abs=0.02)   # its due time
    ttft = next(e for e in events if isinstance(e, ev.FirstToken) and e.request_id == second.request_id)
    assert ttft.ttft_s == pytest.approx(ttft.t - second.arrival_t, abs=2e-3)
    assert ttft.ttft_s > second.since_arrival_s


def test_a_load_request_due_while_paused_arrives_at_the_resume():
    paused_s = 0.4

    def pause_then_resume(loop):
        time.sleep(paused_s)
        loop.resume()
    events = run_load([TraceItem(0.05, 3, 4)], before_start=lambda loop: loop.pause(),
                      while_running=pause_then_resume)
    [arrived] = [e for e in events if isinstance(e, ev.RequestArrived)]
    assert arrived.since_arrival_s < 0.1           # not the 0.35 s it was due before the resume


def test_what_is_alive_at_the_start_is_out_of_the_collectors_scans_and_garbage_then_is_collected():
    class Node:
        pass
    kept = [Node() for _ in range(1000)]
    cycle = Node()
    cycle.self = cycle
    garbage = weakref.ref(cycle)
    del cycle
    engine = Engine(EngineConfig(model="tiny", max_num_seqs=4), sink=lambda e: None,
                    loaded=load_model("tiny"))
    loop = EngineLoop(engine).start()
    try:
        assert garbage() is None                     # collected before the freeze, not kept for good
        scanned = {id(o) for o in gc.get_objects()}   # generations 0-2: what a collection walks
        assert id(kept) not in scanned and not any(id(node) in scanned for node in kept)
        assert gc.get_freeze_count() >= len(kept)
        after = [Node()]
        assert id(after) in {id(o) for o in gc.get_objects()}
    finally:
        loop.stop()
