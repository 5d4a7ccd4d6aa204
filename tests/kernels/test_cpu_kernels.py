"""The C++ CPU kernels against torch: decode attention vs gather + SDPA, the packed GEMM vs F.linear, the
fused layer steps vs transformers' modules."""
import random

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from batchtop.kernels import attention_torch, cpu

# Skipped only where no build can succeed; with a compiler, a failed build fails these (and
# test_cpu_build.py's real build test says what the compiler said).
pytestmark = pytest.mark.skipif(cpu.unbuildable_reason() is not None,
                                reason=f"the C++ kernels cannot be built here: {cpu.unbuildable_reason()}")


@pytest.mark.parametrize("block_size, num_kv_heads, group, head_dim", [
    (16, 3, 3, 64), (32, 1, 4, 128), (16, 2, 1, 64), (8, 4, 2, 32),
])
def test_cpu_kernel_matches_torch_decode(monkeypatch, block_size, num_kv_heads, group, head_dim):
    rng = random.Random(block_size * 100 + head_dim)
    lens = [1, 2, block_size, block_size + 1, 1841, 96, 5023 // 4] + [rng.randint(1, 300) for _ in range(9)]
    num_blocks = sum(-(-n // block_size) for n in lens) + 5
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.randn_like(k_cache)
    free = torch.randperm(num_blocks).tolist()
    width = max(-(-n // block_size) for n in lens)
    block_table = torch.zeros(len(lens), width, dtype=torch.int32)
    for row, n in enumerate(lens):
        for j in range(-(-n // block_size)):
            block_table[row, j] = free.pop()
    query = torch.randn(len(lens), num_kv_heads * group, head_dim)
    meta = attention_torch.build_attention_metadata(torch.arange(len(lens) + 1, dtype=torch.int32),
                                       torch.tensor(lens, dtype=torch.int32), block_table, block_size)
    fast = attention_torch.paged_attention(query, k_cache, v_cache, meta, head_dim ** -0.5)
    monkeypatch.setenv("BATCHTOP_CPU_KERNEL", "0")
    assert not cpu.available()
    reference = attention_torch.paged_attention(query, k_cache, v_cache, meta, head_dim ** -0.5)
    torch.testing.assert_close(fast, reference, atol=2e-5, rtol=1e-5)


def test_cpu_kernel_reads_nothing_past_seq_len():
    k_cache = torch.randn(4, 16, 1, 8)
    v_cache = torch.randn_like(k_cache)
    query = torch.randn(1, 2, 8)
    block_table = torch.tensor([[2, 0]], dtype=torch.int32)
    before = cpu.paged_decode(query, k_cache, v_cache, block_table,
                              torch.tensor([20], dtype=torch.int32), 0.3)
    k_cache[0, 4:] = float("nan")            # positions 20.. of the row, and blocks it does not own
    v_cache[0, 4:] = float("nan")
    k_cache[1], v_cache[3] = float("nan"), float("nan")
    after = cpu.paged_decode(query, k_cache, v_cache, block_table, torch.tensor([20], dtype=torch.int32), 0.3)
    torch.testing.assert_close(after, before)


def test_decode_kernel_reads_a_query_with_a_row_stride():
    k_cache, v_cache = torch.randn(6, 16, 2, 8), torch.randn(6, 16, 2, 8)
    # q/k/v side by side, as the fused projection gives
    fused = torch.randn(3, (4 + 2 + 2) * 8)
    query = fused[:, :32].view(3, 4, 8)
    block_table = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    seq_lens = torch.tensor([5, 17, 32], dtype=torch.int32)
    torch.testing.assert_close(cpu.paged_decode(query, k_cache, v_cache, block_table, seq_lens, 0.3),
                               cpu.paged_decode(query.contiguous(), k_cache, v_cache, block_table,
                                                seq_lens, 0.3))


# (100, 4096): the kernel's row blocks are 64 rows at K=4096, so 130 rows are three blocks
@pytest.mark.parametrize("out_features, in_features",
                         [(960, 576), (48, 7), (50, 33), (1, 5), (97, 64), (3072, 576),
                                                       (100, 4096)])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 64, 130])
def test_packed_linear_matches_f_linear(rows, out_features, in_features):
    torch.manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features)
    x = torch.randn(rows, in_features)
    packed = cpu.pack_linear(weight)
    assert packed.scale is None, "a random weight is not in block form: fp32 panels"
    assert packed.panels.shape == (-(-out_features // cpu.PANEL), in_features, cpu.PANEL)
    out = cpu.packed_linear(x, packed)
    assert out.shape == (rows, out_features)
    torch.testing.assert_close(out, F.linear(x, weight), atol=1e-4 * in_features ** 0.5, rtol=1e-5)


def test_packed_linear_refuses_a_width_that_does_not_match_its_panels():
    packed = cpu.pack_linear(torch.randn(100, 8))            # 3 panels: 100 columns fit, 97..144 would too
    with pytest.raises(RuntimeError, match="N does not match"):
        cpu.packed_linear(torch.randn(2, 8), cpu.PackedLinear(145, packed.panels))
    with pytest.raises(RuntimeError, match="panels"):
        cpu.packed_linear(torch.randn(2, 9), packed)


def gguf_weight(out_features: int, in_features: int, seed: int, q8_rows: bool = True) -> torch.Tensor:
    """A weight as transformers dequantises a GGUF: every 32 k of a row a Q4_1 block (fp16 scale and
    minimum, q in 0..15: scale * q + minimum) or, in every third row when `q8_rows`, a Q8_0 block
    (scale * q, |q| <= 127)."""
    g = torch.Generator().manual_seed(seed)
    shape = (out_features, in_features // cpu.BLOCK, 1)
    scale = (torch.rand(shape, generator=g) * 0.02).half().float()
    minimum = (-torch.rand(shape, generator=g) * 0.15).half().float()
    q4 = torch.randint(0, 16, (*shape[:2], cpu.BLOCK), generator=g).float()
    # the block's minimum and maximum, as Q4_1 quantises
    q4[..., 0], q4[..., 1] = 0, 15
    q8 = torch.randint(-127, 128, (*shape[:2], cpu.BLOCK), generator=g).float()
    q8[..., 0] = 127
    is_q8 = (torch.arange(out_features).view(-1, 1, 1) % 3 == 2) & q8_rows
    weight = torch.where(is_q8, scale * q8, scale * q4 + minimum)
    return weight.view(out_features, in_features)


@pytest.mark.parametrize("q8_rows", [False, True], ids=["Q4_1: nibbles", "Q4_1 and Q8_0: int8"])
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (50, 64), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 64, 130])
def test_a_weight_in_gguf_blocks_is_packed_as_blocks_with_the_fp32_result_bit_for_bit(
        rows, out_features, in_features, q8_rows):
    weight = gguf_weight(out_features, in_features, seed=rows, q8_rows=q8_rows)
    packed, fp32 = cpu.pack_linear(weight), cpu.pack_linear(weight, blocks=False)
    assert packed.scale is not None
    if q8_rows:
        assert packed.panels.dtype == torch.int8 and packed.nbytes < fp32.nbytes / 3
    else:
        assert packed.panels.shape[-1] == cpu.PANEL // 2 and packed.nbytes < fp32.nbytes / 5
    x = torch.randn(rows, in_features)
    out = cpu.packed_linear(x, packed, amx_min_rows=None)
    same = cpu.packed_linear(x, fp32)
    assert torch.equal(out, same), "the blocks decode to the same weights, summed in the same order"
    torch.testing.assert_close(out, F.linear(x, weight), atol=1e-4 * in_features ** 0.5, rtol=1e-5)


needs_amx = pytest.mark.skipif(not cpu.amx_available(), reason="no AMX tile unit (or no permission for it)")


def max_error(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> float:
    return (out.double() - x.double() @ weight.double().T).abs().max().item()


@needs_amx
@pytest.mark.parametrize("q8_rows", [False, True], ids=["Q4_1: nibbles", "Q4_1 and Q8_0: int8"])
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (50, 64), (576, 1536)])
# 1, 17: partial row tiles; 130 at K=1536 and 300 at K=576: more rows than one row block
# (tiles converted up front)
@pytest.mark.parametrize("rows", [1, 17, 24, 64, 130, 300])
def test_the_tile_unit_product_is_as_accurate_as_the_fma_path(rows, out_features, in_features, q8_rows):
    weight = gguf_weight(out_features, in_features, seed=rows + 7, q8_rows=q8_rows)
    packed = cpu.pack_linear(weight)
    # x over many binades: its three bf16 parts must carry all 24 bits of every value
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g)
    x = x * 2.0 ** torch.randint(-30, 30, (rows, in_features), generator=g)
    tiles, fma = cpu.packed_linear(x, packed, amx_min_rows=1), cpu.packed_linear(x, packed, amx_min_rows=None)
    assert not torch.equal(tiles, fma), "another summation order: the tile path ran"
    assert max_error(tiles, x, weight) <= 1.5 * max_error(fma, x, weight)
    torch.testing.assert_close(tiles, fma, atol=1e-4 * x.abs().max().item() * in_features ** 0.5, rtol=1e-5)


@needs_amx
def test_the_tile_unit_serves_from_amx_min_rows_and_the_fma_path_below():
    weight = gguf_weight(96, 64, seed=3)
    packed, fp32 = cpu.pack_linear(weight), cpu.pack_linear(weight, blocks=False)
    for rows in (cpu.AMX_MIN_ROWS - 1, cpu.AMX_MIN_ROWS):
        x = torch.randn(rows, 64)
        on_fma_path = torch.equal(cpu.packed_linear(x, packed), cpu.packed_linear(x, fp32))
        assert on_fma_path == (rows < cpu.AMX_MIN_ROWS)


@pytest.mark.parametrize("q8_rows", [False, True])
def test_the_blocks_decode_to_the_weight_exactly(q8_rows):
    weight = gguf_weight(100, 96, seed=1, q8_rows=q8_rows)
    # x = identity: out[m, n] = 1 * w[n, m] plus zeros, so the output is the decoded weight, transposed
    assert torch.equal(cpu.packed_linear(torch.eye(96), cpu.pack_linear(weight)).T, weight)
    q, scale, offset = cpu.exact_blocks(weight)
    decoded = scale.repeat_interleave(cpu.BLOCK, 1) * q + offset.repeat_interleave(cpu.BLOCK, 1)
    assert q.abs().max() == (127 if q8_rows else 15) and torch.equal(decoded, weight)


def test_a_weight_almost_in_block_form_keeps_fp32_panels():
    weight = gguf_weight(50, 64, seed=2)
    assert cpu.exact_blocks(weight) is not None
    nudged = weight.clone()
    nudged[7, 40] = torch.nextafter(nudged[7, 40], torch.tensor(1.0))     # one weight one ulp off its block
    assert cpu.exact_blocks(nudged) is None and cpu.pack_linear(nudged).scale is None
    assert cpu.exact_blocks(weight[:, :48]) is None, "K is not a multiple of the block size"
    assert cpu.exact_blocks(torch.zeros(4, 64)) is not None, "an all-zero block is scale 0"


@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_add_rms_norm_is_llama_rms_norm_of_the_updated_residual(tokens):
    norm = LlamaRMSNorm(576, eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    hidden, delta = torch.randn(tokens, 576), torch.randn(tokens, 576)
    want_hidden = hidden + delta
    with torch.inference_mode():
        want = norm(want_hidden)
        got = cpu.add_rms_norm(hidden, delta, norm.weight, norm.variance_epsilon)
        torch.testing.assert_close(hidden, want_hidden, atol=0, rtol=0)          # updated in place, exactly
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cpu.add_rms_norm(hidden, None, norm.weight, 1e-5), want,
                                   atol=1e-5, rtol=1e-5)


def test_rope_and_cache_rotates_like_transformers_and_stores_k_and_v():
    heads, kv_heads, dim, tokens, block_size = 9, 3, 64, 7, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    positions = torch.tensor([0, 1, 2, 40, 41, 900, 5])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)
    cos, sin = angles.cos(), angles.sin()
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    want_q, want_k = apply_rotary_pos_emb(q.reshape(tokens, heads, dim),
                                          k.reshape(tokens, kv_heads, dim), cos, sin, unsqueeze_dim=1)
    want_v = v.reshape(tokens, kv_heads, dim).clone()
    k_cache, v_cache = torch.zeros(5, block_size, kv_heads, dim), torch.zeros(5, block_size, kv_heads, dim)
    slot_mapping = torch.tensor([19, 0, 7, 8, 3, 12, 13])
    got_q = cpu.rope_and_cache(qkv, cos, sin, heads, kv_heads, k_cache, v_cache, slot_mapping)
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_cache.view(-1, kv_heads, dim)[slot_mapping], want_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_cache.view(-1, kv_heads, dim)[slot_mapping], want_v, atol=0, rtol=0)
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[slot_mapping] = False
    assert k_cache.view(20, -1)[untouched].abs().sum() == 0
    assert v_cache.view(20, -1)[untouched].abs().sum() == 0


@pytest.mark.parametrize("tokens", [1, 33])
def test_silu_mul_is_silu_of_gate_times_up(tokens):
    gate_up = torch.randn(tokens, 2 * 1536) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu.silu_mul(gate_up), F.silu(gate) * up, atol=1e-5, rtol=1e-5)


def test_argmax_rows_is_torch_argmax_ties_nans_and_signed_zeros_included():
    logits = torch.randn(37, 49152)
    assert torch.equal(cpu.argmax_rows(logits), logits.argmax(dim=-1))
    edge = torch.full((6, 100), -1.0)
    edge[0, 5] = edge[0, 9] = 2.0                           # a tie: the first
    edge[1, 3], edge[1, 7], edge[1, 8] = float("inf"), float("nan"), -float("nan")   # NaN is the largest
    edge[2] = -float("inf")
    edge[3, 4], edge[3, 8] = -0.0, 0.0                      # -0.0 == 0.0: the first
    edge[4, 99] = float("inf")
    edge[5, 0] = -float("nan")
    assert torch.equal(cpu.argmax_rows(edge), edge.argmax(dim=-1))


@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_argmax_rows_split_across_threads_keeps_torchs_answer(rows):
    """Fewer rows than 4x the threads: each row's vocabulary is split among the threads; the slices'
    winners are compared in order, so a tie across a slice boundary still gives the first index."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        logits = torch.randn(rows, 49152)
        assert torch.equal(cpu.argmax_rows(logits), logits.argmax(dim=-1))
        logits[:, 100] = logits[:, 40000] = 50.0                    # a tie in two slices: the first
        assert cpu.argmax_rows(logits).tolist() == [100] * rows
        logits[:, 30000] = float("inf")
        logits[:, 45000] = float("nan")                            # NaN in the later slice beats inf
        assert torch.equal(cpu.argmax_rows(logits), logits.argmax(dim=-1))
    finally:
        torch.set_num_threads(threads)
