"""CUDA graphs for decode steps on a GPU: captured at start, reported, replayed with outputs token-identical
to the engine without them (and, through test_engine_cuda.py's "roomy-cuda-graphs-on" engine, to
transformers' generate); no device-to-host copy inside a step but the sampled tokens.
Skipped where torch sees no CUDA device; run with TRITON_INTERPRET=0 (docs/kernels.md). The padding
and buffer logic itself is tested on the CPU in test_decode_graphs.py."""
import random

import numpy as np
import pytest
import torch
from test_decode_graphs import random_trace

from batchtop.engine.core.config import EngineConfig
from batchtop.engine.core.engine import Engine
from batchtop.engine.core.sampling import SamplingParams
from batchtop.engine.model.graphs import capture_sizes
from batchtop.engine.model.loading import load_model
from batchtop.kernels import attention_triton
from batchtop.telemetry import events as ev

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def tiny():
    assert not attention_triton.INTERPRET, "run with TRITON_INTERPRET=0"
    return load_model("tiny")


def cuda_engine(loaded, cuda_graphs, dtype="float32", sink=None, **config):
    config = {"max_num_seqs": 16, "num_kv_blocks": 256, "batch_capacity": 32, **config}
    return Engine(EngineConfig(model="tiny", device="cuda", dtype=dtype, cuda_graphs=cuda_graphs, **config),
                  loaded=loaded, sink=sink)


def test_graphs_are_captured_at_start_and_reported(tiny):
    engine = cuda_engine(tiny, "on")
    graphs = engine.runner.decode_graphs
    assert graphs.sizes == capture_sizes(32) == (1, 2, 4, 8, 16, 24, 32)
    assert set(graphs.graphs) == set(graphs.sizes)
    assert graphs.capture.sizes == graphs.sizes
    assert graphs.capture.memory_bytes > 0
    assert graphs.capture.seconds > 0
    from batchtop.tui.sources.engine import _device_name
    header_device = _device_name(engine)
    assert header_device.startswith("cuda:0 (7 CUDA graphs for 1-32 rows, "), "the dashboard header's device"
    assert cuda_engine(tiny, "off").runner.decode_graphs is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("config", [
    dict(max_num_batched_tokens=64, long_prefill_token_threshold=16, num_kv_blocks=24),
    dict(batching_mode="static", static_batch_size=6),
], ids=["chunked-preempting", "static"])
def test_outputs_with_graphs_equal_outputs_without(tiny, dtype, config, monkeypatch):
    loaded = load_model("tiny", getattr(torch, dtype)) if dtype != "float32" else tiny
    prompts, params = random_trace(random.Random(5), loaded.model.config.vocab_size, 40)
    outputs = {}
    for mode in ("off", "eager", "on"):
        events = []
        engine = cuda_engine(loaded, mode, dtype, sink=events.append, **config)
        if mode == "on":
            # after the capture every step that fits a graph replays it: the eager forward must not run
            monkeypatch.setattr(engine.runner.decode_graphs, "_forward",
                                lambda inputs: pytest.fail("eager forward"))
        outputs[mode] = [c.token_ids for c in engine.generate(prompts, params)]
        padded = sum(e.num_padded_tokens for e in events if isinstance(e, ev.StepFinished))
        assert (padded > 0) == (mode != "off")
    # a replay computes what the eager forward over the same buffers does
    assert outputs["on"] == outputs["eager"]
    if dtype == "float32":
        assert outputs["on"] == outputs["off"]
    else:
        # padding changes the GEMMs' row count, and cuBLAS may then round a bf16 product differently: a near
        # tie of the tiny random model's logits can flip; most requests must still agree token for token
        same = sum(a == b for a, b in zip(outputs["on"], outputs["off"]))
        assert same >= 0.9 * len(prompts), f"{same} of {len(prompts)} requests identical in bf16"


def test_no_device_to_host_copy_inside_a_step_but_the_sampled_tokens(tiny):
    """prepare and forward of a replayed decode step and of an eager prefill step run under torch's sync
    debug mode set to error: any read-back (.item(), .tolist(), a blocking copy) raises."""
    engine = cuda_engine(tiny, "on")
    runner = engine.runner
    ids = [engine.add_request([7 + i] * (5 + 3 * i),
                              SamplingParams(max_tokens=8, ignore_eos=True)) for i in range(3)]
    checked = {"graph": 0, "eager": 0}
    prepare, forward = runner.prepare, runner.forward

    def strict(function):
        def run(*args):
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                return function(*args)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return run

    def checked_forward(inputs):
        checked["graph" if inputs.graph_size else "eager"] += 1
        return strict(forward)(inputs)

    runner.prepare, runner.forward = strict(prepare), checked_forward
    while any(not engine.requests[i].finished for i in ids):
        engine.step()
    assert checked["graph"] >= 6 and checked["eager"] >= 1


def test_a_replayed_step_reads_its_inputs_from_the_same_buffers(tiny):
    engine = cuda_engine(tiny, "on")
    buffers = engine.runner.decode_graphs.buffers
    addresses = (buffers.tokens.data_ptr(), buffers.seq_lens.data_ptr(), buffers.block_table.data_ptr())
    engine.generate([[3, 4, 5], [6] * 20, [9] * 7], SamplingParams(max_tokens=6, ignore_eos=True))
    assert (buffers.tokens.data_ptr(), buffers.seq_lens.data_ptr(),
            buffers.block_table.data_ptr()) == addresses
    host = buffers._host_tokens
    assert host.is_pinned() and np.array_equal(buffers.tokens.cpu().numpy(), host.numpy())
