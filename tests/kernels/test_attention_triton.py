"""The Triton kernels, run by Triton's interpreter on the CPU, against the torch path and the
dense reference. Head counts are small so the interpreter stays quick."""

import pytest
import torch
from kernel_cases import (
    CACHE_SENTINEL,
    CHUNKED_SMALL,
    DECODE_ONLY,
    DECODE_SKEWED,
    MIXED,
    dense_reference,
    make_case,
)

from batchtop.kernels import attention_torch, attention_triton

pytestmark = pytest.mark.timeout(180)


def test_runs_under_the_interpreter():
    assert attention_triton.INTERPRET, "conftest must set TRITON_INTERPRET=1 before the import"


def run_triton(case):
    attention_triton.write_kv_cache(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    meta = attention_triton.build_attention_metadata(*case.step_tensors())
    return attention_triton.paged_attention(case.query, case.k_cache, case.v_cache, meta, case.scale)


def torch_reference(case):
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    attention_torch.write_kv_cache(case.key, case.value, k_cache, v_cache, case.slot_mapping)
    meta = attention_torch.build_attention_metadata(*case.step_tensors())
    return attention_torch.paged_attention(case.query, k_cache, v_cache, meta, case.scale)


def test_mixed_decode_and_long_prefill_in_one_launch():
    # KV 1841, 96 and 5023 decode rows with a 2048-token prefill, at full size, one KV head.
    seq_lens, query_lens = MIXED
    case = make_case(seq_lens, query_lens, num_kv_heads=1, group=2, head_dim=64, block_size=16)
    expected = dense_reference(case).float()
    out = run_triton(case)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("lengths", [CHUNKED_SMALL, DECODE_ONLY], ids=["chunked", "decode"])
def test_matches_torch_path_fp32(lengths, block_size, group, head_dim):
    seq_lens, query_lens = lengths
    case = make_case(seq_lens, query_lens, num_kv_heads=2, group=group, head_dim=head_dim,
                     block_size=block_size, seed=block_size * group + head_dim)
    expected = torch_reference(case)
    torch.testing.assert_close(run_triton(case), expected, atol=1e-5, rtol=1e-5)


def test_decode_rows_of_very_different_lengths():
    seq_lens, query_lens = DECODE_SKEWED
    case = make_case(seq_lens, query_lens, num_kv_heads=1, group=3, head_dim=64, block_size=32)
    torch.testing.assert_close(run_triton(case), dense_reference(case).float(), atol=1e-5, rtol=1e-5)


def test_head_dim_that_is_not_a_power_of_two():
    seq_lens, query_lens = CHUNKED_SMALL
    case = make_case(seq_lens, query_lens, num_kv_heads=2, group=3, head_dim=80, block_size=16)
    torch.testing.assert_close(run_triton(case), dense_reference(case).float(), atol=1e-5, rtol=1e-5)


def test_strided_query_view():
    seq_lens, query_lens = CHUNKED_SMALL
    case = make_case(seq_lens, query_lens, num_kv_heads=2, group=2, head_dim=64, block_size=16)
    expected = dense_reference(case).float()
    case.query = case.query.transpose(0, 1).contiguous().transpose(0, 1)
    torch.testing.assert_close(run_triton(case), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lengths", [CHUNKED_SMALL, DECODE_ONLY], ids=["chunked", "decode"])
def test_matches_torch_path_bf16(lengths):
    seq_lens, query_lens = lengths
    case = make_case(seq_lens, query_lens, num_kv_heads=2, group=3, head_dim=64, block_size=16,
                     dtype=torch.bfloat16, seed=11)
    expected = torch_reference(case)
    out = run_triton(case)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("block_size", [16, 32])
def test_cache_write_touches_exactly_the_mapped_slots(block_size):
    num_blocks, num_kv_heads, head_dim = 9, 3, 64
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, CACHE_SENTINEL)
    v_cache = torch.full(shape, -CACHE_SENTINEL)
    gen = torch.Generator().manual_seed(block_size)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:50].to(torch.int32)
    key = torch.randn(50, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(50, num_kv_heads, head_dim, generator=gen)

    attention_triton.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)

    expected_k = torch.full(shape, CACHE_SENTINEL).view(-1, num_kv_heads, head_dim)
    expected_v = torch.full(shape, -CACHE_SENTINEL).view(-1, num_kv_heads, head_dim)
    expected_k[slot_mapping.long()] = key
    expected_v[slot_mapping.long()] = value
    assert torch.equal(k_cache.view(-1, num_kv_heads, head_dim), expected_k)
    assert torch.equal(v_cache.view(-1, num_kv_heads, head_dim), expected_v)


def test_cache_write_matches_torch_write_bf16_strided():
    shape = (5, 16, 2, 64)
    caches = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(4)]
    key = torch.randn(2, 30, 64).to(torch.bfloat16).transpose(0, 1)  # [30, 2, 64], strided
    value = torch.randn(30, 2, 64).to(torch.bfloat16)
    slot_mapping = torch.randperm(80)[:30]  # int64 is accepted too
    attention_torch.write_kv_cache(key, value, caches[0], caches[1], slot_mapping)
    attention_triton.write_kv_cache(key, value, caches[2], caches[3], slot_mapping)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
