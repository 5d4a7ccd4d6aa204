"""Paged attention in plain torch: the reference for the Triton kernels and the engine's CPU path.

Layout (docs/kernels.md, "The contract"): caches are `[num_blocks, block_size, num_kv_heads, head_dim]`
and one step's tokens lie on a flat axis cut into sequences by `query_start_loc`.

Decode rows (query_len == 1) are batched: a group of decode rows gathers its blocks in one
`index_select` into a padded `[rows, max_blocks * block_size, Hkv, D]` tensor, and the query heads
of each KV head are treated as that head's query rows (`[rows, Hkv, G, D]`), so GQA needs no copy
of K/V. Rows normally form one group; only rows much shorter than the longest start another (see
`DECODE_PAD_SLACK`), so one 5000-token row does not pad 255 short ones to 5000. Prefill and
chunked-prefill rows (query_len > 1) run per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchtop.kernels import cpu

from .shapes import check_attention_inputs, check_kv_write_inputs, check_metadata_inputs

# A decode row joins a group padded to a longer row while the padding it adds is at most
# max(its own length, DECODE_PAD_SLACK) positions: at most 2x waste for long rows, and never a
# new group (tens of microseconds more per layer on the CPU) just to save a few blocks.
DECODE_PAD_SLACK = 1024


@dataclass(frozen=True)
class DecodeRows:
    """A group of query_len == 1 rows, in token order, padded to its longest row's block count."""

    token_idx: torch.Tensor  # int64 [rows]: each row's index on the flat token axis
    block_ids: torch.Tensor  # int64 [rows * max_blocks]: block_table rows, flattened
    kv_mask: torch.Tensor  # bool [rows, 1, 1, max_blocks * block_size]: position < seq_len
    max_blocks: int
    is_whole_step: bool  # the only group of a decode-only step: row i is token i, no scatter
    row_block_table: torch.Tensor  # int32 [rows, max_blocks]: for the C++ CPU kernel
    row_seq_lens: torch.Tensor  # int32 [rows]


@dataclass(frozen=True)
class PrefillRows:
    """One sequence with query_len > 1; its new tokens follow `seq_len - query_len` cached ones."""

    token_start: int
    query_len: int
    seq_len: int
    block_ids: torch.Tensor  # int64 [cdiv(seq_len, block_size)]
    causal_mask: torch.Tensor | None  # bool [query_len, seq_len]; None when nothing is cached


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's attention layout, built once per step and shared by every layer.

    `query_start_loc`, `seq_lens` and `block_table` are the int32 step tensors as given; the
    Triton launcher reads them directly. `decode_groups` and `prefills` are the torch path's
    derived index; they are left empty when built for Triton (`with_torch_index=False`).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    block_size: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    with_torch_index: bool = True
    decode_groups: tuple[DecodeRows, ...] = ()
    prefills: tuple[PrefillRows, ...] = ()


def build_attention_metadata(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    *,
    with_torch_index: bool = True,
) -> AttentionMetadata:
    """Validate one step's tensors and derive what `paged_attention` needs; call once per step.

    Reads the three tensors back to the host once (a sync when they live on a GPU). Derived
    tensors are created on `block_table.device`, which must be the cache's device.
    """
    check_metadata_inputs(query_start_loc, seq_lens, block_table, block_size)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    query_lens = [end - start for start, end in zip(starts, starts[1:])]
    _check_lengths(starts, query_lens, lens, block_table.shape[1] * block_size)
    meta = dict(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=block_table,
        block_size=block_size,
        num_tokens=starts[-1],
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(lens, default=0),
        with_torch_index=with_torch_index,
    )
    if not with_torch_index:
        return AttentionMetadata(**meta)
    decode_seqs = [b for b, n in enumerate(query_lens) if n == 1]
    prefill_seqs = [b for b, n in enumerate(query_lens) if n > 1]
    return AttentionMetadata(
        **meta,
        decode_groups=tuple(
            _decode_rows(group, starts, lens, block_table, block_size)
            for group in _group_decode_rows(decode_seqs, lens, block_size)
        ),
        prefills=tuple(_prefill_rows(b, starts, lens, block_table, block_size) for b in prefill_seqs),
    )


def _check_lengths(starts: list[int], query_lens: list[int], lens: list[int], capacity: int) -> None:
    if starts[0] != 0:
        raise ValueError(f"query_start_loc must start at 0, got {starts[0]}")
    for b, (query_len, seq_len) in enumerate(zip(query_lens, lens)):
        if query_len < 0:
            raise ValueError(f"query_start_loc must be non-decreasing (sequence {b} has query_len "
                             f"{query_len})")
        if not query_len <= seq_len <= capacity:
            raise ValueError(
                f"sequence {b}: need query_len ({query_len}) <= seq_len ({seq_len}) <= "
                f"max_blocks_per_seq * block_size ({capacity})"
            )


def _group_decode_rows(seqs: list[int], lens: list[int], block_size: int) -> list[list[int]]:
    """Split decode rows into groups, longest first, each returned in token order."""
    groups: list[list[int]] = []
    padded_len = 0
    for b in sorted(seqs, key=lambda b: lens[b], reverse=True):
        row_len = -(-lens[b] // block_size) * block_size
        if groups and padded_len - row_len <= max(row_len, DECODE_PAD_SLACK):
            groups[-1].append(b)
        else:
            groups.append([b])
            padded_len = row_len
    return [sorted(group) for group in groups]


def _decode_rows(
    seqs: list[int],
    starts: list[int],
    lens: list[int],
    block_table: torch.Tensor,
    block_size: int,
) -> DecodeRows:
    device = block_table.device
    max_blocks = -(-max(lens[b] for b in seqs) // block_size)
    seq_idx = torch.tensor(seqs, dtype=torch.int64, device=device)
    seq_lens = torch.tensor([lens[b] for b in seqs], dtype=torch.int64, device=device)
    positions = torch.arange(max_blocks * block_size, device=device)
    # Padding positions read real (stale or zero) cache entries; the mask gives them no weight.
    return DecodeRows(
        token_idx=torch.tensor([starts[b] for b in seqs], dtype=torch.int64, device=device),
        block_ids=block_table[seq_idx, :max_blocks].to(torch.int64).reshape(-1),
        kv_mask=(positions[None, :] < seq_lens[:, None])[:, None, None, :],
        max_blocks=max_blocks,
        is_whole_step=len(seqs) == starts[-1],
        row_block_table=block_table[seq_idx, :max_blocks].to(torch.int32).contiguous(),
        row_seq_lens=seq_lens.to(torch.int32),
    )


def _prefill_rows(
    b: int, starts: list[int], lens: list[int], block_table: torch.Tensor, block_size: int
) -> PrefillRows:
    query_len, seq_len = starts[b + 1] - starts[b], lens[b]
    num_cached = seq_len - query_len
    causal_mask = None
    if num_cached > 0:
        # New token j sits at position num_cached + j and sees positions 0..num_cached + j.
        q_pos = torch.arange(num_cached, seq_len, device=block_table.device)
        kv_pos = torch.arange(seq_len, device=block_table.device)
        causal_mask = kv_pos[None, :] <= q_pos[:, None]
    return PrefillRows(
        token_start=starts[b],
        query_len=query_len,
        seq_len=seq_len,
        block_ids=block_table[b, : -(-seq_len // block_size)].to(torch.int64),
        causal_mask=causal_mask,
    )


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token i's key/value at flat slot `slot_mapping[i]`; slots must be in range and distinct."""
    check_kv_write_inputs(key, value, k_cache, v_cache, slot_mapping)
    _, _, num_kv_heads, head_dim = k_cache.shape
    slots = slot_mapping.to(torch.int64)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of each new token over its sequence's cached KV: `[num_tokens, Hq, D]`, flat order.

    Call after `write_kv_cache` has stored this step's keys and values.
    """
    check_attention_inputs(query, k_cache, v_cache, meta)
    if not meta.with_torch_index:
        raise ValueError("metadata was built with with_torch_index=False (for triton); rebuild it for torch")
    groups = meta.decode_groups
    if len(groups) == 1 and groups[0].is_whole_step:
        return _decode_attention(query, k_cache, v_cache, groups[0], scale)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    for group in groups:
        rows = _decode_attention(query.index_select(0, group.token_idx), k_cache, v_cache, group, scale)
        out.index_copy_(0, group.token_idx, rows)
    for rows in meta.prefills:
        out[rows.token_start : rows.token_start + rows.query_len] = _prefill_attention(
            query, k_cache, v_cache, rows, scale
        )
    return out


def _decode_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: DecodeRows, scale: float
) -> torch.Tensor:
    if query.device.type == "cpu" and query.dtype == torch.float32 and cpu.available():
        # one pass over each row's KV instead of gather + padded copy + SDPA (docs/kernels.md)
        return cpu.paged_decode(query, k_cache, v_cache, rows.row_block_table, rows.row_seq_lens, scale)
    num_rows, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    padded_len = rows.max_blocks * k_cache.shape[1]
    kv_shape = (num_rows, padded_len, num_kv_heads, head_dim)
    key = k_cache.index_select(0, rows.block_ids).view(kv_shape).transpose(1, 2)
    value = v_cache.index_select(0, rows.block_ids).view(kv_shape).transpose(1, 2)
    # The G query heads sharing a KV head become that head's G query rows.
    grouped = query.reshape(num_rows, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=rows.kv_mask, scale=scale)
    return out.reshape(num_rows, num_q_heads, head_dim)


def _prefill_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: PrefillRows, scale: float
) -> torch.Tensor:
    _, _, num_kv_heads, head_dim = k_cache.shape
    key = k_cache.index_select(0, rows.block_ids).view(-1, num_kv_heads, head_dim)[: rows.seq_len]
    value = v_cache.index_select(0, rows.block_ids).view(-1, num_kv_heads, head_dim)[: rows.seq_len]
    q = query[rows.token_start : rows.token_start + rows.query_len]
    # 4-D, batch of one: torch's CPU flash kernel then takes it, GQA included; as 3-D tensors it fell
    # back to the math path (measured here: 300 -> 115 us a call for 80 tokens, 9 heads over 3).
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        key.transpose(0, 1)[None],
        value.transpose(0, 1)[None],
        attn_mask=rows.causal_mask,
        is_causal=rows.causal_mask is None,
        scale=scale,
        enable_gqa=query.shape[1] != num_kv_heads,
    )
    return out[0].transpose(0, 1)
