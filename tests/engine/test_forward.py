"""The runner's forward against transformers' own, on one ragged step of prefills then one of decodes.

Three paths: forward.py with the fused C++ ops, its products on the packed weights (the default for
Llama on a CPU with AVX-512 or AVX2; with AVX2, torch's from 128 rows) or torch's (elsewhere);
forward.py on transformers' modules op by op (no C++ build); and transformers' forward with the
paged attention registered by name (any other architecture; a Qwen2 with q/k/v biases here).
"""
import weakref

import numpy as np
import pytest
import torch
import transformers

from batchtop.engine.model import runner as runner_module
from batchtop.engine.model.forward import FlatForward, FusedCpuOps, TransformersOps
from batchtop.engine.model.loading import load_model
from batchtop.engine.model.runner import Runner
from batchtop.kernels import attention_torch, cpu

BLOCK = 4
PROMPTS = [[5, 9, 200], list(range(300, 317)), [7] * 9, list(range(1000, 1033, 3))]


def run_two_steps(model):
    """Logits of every prompt's last token (one prefill step), then of one more token each (one decode
    step)."""
    runner = Runner(model, num_blocks=64, block_size=BLOCK, dtype=torch.float32)
    rows = len(PROMPTS)
    width = max(map(len, PROMPTS)) + 1
    token_ids = np.zeros((rows, width), dtype=np.int64)
    for row, prompt in enumerate(PROMPTS):
        token_ids[row, :len(prompt)] = prompt
    # blocks out of order
    block_table = np.arange(rows * 16, dtype=np.int32).reshape(rows, 16)[:, ::-1].copy()
    slots = np.arange(rows)
    lens = np.array([len(p) for p in PROMPTS])
    samples = np.ones(rows, dtype=bool)
    prefill = runner.forward(runner.prepare(token_ids, block_table, slots, np.zeros(rows, dtype=np.int64),
                                            lens, samples))
    token_ids[slots, lens] = prefill.argmax(-1).numpy()
    decode = runner.forward(runner.prepare(token_ids, block_table, slots, lens,
                                           np.ones(rows, dtype=np.int64), samples))
    return runner, prefill, decode, [list(token_ids[r, :lens[r] + 1]) for r in range(rows)]


def reference_logits(model, sequences):
    with torch.inference_mode():
        full = [model(input_ids=torch.tensor([s])).logits[0] for s in sequences]
    return torch.stack([f[-2] for f in full]), torch.stack([f[-1] for f in full])


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny").model


def fresh_forwards(monkeypatch):
    monkeypatch.setattr(runner_module, "_flat_forwards", weakref.WeakKeyDictionary())


def assert_matches_transformers(model):
    runner, prefill, decode, sequences = run_two_steps(model)
    if runner.flat_forward is None:
        model.set_attn_implementation("sdpa")     # the runner registered its paged attention on the model
    want_prefill, want_decode = reference_logits(model, sequences)
    torch.testing.assert_close(prefill, want_prefill, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(decode, want_decode, atol=2e-4, rtol=1e-4)
    return runner


@pytest.mark.skipif(cpu.unbuildable_reason() is not None, reason="the C++ kernels cannot be built here")
@pytest.mark.parametrize("prompt_attention", ["decode kernel a row per token", "SDPA a sequence at a time"])
def test_fused_forward_matches_transformers(tiny, monkeypatch, prompt_attention):
    fresh_forwards(monkeypatch)
    sdpa = prompt_attention.startswith("SDPA")
    if sdpa:                                           # as for a step with a prompt longer than the limit
        monkeypatch.setattr(runner_module, "TOKEN_ROWS_MAX_QUERY", max(map(len, PROMPTS)) - 1)
    prompt_calls = []
    sdpa_prompt = attention_torch._prefill_attention
    monkeypatch.setattr(attention_torch, "_prefill_attention",
                        lambda *a: prompt_calls.append(1) or sdpa_prompt(*a))
    monkeypatch.setattr(cpu, "products_pay", lambda: True)     # packed products on every CPU with a build
    runner = assert_matches_transformers(tiny)
    assert bool(prompt_calls) == sdpa
    assert isinstance(runner.flat_forward.ops, FusedCpuOps)
    assert runner.flat_forward.lm_head.packed is not None


@pytest.mark.skipif(cpu.unbuildable_reason() is not None, reason="the C++ kernels cannot be built here")
def test_fused_ops_with_torch_products_match_transformers(tiny, monkeypatch):
    """Where the packed products do not pay (no AVX2, no AVX-512), the fused ops run around torch's."""
    fresh_forwards(monkeypatch)
    monkeypatch.setattr(cpu, "products_pay", lambda: False)
    runner = assert_matches_transformers(tiny)
    assert isinstance(runner.flat_forward.ops, FusedCpuOps)
    assert runner.flat_forward.lm_head.packed is None
    assert runner.flat_forward.lm_head.weight.shape == tiny.lm_head.weight.shape


def test_the_forward_packs_its_weights_where_the_cpu_has_avx512_or_avx2(tiny):
    """Elsewhere the kernels' loops are the compiler's and torch's matmul runs the products."""
    flags = set(cpu.cpu_features().split())
    pays = cpu.available() and ("avx512f" in flags or {"avx2", "fma"} <= flags)
    assert cpu.products_pay() == pays
    flat = FlatForward(tiny)
    assert all((linear.packed is not None) == pays for layer in flat.layers for linear in layer.linears)
    assert (flat.lm_head.packed is not None) == pays
    from_rows = (None if "avx512f" in flags else cpu.AVX2_TORCH_FROM_ROWS) if pays else None
    assert all(linear.torch_from_rows == from_rows for layer in flat.layers for linear in layer.linears)


@pytest.mark.skipif(cpu.unbuildable_reason() is not None, reason="the C++ kernels cannot be built here")
def test_steps_of_many_rows_take_torchs_products_over_the_linears_own_weights(tiny, monkeypatch):
    """From `torch_products_from_rows()` rows (here 5: the prompt step's 40 tokens, not the decode
    step's 4 rows) the packed forward's products are torch's, over the model's weights, not a copy."""
    fresh_forwards(monkeypatch)
    monkeypatch.setattr(cpu, "products_pay", lambda: True)
    monkeypatch.setattr(cpu, "torch_products_from_rows", lambda: 5)
    packed_rows = []
    packed_linear = cpu.packed_linear
    monkeypatch.setattr(cpu, "packed_linear", lambda x, *a, **k: packed_rows.append(x.shape[0]) or
                        packed_linear(x, *a, **k))
    runner = assert_matches_transformers(tiny)
    assert packed_rows and max(packed_rows) == len(PROMPTS), "the decode step's products were packed"
    qkv = runner.flat_forward.layers[0].qkv
    assert qkv.weight is None and qkv.linears[0].weight is tiny.model.layers[0].self_attn.q_proj.weight


def test_forward_on_transformers_modules_matches_transformers(tiny, monkeypatch):
    fresh_forwards(monkeypatch)
    monkeypatch.setenv("BATCHTOP_CPU_KERNEL", "0")
    runner = assert_matches_transformers(tiny)
    assert type(runner.flat_forward.ops) is TransformersOps
    assert runner.flat_forward.lm_head.packed is None


def test_other_architectures_run_transformers_forward_with_paged_attention():
    config = transformers.Qwen2Config(vocab_size=2048, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256)
    with torch.random.fork_rng():
        torch.manual_seed(3)
        model = transformers.Qwen2ForCausalLM(config).eval()
        for layer in model.model.layers:             # non-zero biases, so a dropped bias would show
            torch.nn.init.normal_(layer.self_attn.q_proj.bias, std=0.5)
            torch.nn.init.normal_(layer.self_attn.k_proj.bias, std=0.5)
    runner = assert_matches_transformers(model)
    assert runner.flat_forward is None


def small_llama(**overrides):
    config = transformers.LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, tie_word_embeddings=False, **overrides)
    with torch.random.fork_rng():
        torch.manual_seed(5)
        model = transformers.LlamaForCausalLM(config).eval()
        for module in model.modules():               # non-zero biases, so a dropped bias would show
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                torch.nn.init.normal_(module.bias, std=0.5)
    return model


@pytest.mark.skipif(cpu.unbuildable_reason() is not None, reason="the C++ kernels cannot be built here")
def test_fused_forward_adds_every_projection_bias(monkeypatch):
    fresh_forwards(monkeypatch)
    runner = assert_matches_transformers(small_llama(attention_bias=True, mlp_bias=True))
    assert isinstance(runner.flat_forward.ops, FusedCpuOps)
    assert runner.flat_forward.layers[0].qkv.bias is not None


def test_another_activation_runs_on_transformers_modules(monkeypatch):
    fresh_forwards(monkeypatch)
    runner = assert_matches_transformers(small_llama(hidden_act="gelu_pytorch_tanh"))
    assert type(runner.flat_forward.ops) is TransformersOps
