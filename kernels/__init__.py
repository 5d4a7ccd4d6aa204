"""Attention entry points for the engine: one call serves a whole ragged step (docs/kernels.md).

    meta = build_attention_metadata(query_start_loc, seq_lens, block_table, block_size)  # once per step
    (or attention_metadata_from_lengths(...), for triton, when the host knows the lengths)
    write_kv_cache(key, value, k_cache, v_cache, slot_mapping)                          # per layer
    out = paged_attention(query, k_cache, v_cache, meta, scale)                         # per layer

Backends: `torch` (reference; the CPU path) and `triton` (CUDA, or the CPU under
`TRITON_INTERPRET=1`). `auto` picks triton for CUDA tensors and torch otherwise. The environment
variable BATCHTOP_ATTENTION_BACKEND, when set, overrides whatever `select_backend` chose.
Importing this package imports neither torch nor triton (the command line reads `BACKENDS`):
the torch reference is imported on first use, the triton module on first use of triton.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .attention_torch import AttentionMetadata

__all__ = [
    "AttentionMetadata",
    "attention_metadata_from_lengths",
    "BACKENDS",
    "BACKEND_ENV_VAR",
    "backend",
    "build_attention_metadata",
    "paged_attention",
    "resolve_backend",
    "select_backend",
    "write_kv_cache",
]

BACKENDS = ("auto", "torch", "triton")
BACKEND_ENV_VAR = "BATCHTOP_ATTENTION_BACKEND"

backend = "auto"  # as chosen by select_backend; the environment variable still wins over it


def select_backend(name: str) -> str:
    """Choose `auto`, `torch` or `triton`; returns the choice in force (the env var wins if set)."""
    global backend
    backend = _check_name(name, "select_backend")
    return _requested()


def resolve_backend(device: torch.device | str) -> str:
    """The concrete backend (`torch` or `triton`) that calls on tensors on `device` will use."""
    name = _requested()
    if name == "auto":
        if isinstance(device, str):
            import torch
            device = torch.device(device)
        return "triton" if device.type == "cuda" else "torch"
    return name


def build_attention_metadata(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int
) -> AttentionMetadata:
    """Once per step, from int32 tensors on the cache's device; see docs/kernels.md, "The contract"."""
    impl = _impl(block_table.device)
    return impl.build_attention_metadata(query_start_loc, seq_lens, block_table, block_size)


def attention_metadata_from_lengths(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int, *,
    num_tokens: int, max_query_len: int, max_seq_len: int,
) -> AttentionMetadata:
    """The triton backend's metadata from lengths the caller already knows on the host. Nothing is read
    back (no device sync; it can be built while a CUDA graph captures), so the values are trusted, not
    checked: `max_seq_len` may be an upper bound, `num_tokens` must be `query_start_loc[-1]`."""
    from .attention_torch import AttentionMetadata
    from .shapes import check_metadata_inputs
    check_metadata_inputs(query_start_loc, seq_lens, block_table, block_size)
    if not (query_start_loc.is_contiguous() and seq_lens.is_contiguous() and block_table.stride(1) == 1):
        raise ValueError("query_start_loc, seq_lens and block_table rows must be contiguous for triton")
    return AttentionMetadata(query_start_loc, seq_lens, block_table, block_size, num_tokens, max_query_len,
                             max_seq_len, with_torch_index=False)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store this step's key/value `[T, Hkv, D]` at flat cache slots `slot_mapping` `[T]`."""
    _impl(k_cache.device).write_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """`[T, Hq, D]` attention output for query `[T, Hq, D]`; call after this layer's `write_kv_cache`."""
    return _impl(k_cache.device).paged_attention(query, k_cache, v_cache, meta, scale)


def _requested() -> str:
    forced = os.environ.get(BACKEND_ENV_VAR)
    if forced:
        return _check_name(forced.strip().lower(), BACKEND_ENV_VAR)
    return backend


def _check_name(name: str, where: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{where}: unknown attention backend {name!r}; choose one of {BACKENDS}")
    return name


def _impl(device: torch.device) -> ModuleType:
    if resolve_backend(device) == "torch":
        return _torch_reference()
    from batchtop.kernels import (
        attention_triton,  # deferred: triton reads TRITON_INTERPRET when kernels are defined
    )

    return attention_triton


@functools.cache
def _torch_reference() -> ModuleType:
    """The torch path, imported (with torch) on first use; a cached call after that."""
    from batchtop.kernels import attention_torch
    return attention_torch


def __getattr__(name: str):
    """`kernels.AttentionMetadata`, imported (with torch) when first asked for."""
    if name == "AttentionMetadata":
        from .attention_torch import AttentionMetadata
        return AttentionMetadata
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
