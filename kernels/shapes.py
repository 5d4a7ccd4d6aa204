"""Shape, dtype and device checks shared by the torch and triton launchers.

Every check reads only tensor metadata (shape, dtype, device, strides), never tensor values, so it
costs no device synchronisation and is cheap enough to run on each of the ~30 calls per step.
"""

from __future__ import annotations

import torch

ATTENTION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SLOT_DTYPES = (torch.int32, torch.int64)


def check_kv_write_inputs(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Raise ValueError unless key/value `[T, Hkv, D]` fit caches `[blocks, block_size, Hkv, D]`."""
    check_cache_pair(k_cache, v_cache)
    _, _, num_kv_heads, head_dim = k_cache.shape
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name} must be [num_tokens, {num_kv_heads}, {head_dim}] to match the cache, "
                f"got {tuple(t.shape)}"
            )
        if t.dtype != k_cache.dtype:
            raise ValueError(f"{name} dtype {t.dtype} differs from the cache dtype {k_cache.dtype}")
        if t.device != k_cache.device:
            raise ValueError(f"{name} is on {t.device} but the cache is on {k_cache.device}")
    if key.shape[0] != value.shape[0]:
        raise ValueError(f"key has {key.shape[0]} tokens but value has {value.shape[0]}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping must be [num_tokens={key.shape[0]}], got {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype not in SLOT_DTYPES:
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if slot_mapping.device != k_cache.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device} but the cache is on {k_cache.device}")


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}")
    if v_cache.dtype != k_cache.dtype or v_cache.device != k_cache.device:
        raise ValueError("k_cache and v_cache must share dtype and device")
    if k_cache.dtype not in ATTENTION_DTYPES:
        raise ValueError(f"cache dtype must be one of {ATTENTION_DTYPES}, got {k_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (they are viewed as flat slots)")


def check_attention_inputs(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta) -> None:
    """Raise ValueError unless query `[T, Hq, D]` and the caches match `meta` (an AttentionMetadata)."""
    check_cache_pair(k_cache, v_cache)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if query.dim() != 3 or query.shape[2] != head_dim:
        raise ValueError(f"query must be [num_tokens, num_q_heads, {head_dim}], got {tuple(query.shape)}")
    if query.shape[1] % num_kv_heads != 0:
        raise ValueError(
            f"num_q_heads={query.shape[1]} is not a multiple of num_kv_heads={num_kv_heads}"
        )
    if query.dtype != k_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} differs from the cache dtype {k_cache.dtype}")
    if query.device != k_cache.device:
        raise ValueError(f"query is on {query.device} but the cache is on {k_cache.device}")
    if query.shape[0] != meta.num_tokens:
        raise ValueError(
            f"query has {query.shape[0]} tokens but the metadata describes {meta.num_tokens} "
            "(query_start_loc[-1])"
        )
    if block_size != meta.block_size:
        raise ValueError(f"cache block_size is {block_size} but the metadata was built for {meta.block_size}")
    if meta.block_table.device != k_cache.device:
        raise ValueError(
            f"metadata is on {meta.block_table.device} but the cache is on {k_cache.device}; "
            "build it from tensors on the cache's device"
        )


def check_metadata_inputs(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int
) -> None:
    """Raise ValueError unless the step tensors follow the kernels/ contract (int32, matching sizes)."""
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    for name, t, rank in (
        ("query_start_loc", query_start_loc, 1),
        ("seq_lens", seq_lens, 1),
        ("block_table", block_table, 2),
    ):
        if not isinstance(t, torch.Tensor) or t.dim() != rank:
            raise ValueError(f"{name} must be a {rank}-D tensor, got {getattr(t, 'shape', type(t))}")
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
        if t.device != block_table.device:
            raise ValueError(f"{name} is on {t.device} but block_table is on {block_table.device}")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"query_start_loc must be [num_seqs + 1 = {num_seqs + 1}], got {tuple(query_start_loc.shape)}"
        )
    if block_table.shape[0] != num_seqs:
        raise ValueError(f"block_table has {block_table.shape[0]} rows for {num_seqs} sequences")
