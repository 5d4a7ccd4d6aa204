"""Ragged paged-attention cases and a dense reference computed from contiguous K/V.

A case holds each sequence's full K/V contiguously (the truth), a paged cache where the cached
context is already written at randomly scattered blocks and every other slot holds a sentinel,
and the step's new tokens with their slot_mapping still to be written by the code under test.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

CACHE_SENTINEL = 1000.0  # finite, and large enough to wreck any output that lets it through


@dataclass
class PagedCase:
    query: torch.Tensor  # [T, Hq, D]
    key: torch.Tensor  # [T, Hkv, D], this step's new tokens
    value: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], context written, new tokens not
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # int32 [T]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_table: torch.Tensor  # int32 [num_seqs, max_blocks]
    block_size: int
    keys: list[torch.Tensor]  # per sequence [seq_len, Hkv, D]
    values: list[torch.Tensor]
    query_lens: list[int]

    @property
    def scale(self) -> float:
        return self.query.shape[-1] ** -0.5

    def step_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        return self.query_start_loc, self.seq_lens, self.block_table, self.block_size

    def to(self, device) -> PagedCase:
        """The step's tensors on `device`; the dense truth (keys, values) stays where it was."""
        return dataclasses.replace(self, **{name: getattr(self, name).to(device) for name in (
            "query", "key", "value", "k_cache", "v_cache", "slot_mapping", "query_start_loc", "seq_lens",
            "block_table")})


def make_case(
    seq_lens: list[int],
    query_lens: list[int],
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    data_seed: int | None = None,
    spare_blocks: int = 3,
) -> PagedCase:
    """Sequences in the given order; sequence b has `query_lens[b]` new tokens at its end.

    `seed` fixes the block layout and, unless `data_seed` is given, the data too.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    # Scattered, and block 0 (also the block_table padding value) is a real block of some sequence.
    order = torch.randperm(num_blocks, generator=gen)
    block_table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    cursor = 0
    for b, n in enumerate(blocks_per_seq):
        block_table[b, :n] = order[cursor : cursor + n]
        cursor += n
    if data_seed is not None:
        gen.manual_seed(data_seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    keys = [randn(n, num_kv_heads, head_dim) for n in seq_lens]
    values = [randn(n, num_kv_heads, head_dim) for n in seq_lens]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, CACHE_SENTINEL, dtype=dtype)
    v_cache = torch.full(cache_shape, CACHE_SENTINEL, dtype=dtype)
    slots, new_keys, new_values = [], [], []
    for b, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        for pos in range(seq_len):
            block, offset = int(block_table[b, pos // block_size]), pos % block_size
            if pos < seq_len - query_len:
                k_cache[block, offset] = keys[b][pos]
                v_cache[block, offset] = values[b][pos]
            else:
                slots.append(block * block_size + offset)
        new_keys.append(keys[b][seq_len - query_len :])
        new_values.append(values[b][seq_len - query_len :])
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return PagedCase(
        query=randn(starts[-1], num_kv_heads * group, head_dim),
        key=torch.cat(new_keys),
        value=torch.cat(new_values),
        k_cache=k_cache,
        v_cache=v_cache,
        slot_mapping=torch.tensor(slots, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        block_size=block_size,
        keys=keys,
        values=values,
        query_lens=list(query_lens),
    )


def dense_reference(case: PagedCase) -> torch.Tensor:
    """Per-sequence attention in float64 over contiguous K/V with an explicit causal-offset mask."""
    outputs = []
    starts = case.query_start_loc.tolist()
    for b, query_len in enumerate(case.query_lens):
        q = case.query[starts[b] : starts[b] + query_len].double()  # [Lq, Hq, D]
        seq_len = case.keys[b].shape[0]
        group = q.shape[1] // case.keys[b].shape[1]
        k = case.keys[b].double().repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = case.values[b].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * case.scale
        q_pos = torch.arange(seq_len - query_len, seq_len)
        visible = torch.arange(seq_len)[None, :] <= q_pos[:, None]  # [Lq, S]
        scores = scores.masked_fill(~visible, float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outputs)


# Decode rows with KV lengths 1841, 96 and 5023 beside a 2048-token prefill, decode rows first
# and last so the flat order interleaves them (continuous-batching.md, "attention will not batch").
MIXED = ([1841, 2048, 96, 5023], [1, 2048, 1, 1])
# Chunked prefill (new tokens after cached context, ragged against block boundaries), a fresh
# prefill, a one-token-context chunk, decode rows and a row with no new tokens, interleaved.
CHUNKED = ([700, 1, 257, 33, 129, 50, 18], [200, 1, 17, 33, 1, 0, 2])
# The same shape of step, smaller, for the Triton interpreter: still several query tiles and
# several KV tiles per sequence, with lengths off the block and tile boundaries.
CHUNKED_SMALL = ([300, 1, 130, 33, 129, 50, 18], [70, 1, 17, 33, 1, 0, 2])
DECODE_ONLY = ([37, 1, 160, 16, 17], [1, 1, 1, 1, 1])
# Decode rows too different in length to share one padded gather in the torch path.
DECODE_SKEWED = ([5000, 40, 3000, 60, 1], [1, 1, 1, 1, 1])
