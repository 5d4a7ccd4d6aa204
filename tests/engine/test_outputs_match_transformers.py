"""Greedy outputs through the engine are token-identical to transformers' own `generate`."""
import random

import pytest
import torch

from batchtop.engine.core.config import EngineConfig
from batchtop.engine.core.engine import Engine
from batchtop.engine.core.sampling import SamplingParams
from batchtop.engine.model.forward import FlatForward
from batchtop.engine.model.loading import load_model
from batchtop.kernels import cpu

CHAT_PROMPTS = [
    "Hi!",
    "What is the capital of France?",
    "Write a haiku about autumn leaves falling in a quiet park.",
    "Explain how a hash table handles collisions, with an example using chaining and one using open "
    "addressing.",
    "List three fruits.",
    "Translate 'good morning, how are you today?' into Spanish and French, and say which words differ most.",
    "Why do cats purr? Give a short answer that a child could understand, and then a longer answer for an "
    "adult who knows some biology, mentioning the larynx and the diaphragm.",
    "2+2=?",
    "Describe the water cycle in four steps.",
]
MAX_TOKENS = 24


def hf_greedy(model, prompts_ids, max_new_tokens):
    outputs = []
    with torch.inference_mode():
        for ids in prompts_ids:
            out = model.generate(torch.tensor([ids], device=model.device),
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long,
                                                           device=model.device),
                                 max_new_tokens=max_new_tokens, do_sample=False)
            outputs.append(out[0, len(ids):].tolist())
    return outputs


@pytest.fixture(scope="module")
def smollm2_reference():
    reference = load_model("smollm2")
    prompts = [reference.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                       add_generation_prompt=True, tokenize=True,
                                                       return_dict=False) for p in CHAT_PROMPTS]
    return prompts, hf_greedy(reference.model, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2")


def run_engine(loaded, prompts, **config):
    engine = Engine(EngineConfig(model=loaded.name, **config), loaded=loaded)
    completions = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert not engine.requests, "generate releases the requests it returned"
    return completions


@pytest.mark.parametrize("config", [
    dict(max_num_seqs=3),
    dict(max_num_seqs=3, long_prefill_token_threshold=8),
    dict(max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=9),
], ids=["batched", "chunked-prefill", "preempting"])
def test_smollm2_matches_transformers_generate(smollm2, smollm2_reference, config, monkeypatch):
    prompts, expected = smollm2_reference
    assert len(set(map(len, prompts))) >= 8
    rows = []
    product = cpu.packed_linear
    monkeypatch.setattr(cpu, "packed_linear", lambda x, packed: rows.append(len(x)) or product(x, packed))
    completions = run_engine(smollm2, prompts, **config)
    for prompt, completion, reference in zip(CHAT_PROMPTS, completions, expected):
        assert completion.token_ids == reference, prompt
    if cpu.amx_available():
        assert max(rows) >= cpu.AMX_MIN_ROWS > min(rows), "steps on the AMX tile unit and on the FMA path"
    if "num_kv_blocks" in config:
        num_preemptions = sum(c.num_preemptions for c in completions)
        assert num_preemptions > 0, "the small pool was meant to force preemptions"


@pytest.mark.skipif(cpu.unbuildable_reason() is not None, reason="the C++ kernels cannot be built here")
def test_smollm2_runs_on_its_gguf_blocks(smollm2):
    """The default model comes from a Q4_1 / Q8_0 GGUF: every projection and the LM head are packed as
    those blocks (a third of the fp32 bytes), so the identity above holds for the block kernel."""
    flat = FlatForward(smollm2.model, packed=True)      # the engine's products where they pay (AVX-512)
    linears = [linear for layer in flat.layers for linear in layer.linears] + [flat.lm_head]
    assert all(linear.packed.scale is not None for linear in linears)
    fp32_bytes = 4 * sum(m.weight.numel() for m in smollm2.model.modules() if isinstance(m, torch.nn.Linear))
    assert sum(linear.packed.nbytes for linear in linears) < fp32_bytes / 3
    down = smollm2.model.model.layers[5].mlp.down_proj.weight
    identity = torch.eye(down.shape[1])
    assert torch.equal(cpu.packed_linear(identity, flat.layers[5].down.packed).T, down)


def test_tiny_random_prompts_arriving_at_random_steps_match_generate():
    loaded, reference = load_model("tiny"), load_model("tiny")
    engine = Engine(EngineConfig(model="tiny", max_num_seqs=8, max_num_batched_tokens=48,
                                 long_prefill_token_threshold=16, num_kv_blocks=20), loaded=loaded)
    assert random_arrivals_match_generate(engine, reference.model, random.Random(7)) > 0


def random_arrivals_match_generate(engine, reference_model, rng, num_prompts=56) -> int:
    """Random prompts arrive at random steps until all are done; each output must equal transformers'
    greedy generate and every block must come back. Returns the preemptions suffered."""
    vocab = engine.loaded.model.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 60))] for _ in range(num_prompts)]
    max_tokens = [rng.randint(1, 20) for _ in prompts]
    pending, ids = list(zip(prompts, max_tokens)), []
    while pending or engine.has_unfinished():
        for _ in range(rng.choice([0, 0, 1, 3])):
            if pending:
                prompt, n = pending.pop(0)
                ids.append(engine.add_request(prompt, SamplingParams(max_tokens=n)))
        engine.step()
    assert len(ids) == len(prompts)
    preemptions = 0
    for request_id, prompt, n in zip(ids, prompts, max_tokens):
        completion = engine.completion(request_id)
        preemptions += completion.num_preemptions
        assert completion.token_ids == hf_greedy(reference_model, [prompt], n)[0]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return preemptions
