"""Launchers reject malformed inputs with a ValueError that names the problem, on both backends."""

import pytest
import torch
from kernel_cases import make_case

from batchtop.kernels import attention_torch, attention_triton

pytestmark = pytest.mark.timeout(60)

BACKENDS = [attention_torch, attention_triton]
BACKEND_IDS = ["torch", "triton"]


@pytest.fixture
def case():
    return make_case([20, 5, 1], [20, 1, 1], num_kv_heads=2, group=2, head_dim=32, block_size=16)


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize("impl", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize(
    "change, match",
    [
        (dict(query_start_loc=lambda c: c.query_start_loc.long()), "query_start_loc must be int32"),
        (dict(seq_lens=lambda c: c.seq_lens[:2]), r"num_seqs \+ 1"),
        (dict(block_table=lambda c: c.block_table[0]), "block_table must be a 2-D"),
        (dict(block_table=lambda c: c.block_table[:2]), "block_table has 2 rows"),
        (dict(query_start_loc=lambda c: c.query_start_loc + 1), "must start at 0"),
        (dict(query_start_loc=lambda c: i32([0, 20, 19, 22])), "non-decreasing"),
        (dict(seq_lens=lambda c: i32([19, 5, 1])), r"query_len \(20\) <= seq_len \(19\)"),
        (dict(seq_lens=lambda c: i32([20, 33, 1])), "max_blocks_per_seq"),
        (dict(block_size=lambda c: 0), "block_size must be a positive int"),
    ],
)
def test_bad_metadata(impl, case, change, match):
    args = dict(query_start_loc=case.query_start_loc, seq_lens=case.seq_lens,
                block_table=case.block_table, block_size=case.block_size)
    args.update({name: make(case) for name, make in change.items()})
    with pytest.raises(ValueError, match=match):
        impl.build_attention_metadata(**args)


@pytest.mark.parametrize("impl", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize(
    "change, match",
    [
        (dict(query=lambda c: c.query[..., :16]), r"query must be \[num_tokens, num_q_heads, 32\]"),
        (dict(query=lambda c: c.query[:, :3]), "not a multiple of num_kv_heads"),
        (dict(query=lambda c: c.query[:-1]), "metadata describes 22"),
        (dict(query=lambda c: c.query.double()), "query dtype"),
        (dict(k_cache=lambda c: c.k_cache[0]), "k_cache must be"),
        (dict(v_cache=lambda c: c.v_cache[:, :, :1]), "v_cache shape"),
        (dict(k_cache=lambda c: c.k_cache.half(), v_cache=lambda c: c.v_cache.half()), "query dtype"),
        (dict(k_cache=lambda c: c.k_cache.view(-1, 8, 2, 32), v_cache=lambda c: c.v_cache.view(-1, 8, 2, 32)),
         "block_size is 8"),
        (dict(k_cache=lambda c: c.k_cache.transpose(1, 2), v_cache=lambda c: c.v_cache.transpose(1, 2)),
         "must be contiguous"),
    ],
)
def test_bad_attention_inputs(impl, case, change, match):
    meta = impl.build_attention_metadata(*case.step_tensors())
    args = dict(query=case.query, k_cache=case.k_cache, v_cache=case.v_cache)
    args.update({name: make(case) for name, make in change.items()})
    with pytest.raises(ValueError, match=match):
        impl.paged_attention(args["query"], args["k_cache"], args["v_cache"], meta, case.scale)


@pytest.mark.parametrize("impl", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize(
    "change, match",
    [
        (dict(key=lambda c: c.key[:, :1]), r"key must be \[num_tokens, 2, 32\]"),
        (dict(value=lambda c: c.value[:-1]), "but value has 21"),
        (dict(value=lambda c: c.value.half()), "value dtype"),
        (dict(slot_mapping=lambda c: c.slot_mapping[:-1]), r"slot_mapping must be \[num_tokens=22\]"),
        (dict(slot_mapping=lambda c: c.slot_mapping.float()), "int32 or int64"),
    ],
)
def test_bad_cache_write_inputs(impl, case, change, match):
    args = dict(key=case.key, value=case.value, slot_mapping=case.slot_mapping)
    args.update({name: make(case) for name, make in change.items()})
    with pytest.raises(ValueError, match=match):
        impl.write_kv_cache(args["key"], args["value"], case.k_cache, case.v_cache, args["slot_mapping"])


def test_torch_path_refuses_metadata_built_for_triton(case):
    meta = attention_triton.build_attention_metadata(*case.step_tensors())
    with pytest.raises(ValueError, match="with_torch_index=False"):
        attention_torch.paged_attention(case.query, case.k_cache, case.v_cache, meta, case.scale)
