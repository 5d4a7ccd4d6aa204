"""The torch path (reference and CPU production path) against a dense per-sequence reference."""

import pytest
import torch
from kernel_cases import CHUNKED, DECODE_ONLY, DECODE_SKEWED, MIXED, dense_reference, make_case

from batchtop.kernels import attention_torch

pytestmark = pytest.mark.timeout(120)


def run_torch(case):
    attention_torch.write_kv_cache(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    meta = attention_torch.build_attention_metadata(*case.step_tensors())
    return attention_torch.paged_attention(case.query, case.k_cache, case.v_cache, meta, case.scale)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("lengths", [MIXED, CHUNKED, DECODE_ONLY, DECODE_SKEWED],
                         ids=["mixed", "chunked", "decode", "decode-skewed"])
def test_matches_dense_reference_fp32(lengths, block_size, group, head_dim):
    seq_lens, query_lens = lengths
    num_kv_heads = 1 if lengths in (MIXED, DECODE_SKEWED) else 2
    case = make_case(seq_lens, query_lens, num_kv_heads=num_kv_heads, group=group,
                     head_dim=head_dim, block_size=block_size, seed=block_size + group + head_dim)
    out = run_torch(case)
    assert out.shape == case.query.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, dense_reference(case).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lengths", [CHUNKED, DECODE_ONLY], ids=["chunked", "decode"])
def test_matches_dense_reference_bf16(lengths):
    seq_lens, query_lens = lengths
    case = make_case(seq_lens, query_lens, num_kv_heads=2, group=3, head_dim=64, block_size=16,
                     dtype=torch.bfloat16, seed=7)
    out = run_torch(case)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), dense_reference(case).float(), atol=2e-2, rtol=2e-2)


def test_query_may_be_a_strided_view():
    # The engine hands query[0].transpose(0, 1) of transformers' [1, heads, tokens, head_dim].
    seq_lens, query_lens = CHUNKED
    case = make_case(seq_lens, query_lens, num_kv_heads=2, group=3, head_dim=64, block_size=16)
    expected = dense_reference(case).float()
    case.query = case.query.transpose(0, 1).contiguous().transpose(0, 1)
    assert not case.query.is_contiguous()
    torch.testing.assert_close(run_torch(case), expected, atol=1e-5, rtol=1e-5)


def test_metadata_is_built_once_and_reused_across_layers():
    seq_lens, query_lens = CHUNKED
    layers = [make_case(seq_lens, query_lens, num_kv_heads=2, group=2, head_dim=64, block_size=16,
                        data_seed=seed) for seed in (1, 2)]
    meta = attention_torch.build_attention_metadata(*layers[0].step_tensors())
    assert torch.equal(layers[0].block_table, layers[1].block_table)
    assert not torch.equal(layers[0].query, layers[1].query)
    for case in layers:  # same block tables and lengths, different K/V and queries
        attention_torch.write_kv_cache(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
        out = attention_torch.paged_attention(case.query, case.k_cache, case.v_cache, meta, case.scale)
        torch.testing.assert_close(out, dense_reference(case).float(), atol=1e-5, rtol=1e-5)


def test_metadata_splits_decode_from_prefill_rows():
    seq_lens, query_lens = CHUNKED
    case = make_case(seq_lens, query_lens, num_kv_heads=1, group=1, head_dim=64, block_size=16)
    meta = attention_torch.build_attention_metadata(*case.step_tensors())
    assert meta.num_tokens == sum(query_lens) and meta.max_query_len == 200 and meta.max_seq_len == 700
    (decode,) = meta.decode_groups
    assert decode.token_idx.tolist() == [200, 251]  # sequences 1 and 4
    assert decode.token_idx.dtype == torch.int64 and not decode.is_whole_step
    assert [(p.token_start, p.query_len, p.seq_len) for p in meta.prefills] == [
        (0, 200, 700), (201, 17, 257), (218, 33, 33), (252, 2, 18)]
    assert meta.prefills[2].causal_mask is None  # fresh prefill: plain causal
    assert meta.prefills[0].causal_mask.shape == (200, 700)


def test_empty_step_returns_empty():
    case = make_case([5], [1], num_kv_heads=1, group=1, head_dim=64, block_size=16)
    meta = attention_torch.build_attention_metadata(
        torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
        torch.zeros(0, 1, dtype=torch.int32), 16)
    out = attention_torch.paged_attention(case.query[:0], case.k_cache, case.v_cache, meta, 0.125)
    assert out.shape == (0, 1, 64)


@pytest.mark.parametrize(
    "seq_lens, groups",
    [
        ([150, 141, 160, 155], [[0, 1, 2, 3]]),  # similar lengths: one group, one batched call
        ([37, 1, 160, 16, 17], [[0, 1, 2, 3, 4]]),  # padding under DECODE_PAD_SLACK: still one
        ([1841, 96, 5023], [[2], [0], [1]]),  # each would pad the next by more than its length
        ([5000, 40, 3000, 60], [[0, 2], [1, 3]]),  # 3000 pads to 5008, under 2x; the short pair apart
    ],
)
def test_decode_rows_are_grouped_by_length(seq_lens, groups):
    case = make_case(seq_lens, [1] * len(seq_lens), num_kv_heads=1, group=1, head_dim=16, block_size=16)
    meta = attention_torch.build_attention_metadata(*case.step_tensors())
    assert [g.token_idx.tolist() for g in meta.decode_groups] == groups
    assert [g.is_whole_step for g in meta.decode_groups] == [len(groups) == 1] * len(groups)
    for g in meta.decode_groups:
        longest = max(seq_lens[b] for b in g.token_idx.tolist())
        assert g.max_blocks == -(-longest // 16)
        assert g.kv_mask.shape == (len(g.token_idx), 1, 1, g.max_blocks * 16)
