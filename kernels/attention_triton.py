"""Paged attention in Triton: a cache-write kernel and one attention kernel for a whole ragged step.

Runs on CUDA, or on the CPU when `TRITON_INTERPRET=1` is set before this module is imported
(the `@triton.jit` decorator reads it at import time). Same signatures as `attention_torch`.

The attention grid is (query tiles, KV heads). A tile holds BLOCK_Q consecutive query tokens of
one sequence times the G query heads that share one KV head, so a decode row still fills
several rows of the tile and K/V are loaded once per group. Tiles are numbered over the flat
token axis with `query_start_loc[b] // BLOCK_Q + b` as sequence b's first tile, an upper bound
that needs no host-side sizes: `num_tokens // BLOCK_Q + num_seqs` tiles cover any step, and a
program finds its sequence by binary search. Each program streams its sequence's KV in BLOCK_N
positions at a time through the block table, with an online softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_torch import AttentionMetadata
from .attention_torch import build_attention_metadata as _build_metadata
from .shapes import check_attention_inputs, check_kv_write_inputs

INTERPRET = bool(triton.knobs.runtime.interpret)


def build_attention_metadata(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int
) -> AttentionMetadata:
    """The step's metadata without the torch path's derived index (Triton reads the step tensors)."""
    meta = _build_metadata(query_start_loc, seq_lens, block_table, block_size, with_torch_index=False)
    if not (query_start_loc.is_contiguous() and seq_lens.is_contiguous() and block_table.stride(1) == 1):
        raise ValueError("query_start_loc, seq_lens and block_table rows must be contiguous for triton")
    return meta


@triton.jit
def _write_kv_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_key_t, stride_key_h, stride_value_t, stride_value_h,
    stride_cache_block, stride_cache_offset, stride_cache_head,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    dst = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_offset
    dst += heads * stride_cache_head + dims
    key = tl.load(key_ptr + token * stride_key_t + heads * stride_key_h + dims, mask=mask)
    value = tl.load(value_ptr + token * stride_value_t + heads * stride_value_h + dims, mask=mask)
    tl.store(k_cache_ptr + dst, key, mask=mask)
    tl.store(v_cache_ptr + dst, value, mask=mask)


@triton.jit
def _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence b with first_tile(b) <= tile < first_tile(b + 1), where
    first_tile(b) = qsl[b] // BLOCK_Q + b."""
    lo: tl.int32 = 0  # annotated so the loop-carried values keep one type when compiled
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_seqs"])
def _paged_attention_kernel(
    out_ptr, query_ptr, k_cache_ptr, v_cache_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_table_ptr,
    qk_scale, num_seqs,
    stride_out_t, stride_out_h, stride_query_t, stride_query_h,
    stride_cache_block, stride_cache_offset, stride_cache_head, stride_block_table,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    tile_in_seq = tile - (query_start // BLOCK_Q + seq)
    if tile_in_seq * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    num_cached = seq_len - query_len

    # Row m of the tile is query token m // GROUP_PAD of the tile, head m % GROUP_PAD of the group.
    rows = tl.arange(0, BLOCK_M)
    q_idx = tile_in_seq * BLOCK_Q + rows // GROUP_PAD
    q_head = kv_head * GROUP + rows % GROUP_PAD
    dims = tl.arange(0, DIM_PAD)
    row_ok = (q_idx < query_len) & (rows % GROUP_PAD < GROUP)
    dim_ok = dims < HEAD_DIM
    q_off = (query_start + q_idx).to(tl.int64)[:, None] * stride_query_t + q_head[:, None] * stride_query_h
    q = tl.load(query_ptr + q_off + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    q_pos = num_cached + q_idx  # causal bound: row sees KV positions 0..q_pos

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)
    kv_end = tl.minimum(seq_len, num_cached + (tile_in_seq + 1) * BLOCK_Q)
    block_row = block_table_ptr + seq.to(tl.int64) * stride_block_table
    for start in range(0, kv_end, BLOCK_N):
        kv_pos = start + tl.arange(0, BLOCK_N)
        kv_ok = kv_pos < kv_end
        block_id = tl.load(block_row + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
        kv_off = block_id * stride_cache_block + (kv_pos % BLOCK_SIZE) * stride_cache_offset
        kv_off += kv_head * stride_cache_head
        # K is loaded already transposed, [DIM_PAD, BLOCK_N], so the dot needs no tl.trans.
        k = tl.load(k_cache_ptr + kv_off[None, :] + dims[:, None],
                    mask=dim_ok[:, None] & kv_ok[None, :], other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :],
                    mask=kv_ok[:, None] & dim_ok[None, :], other=0.0)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        # "ieee" keeps fp32 steps exact (no TF32); bf16/fp16 operands use tensor cores regardless.
        s = tl.dot(q, k, input_precision="ieee") * qk_scale
        visible = kv_ok[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        # Every row sees position 0 in the first tile, so m_new is finite from then on.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        # P is rounded to the cache dtype as on the GPU, even when the dot itself runs in fp32.
        p = p.to(v_cache_ptr.dtype.element_ty).to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new

    out = acc / l_i[:, None]
    o_off = (query_start + q_idx).to(tl.int64)[:, None] * stride_out_t + q_head[:, None] * stride_out_h
    tl.store(out_ptr + o_off + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token i's key/value at flat slot `slot_mapping[i]`; slots must be in range and distinct."""
    check_kv_write_inputs(key, value, k_cache, v_cache, slot_mapping)
    _check_runnable(k_cache)
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        **write_kv_cache_constexprs(block_size, num_kv_heads, head_dim),
    )


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
    _check_runnable(k_cache)
    query = _last_dim_contiguous(query)
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    num_seqs = meta.seq_lens.shape[0]
    if num_tokens == 0:
        return out
    config = attention_constexprs(block_size, num_q_heads, num_kv_heads, head_dim, meta.max_query_len)
    grid = (num_tokens // config["BLOCK_Q"] + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out, query, k_cache, v_cache,
        meta.query_start_loc, meta.seq_lens, meta.block_table,
        scale * 1.4426950408889634, num_seqs,  # log2(e): the kernel uses exp2
        out.stride(0), out.stride(1), query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_table.stride(0),
        **config,
        num_warps=4,
    )
    return out


def attention_constexprs(
    block_size: int, num_q_heads: int, num_kv_heads: int, head_dim: int, max_query_len: int
) -> dict:
    """The attention kernel's compile-time parameters for one step's shapes."""
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    # Decode-only steps use the smallest tile tl.dot allows; prefill wants taller tiles.
    block_m = max(16 if max_query_len <= 1 else 64, group_pad)
    dim_pad = triton.next_power_of_2(head_dim)
    return dict(
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        BLOCK_Q=block_m // group_pad, BLOCK_M=block_m, BLOCK_N=64 if dim_pad <= 128 else 32,
        # The interpreter's dot multiplies bf16/fp16 as raw integers, so it gets fp32 operands.
        DOT_IN_FP32=INTERPRET,
    )


def write_kv_cache_constexprs(block_size: int, num_kv_heads: int, head_dim: int) -> dict:
    """The cache-write kernel's compile-time parameters."""
    return dict(
        BLOCK_SIZE=block_size, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), DIM_PAD=triton.next_power_of_2(head_dim),
    )


def _check_runnable(k_cache: torch.Tensor) -> None:
    if k_cache.device.type != "cuda" and not INTERPRET:
        raise ValueError(
            f"the triton backend got tensors on {k_cache.device}; it needs CUDA, or TRITON_INTERPRET=1 "
            "set before batchtop.kernels.attention_triton is imported"
        )


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()
