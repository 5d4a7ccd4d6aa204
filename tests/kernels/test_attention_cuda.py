"""The Triton kernels compiled for a real GPU (not the interpreter), against the dense reference.

Skipped where torch sees no CUDA device. On a GPU machine run with the interpreter off:
`TRITON_INTERPRET=0 pytest tests/kernels/test_attention_cuda.py tests/engine/test_engine_cuda.py`
(docs/kernels.md has the last run's figures)."""

import pytest
import torch
from kernel_cases import (
    CACHE_SENTINEL,
    CHUNKED,
    DECODE_ONLY,
    DECODE_SKEWED,
    MIXED,
    dense_reference,
    make_case,
)

from batchtop import kernels

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(300)]

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def test_the_kernels_are_compiled_not_interpreted():
    from batchtop.kernels import attention_triton
    assert not attention_triton.INTERPRET, "run with TRITON_INTERPRET=0"
    assert kernels.resolve_backend("cuda") == "triton"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("lengths", [MIXED, CHUNKED, DECODE_ONLY, DECODE_SKEWED],
                         ids=["mixed", "chunked", "decode", "decode-skewed"])
@pytest.mark.parametrize("group", [1, 3])
def test_one_launch_serves_the_ragged_step(lengths, group, dtype):
    seq_lens, query_lens = lengths
    on_cpu = make_case(seq_lens, query_lens, num_kv_heads=2, group=group, head_dim=64, block_size=16,
                       dtype=dtype, seed=group)
    case = on_cpu.to("cuda")
    kernels.write_kv_cache(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    meta = kernels.build_attention_metadata(*case.step_tensors())
    out = kernels.paged_attention(case.query, case.k_cache, case.v_cache, meta, case.scale)
    assert out.device.type == "cuda" and out.dtype == dtype
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.float().cpu(), dense_reference(on_cpu).float(), atol=tolerance,
                               rtol=tolerance)
    # the new K/V landed at their slots; every slot no sequence owns still holds the sentinel
    flat_k = case.k_cache.flatten(0, 1).cpu()
    torch.testing.assert_close(flat_k[case.slot_mapping.long().cpu()], case.key.cpu())
    owned = torch.zeros(len(flat_k), dtype=torch.bool)
    for b, seq_len in enumerate(seq_lens):
        positions = torch.arange(seq_len)
        blocks = case.block_table[b].cpu().long()[positions // case.block_size]
        owned[blocks * case.block_size + positions % case.block_size] = True
    assert (flat_k[~owned] == CACHE_SENTINEL).all()
