"""The C++ CPU decode kernel against the torch gather + SDPA path, on ragged paged batches."""
import random

import pytest
import torch

from batchtop.kernels import attention_cpu
from batchtop.kernels import attention_torch as at

pytestmark = pytest.mark.skipif(not attention_cpu.available(), reason=f"no C++ build: {attention_cpu._failed}")


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
    meta = at.build_attention_metadata(torch.arange(len(lens) + 1, dtype=torch.int32),
                                       torch.tensor(lens, dtype=torch.int32), block_table, block_size)
    fast = at.paged_attention(query, k_cache, v_cache, meta, head_dim ** -0.5)
    monkeypatch.setenv("BATCHTOP_CPU_KERNEL", "0")
    assert not attention_cpu.available()
    reference = at.paged_attention(query, k_cache, v_cache, meta, head_dim ** -0.5)
    torch.testing.assert_close(fast, reference, atol=2e-5, rtol=1e-5)


def test_cpu_kernel_reads_nothing_past_seq_len():
    k_cache = torch.randn(4, 16, 1, 8)
    v_cache = torch.randn_like(k_cache)
    query = torch.randn(1, 2, 8)
    block_table = torch.tensor([[2, 0]], dtype=torch.int32)
    before = attention_cpu.paged_decode(query, k_cache, v_cache, block_table, torch.tensor([20], dtype=torch.int32), 0.3)
    k_cache[0, 4:] = float("nan")            # positions 20.. of the row, and blocks it does not own
    v_cache[0, 4:] = float("nan")
    k_cache[1], v_cache[3] = float("nan"), float("nan")
    after = attention_cpu.paged_decode(query, k_cache, v_cache, block_table, torch.tensor([20], dtype=torch.int32), 0.3)
    torch.testing.assert_close(after, before)
