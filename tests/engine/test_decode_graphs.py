"""Decode steps through the CUDA graphs' buffers and padding, on the CPU: `cuda_graphs="eager"` runs the
eager forward where a graph would replay, over the same persistent buffers padded to the same sizes.
What a capture itself adds is tested on a GPU (test_decode_graphs_cuda.py)."""
import random
import weakref

import numpy as np
import pytest
import torch

from batchtop.engine.core.config import EngineConfig
from batchtop.engine.core.engine import Engine
from batchtop.engine.core.sampling import SamplingParams
from batchtop.engine.model import runner as runner_module
from batchtop.engine.model.graphs import GraphCapture, capture_sizes
from batchtop.engine.model.loading import load_model
from batchtop.engine.model.runner import Runner
from batchtop.kernels import cpu
from batchtop.telemetry import events as ev

BLOCK = 4
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def test_capture_sizes_pad_few_rows():
    assert capture_sizes(256) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 160, 192, 224, 256)
    assert capture_sizes(10) == (1, 2, 4, 8, 10)
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert capture_sizes(1) == (1,)
    assert GraphCapture((1, 2, 4), 3 * 2**20, 1.5).summary == "3 CUDA graphs for 1-4 rows, 3 MiB, 1.5 s"


def test_a_step_takes_the_smallest_size_that_holds_it(tiny):
    runner = Runner(tiny.model, NUM_BLOCKS, BLOCK, torch.float32, cuda_graphs="eager", max_rows=20,
                    max_blocks_per_seq=8)
    graphs = runner.decode_graphs
    assert graphs.sizes == (1, 2, 4, 8, 16, 20) and graphs.capture is None and not graphs.graphs
    assert [graphs.size_for(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 20, 21)] == [
        1, 2, 4, 4, 8, 8, 16, 16, 20, 20, None]
    # the padding rows' blocks come after the pool's: 20 rows at 4 slots a block
    assert runner.kv_caches[0][0].shape[0] == NUM_BLOCKS + 5


def test_no_graphs_off_cuda_unless_eager(tiny):
    assert Runner(tiny.model, NUM_BLOCKS, BLOCK, torch.float32, cuda_graphs="on",
                  max_rows=8).decode_graphs is None
    cpu_runner = Runner(tiny.model, NUM_BLOCKS, BLOCK, torch.float32)
    assert cpu_runner.decode_graphs is None and cpu_runner.kv_caches[0][0].shape[0] == NUM_BLOCKS
    with pytest.raises(ValueError, match="cuda_graphs must be one of on, off, eager"):
        EngineConfig(cuda_graphs="yes")


class Steps:
    """Rows of a hand-built persistent batch, stepped through a runner: a prefill, then decodes."""

    def __init__(self, prompts):
        self.lens = np.array([len(p) for p in prompts])
        self.token_ids = np.zeros((len(prompts), 32), dtype=np.int32)
        for row, prompt in enumerate(prompts):
            self.token_ids[row, :len(prompt)] = prompt
        # blocks out of order, each row its own, all inside the pool (at most 8 rows)
        table = np.arange(len(prompts) * 8, dtype=np.int32).reshape(len(prompts), 8)
        self.block_table = table[:, ::-1].copy()

    def prefill(self, runner):
        rows = np.arange(len(self.lens))
        return runner.prepare(self.token_ids, self.block_table, rows, np.zeros_like(self.lens), self.lens,
                              np.ones(len(rows), dtype=bool))

    def decode(self, runner, rows):
        rows = np.asarray(rows)
        return runner.prepare(self.token_ids, self.block_table, rows, self.lens[rows],
                              np.ones(len(rows), dtype=np.int64), np.ones(len(rows), dtype=bool))

    def append(self, rows, logits):
        rows = np.asarray(rows)
        self.token_ids[rows, self.lens[rows]] = logits.argmax(-1).numpy()
        self.lens[rows] += 1


def test_decode_steps_in_the_buffers_match_the_unpadded_runner(tiny, monkeypatch):
    """Same logits as the plain runner, the pool's K/V identical, the padding's written only in the padding
    blocks; the buffers are the same tensors every step, holding this step's rows and padding."""
    # Bit for bit needs products whose rows do not depend on the row count: the packed kernel's (torch's
    # matmul may pick another blocking for 4 padded rows than for 3), so force them where they are built.
    if cpu.available():
        monkeypatch.setattr(cpu, "products_pay", lambda: True)
        monkeypatch.setattr(runner_module, "_flat_forwards", weakref.WeakKeyDictionary())
    plain = Runner(tiny.model, NUM_BLOCKS, BLOCK, torch.float32)
    padded = Runner(tiny.model, NUM_BLOCKS, BLOCK, torch.float32, cuda_graphs="eager", max_rows=8,
                    max_blocks_per_seq=8)
    buffers = padded.decode_graphs.buffers
    addresses = [t.data_ptr() for t in (buffers.tokens, buffers.seq_lens, buffers.block_table)]
    prompts = [[5, 9, 200], list(range(30, 47)), [7] * 9, [11, 12], [3], list(range(60, 70))]
    steps = Steps(prompts)
    inputs = steps.prefill(padded)
    assert inputs.graph_size == 0 and inputs.num_padded_tokens == 0, "a prefill step runs eagerly"
    logits = padded.forward(inputs)
    assert torch.equal(logits, plain.forward(steps.prefill(plain)))
    steps.append(range(len(prompts)), logits)
    for rows, size in (([0, 1, 2], 4), ([0, 1, 2, 3, 4], 8), ([1, 3], 2), ([5], 1), ([0, 1, 2, 3, 4, 5], 8)):
        inputs = steps.decode(padded, rows)
        counts = (inputs.graph_size, inputs.num_actual_tokens, inputs.num_padded_tokens)
        assert counts == (size, len(rows), size - len(rows))
        assert [t.data_ptr() for t in (buffers.tokens, buffers.seq_lens, buffers.block_table)] == addresses
        assert inputs.input_ids.data_ptr() == addresses[0] and len(inputs.input_ids) == size
        assert_buffers_hold(inputs, steps, rows, size)
        logits = padded.forward(inputs)
        assert torch.equal(logits, plain.forward(steps.decode(plain, rows)))
        for (k_plain, v_plain), (k_padded, v_padded) in zip(plain.kv_caches, padded.kv_caches):
            assert torch.equal(k_plain, k_padded[:NUM_BLOCKS]) and torch.equal(v_plain, v_padded[:NUM_BLOCKS])
        steps.append(rows, logits)
    assert padded.kv_caches[0][0][NUM_BLOCKS:].abs().sum() > 0, "the padding rows wrote their own blocks"


def assert_buffers_hold(inputs, steps, rows, size):
    n, rows = len(rows), np.asarray(rows)
    starts = steps.lens[rows]
    assert inputs.input_ids[:n].tolist() == steps.token_ids[rows, starts].tolist()
    assert inputs.positions[:n].tolist() == starts.tolist()
    assert inputs.seq_lens[:n].tolist() == (starts + 1).tolist()
    expected_slots = steps.block_table[rows, starts // BLOCK] * BLOCK + starts % BLOCK
    assert inputs.slot_mapping[:n].tolist() == expected_slots.tolist()
    for i, row in enumerate(rows):
        needed = starts[i] // BLOCK + 1
        assert inputs.block_table[i, :needed].tolist() == steps.block_table[row, :needed].tolist()
    # padding row j: position j % 4 of padding block NUM_BLOCKS + j // 4, a slot of its own, outside the pool
    j = np.arange(n, size)
    assert inputs.input_ids[n:].tolist() == [0] * (size - n)
    assert inputs.positions[n:].tolist() == (j % BLOCK).tolist()
    assert inputs.seq_lens[n:].tolist() == (j % BLOCK + 1).tolist()
    assert inputs.block_table[n:, 0].tolist() == (NUM_BLOCKS + j // BLOCK).tolist()
    assert inputs.slot_mapping[n:].tolist() == ((NUM_BLOCKS + j // BLOCK) * BLOCK + j % BLOCK).tolist()
    assert inputs.query_start_loc.tolist() == list(range(size + 1))


def test_a_step_that_does_not_fit_runs_eagerly(tiny):
    padded = Runner(tiny.model, NUM_BLOCKS, BLOCK, torch.float32, cuda_graphs="eager", max_rows=4,
                    max_blocks_per_seq=8)
    steps = Steps([[5, 9, 200], [1, 2], [3, 4, 5], [6], [7, 8]])
    steps.append(range(5), padded.forward(steps.prefill(padded)))
    assert steps.decode(padded, range(5)).graph_size == 0, "more rows than the largest graph"
    mixed = padded.prepare(steps.token_ids, steps.block_table, np.arange(2), steps.lens[:2], np.array([1, 2]),
                           np.array([True, False]))
    assert mixed.graph_size == 0 and mixed.num_actual_tokens == 3, "a row with two tokens"
    not_sampling = padded.prepare(steps.token_ids, steps.block_table, np.arange(3), steps.lens[:3],
                                  np.ones(3, dtype=np.int64), np.array([True, False, True]))
    assert not_sampling.graph_size == 4 and not_sampling.logits_indices.tolist() == [0, 2]
    assert padded.forward(not_sampling).shape[0] == 2


def random_trace(rng, vocab, num_prompts):
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))] for _ in range(num_prompts)]
    params = [SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=True) if i % 3 else
              SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.9, top_k=20, seed=i)
              for i in range(num_prompts)]
    return prompts, params


def run(loaded, prompts, params, **config):
    events = []
    engine = Engine(EngineConfig(model="tiny", **config), loaded=loaded, sink=events.append)
    completions = engine.generate(prompts, params)
    return [c.token_ids for c in completions], engine, events


@pytest.mark.parametrize("config", [
    dict(max_num_seqs=12, max_num_batched_tokens=64, long_prefill_token_threshold=1, num_kv_blocks=16),
    dict(max_num_seqs=8, batching_mode="static", static_batch_size=6, num_kv_blocks=256),
    dict(max_num_seqs=16, layout="indexmap", num_kv_blocks=256),
], ids=["chunked-preempting", "static-padding-rows", "indexmap"])
def test_engine_outputs_are_identical_and_every_padded_token_is_counted(tiny, config):
    prompts, params = random_trace(random.Random(3), tiny.model.config.vocab_size, 30)
    expected, _, plain_events = run(tiny, prompts, params, cuda_graphs="off", **config)
    outputs, engine, events = run(tiny, prompts, params, cuda_graphs="eager", **config)
    assert outputs == expected
    finished = [e for e in events if isinstance(e, ev.StepFinished)]
    plain_finished = [e for e in plain_events if isinstance(e, ev.StepFinished)]
    # the same steps computed the same actual tokens; the padding is counted beside them, never in them
    assert ([(s.num_rows, s.num_tokens) for s in finished]
            == [(s.num_rows, s.num_tokens) for s in plain_finished])
    assert not any(s.num_padded_tokens for s in plain_finished)
    graphs = engine.runner.decode_graphs
    for step in finished:
        one_token_rows = step.num_tokens == step.num_rows
        expected_padding = graphs.size_for(step.num_rows) - step.num_rows if one_token_rows else 0
        assert step.num_padded_tokens == expected_padding, step
    assert sum(s.num_padded_tokens for s in finished) > 0
    if config.get("long_prefill_token_threshold") == 1:
        # one token a row every step: prompts and recomputes through the graphs' buffers too, rows
        # that do not sample
        assert all(s.num_padded_tokens or s.num_rows in graphs.sizes for s in finished)
        assert any(len(s.sampled_request_ids) < s.num_rows for s in finished)
        assert any(isinstance(e, ev.RequestPreempted) for e in events), "the small pool was meant to preempt"
    else:
        assert any(s.num_tokens > s.num_rows for s in finished), "mixed steps run eagerly, unpadded"
