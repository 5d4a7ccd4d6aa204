"""The engine on a CUDA device, end to end: the model and the paged KV cache on the GPU, attention
by the Triton kernels compiled for it, greedy output token-identical to transformers' generate on
the same GPU. Skipped where torch sees no CUDA device; see tests/kernels/test_attention_cuda.py
for how to run them. The device checks that need no GPU run everywhere."""
import random

import pytest
import torch
from test_outputs_match_transformers import random_arrivals_match_generate

from batchtop.engine.core.config import EngineConfig
from batchtop.engine.core.engine import Engine
from batchtop.engine.core.sampling import SamplingParams
from batchtop.engine.model.loading import load_model
from batchtop.kernels import attention_triton

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytestmark = pytest.mark.timeout(600)


def test_a_device_that_is_not_one_is_refused():
    with pytest.raises(ValueError, match="device must be cpu, cuda or cuda:N, got 'gpu'"):
        EngineConfig(device="gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="device cuda is not available"):
        Engine(EngineConfig(model="tiny", device="cuda"))


@pytest.fixture
def triton_calls(monkeypatch):
    calls = []
    original = attention_triton.paged_attention

    def counted(query, *args, **kwargs):
        calls.append(query.device.type)
        return original(query, *args, **kwargs)

    monkeypatch.setattr(attention_triton, "paged_attention", counted)
    return calls


@cuda
@pytest.mark.parametrize("config", [
    dict(max_num_seqs=8, max_num_batched_tokens=48, long_prefill_token_threshold=16, num_kv_blocks=20),
    dict(max_num_seqs=32, max_num_batched_tokens=512),
    dict(max_num_seqs=32, max_num_batched_tokens=512, cuda_graphs="on"),
    dict(max_num_seqs=8, max_num_batched_tokens=48, long_prefill_token_threshold=16,
         attention_backend="torch"),
], ids=["chunked-preempting", "roomy", "roomy-cuda-graphs-on", "torch-attention"])
def test_random_prompts_on_cuda_match_generate(config, triton_calls):
    assert not attention_triton.INTERPRET, "run with TRITON_INTERPRET=0"
    loaded, reference = load_model("tiny"), load_model("tiny")
    reference.model.to("cuda")
    engine = Engine(EngineConfig(model="tiny", device="cuda", **config), loaded=loaded)
    assert loaded.model.device.type == "cuda" and engine.runner.kv_caches[0][0].device.type == "cuda"
    preemptions = random_arrivals_match_generate(engine, reference.model, random.Random(11))
    if config.get("attention_backend") == "torch":      # the reference path on the GPU: gather + SDPA
        assert not triton_calls
    else:
        assert triton_calls and set(triton_calls) == {"cuda"}
    if "num_kv_blocks" in config:
        assert preemptions > 0, "the small pool was meant to force preemptions"


@cuda
def test_seeded_sampling_in_bfloat16_on_cuda_repeats():
    loaded = load_model("tiny", torch.bfloat16)
    prompts = [[5 + i, 17, 301, 9] for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.8, top_k=5, top_p=0.9, seed=3)

    def run():
        engine = Engine(EngineConfig(model="tiny", device="cuda", dtype="bfloat16"), loaded=loaded)
        return [c.token_ids for c in engine.generate(prompts, params)]

    first = run()
    assert first == run()
    assert all(len(tokens) == 12 for tokens in first)
    assert len({tuple(tokens) for tokens in first}) > 1
