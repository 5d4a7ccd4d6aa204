"""The event traces of fixed seeded runs (engine/bench/traces.py) against digests taken at ee7c39b, the
first parent of bf96133 (the last merge of issue 28's moves), and taken again when RequestArrived
gained prompt_blocks (schema 7): with that field dropped, each trace's digest is still ee7c39b's. A
reorganisation that changes what the engine does, in any event field but wall time or in any token
id, fails here. The runs use the pure torch forward (BATCHTOP_CPU_KERNEL=0) on one thread, whose
traces are the same on every CPU.

An intended change of behaviour changes digests: rerun `BATCHTOP_CPU_KERNEL=0 python -m
batchtop.engine.bench.traces OUTDIR` before and after it, compare the files, and take the new digests
with the commit named here."""
import dataclasses

import pytest
import torch

from batchtop.engine.bench import traces
from batchtop.engine.model.loading import load_model
from batchtop.telemetry import events as ev

GOLDEN = {  # run: (events, sha256 of the trace); see the docstring for where each was taken
    "continuous_condense": (182, "c8035a1c72feb790811a96d24ce8897ea208c6a128a8abd245f4a06bd01b6224"),
    "continuous_indexmap": (181, "25c808e130f483371eed77f24f603c038ae7696544b7a03b3d10d46fe98165f4"),
    "continuous_gather": (182, "4eee76a4cc24f76c3f13f89c5de798629911f225af254e94c31f5876e84890a5"),
    "static": (181, "498d2f73f7a59fa29fec88a237200356903a5cf344920dc19807f38255990366"),
    "dynamic_timeout_0": (165, "6453f77e5cff76d05276f7e5abaad6f41c9ae2753c8a5c07c5372f1d14c56551"),
    "dynamic_full_batches": (202, "e8d14fc985d67a5e5b1d5b486aedf17b59ad094868f1bbb1892f52cab5f0f855"),
    "preempt_recompute": (308, "c22fd2cb1702fe3ba35fba6c2d8dd11c796b9dd8e51b807d89c074bd679b85dc"),
    "preempt_retract": (349, "26affffddc925f57ef51f73595422377ef95aecbdb0da93aab4d2dad6496fd65"),
    "chunked_prefill": (97, "9e90b5d50ee173ac326296dfe22a75d31a0be5f85a614250e92454e8cf87752e"),
    "aborts": (113, "7c0924c86baf164541fe2a45a7772033de360cbcbde156a33768543996d54ad5"),
    "knob_changes": (289, "fcbaf155932a982ec56f0eb81a2e64e9d61e9c9ffc7c57f15dd3f9984a2c59cf"),
    "priorities": (137, "7d68eed8eeb13c9956e09390cfc7ea0ac89defe2730a04590cd6489fe5b819ed"),
}


@pytest.fixture(scope="module")
def pure_torch():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHTOP_CPU_KERNEL", "0")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield load_model("tiny")
        finally:
            torch.set_num_threads(threads)


def test_every_run_has_its_digest():
    assert [run.name for run in traces.runs()] == list(GOLDEN)


@pytest.mark.parametrize("run", traces.runs(), ids=lambda run: run.name)
def test_the_trace_is_the_golden_one(pure_torch, run):
    lines = traces.trace(run, pure_torch)
    events = sum(1 for line in lines if line["kind"] != "Output")
    assert (events, traces.digest(lines)) == GOLDEN[run.name]


def test_only_wall_time_is_dropped():
    """The fields a trace leaves out, over every event kind: these and no others."""
    fields = {f.name for kind in vars(ev).values()
              if isinstance(kind, type) and issubclass(kind, ev.Event) for f in dataclasses.fields(kind)}
    assert {name for name in fields if traces.is_wall(name)} == {
        "t", "schedule_s", "prepare_s", "forward_s", "sample_s", "update_s", "ttft_s", "wait_s",
        "evicted_ago_s", "wait_more_s", "since_arrival_s", "input_s"}
