"""The event traces of fixed seeded runs (engine/bench/traces.py) against digests taken at ee7c39b, the
first parent of bf96133 (the last merge of issue 28's moves): a reorganisation that changes what the
engine does, in any event field but wall time or in any token id, fails here. The runs use the pure
torch forward (BATCHTOP_CPU_KERNEL=0) on one thread, whose traces are the same on every CPU.

An intended change of behaviour changes digests: rerun `BATCHTOP_CPU_KERNEL=0 python -m
batchtop.engine.bench.traces OUTDIR` before and after it, compare the files, and take the new digests
with the commit named here."""
import dataclasses

import pytest
import torch

from batchtop.engine.bench import traces
from batchtop.engine.model.loading import load_model
from batchtop.telemetry import events as ev

GOLDEN = {  # run: (events, sha256 of the trace), at ee7c39b9822ceb595761b4fb0eab0c94de430a7b
    "continuous_condense": (182, "5a963dae78b62a8c677deadfeb999c48bc9bc60133e489032dc3890a947f9cce"),
    "continuous_indexmap": (181, "89b1b0feb7fa7175f83b1c3d0f5d0024c248ce604ef72e6110f1f149b3f234c4"),
    "continuous_gather": (182, "517521566a7d125b06bf6b404032081092f2c33b70ef324995209ba9884a5e0e"),
    "static": (181, "3a71d76bfcbc7531d6059f8a2bd31a489f14d9630e9037cadeede8e12931a0c7"),
    "dynamic_timeout_0": (165, "9d84bf872eb933af029c5db5d318d83db1b6516ca6d78c2916ef7faa25139cff"),
    "dynamic_full_batches": (202, "6386a8498ae45ca2d72ed366844f71ba4d7944fffe38af7365cf07f5f3bfbece"),
    "preempt_recompute": (308, "f39fadbbbb6fb3c1ea799cb92796e33539ec2abaf1385ddc01f932f160115023"),
    "preempt_retract": (349, "cd2bdf1b6cba7541c9e2efd8627371c9f23e4b22db4133bc21cde65052c6255e"),
    "chunked_prefill": (97, "7bcb18bf5c27c591084e107078d417b52227557d5e99c33086c964b940ff2655"),
    "aborts": (113, "60a9b717f51b87b188121d7ab0049df05b8a1cdf382b42aeabf7419bccf1da4d"),
    "knob_changes": (289, "d3bf20c07be084bc00472b0a1131bbc543621cdd82214956783013f7bbe567d4"),
    "priorities": (137, "6c167f3ba92c62db6f38f0e427e476e315f7a74a1ea0f094a38eeb5613f79c70"),
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
