"""C++ kernels for the CPU, compiled on first use from cpu_kernels.cpp.

How they work and what they measured: docs/kernels.md, "The C++ CPU kernels".

- `paged_decode(q, k_cache, v_cache, block_table, seq_lens, scale)`: attention of query_len-1 rows
  over the paged cache, each row's K/V read once; fp32.
- `pack_linear(W)` / `packed_linear(x, packed)`: `x @ W.T` over a weight packed once into 48-column
  panels. A weight that is exactly a dequantised GGUF Q4_1 / Q8_0 weight is packed as those blocks
  and decoded to the same fp32 values in the kernel; with AMX (`amx_available()`) such a weight's
  products of `AMX_MIN_ROWS` rows or more run on the tile unit, fp32-accurate.
- `add_rms_norm`, `rope_and_cache`, `silu_mul`: a Llama layer's elementwise steps, one call each,
  the same arithmetic as transformers' modules.
- `argmax_rows`: the greedy sampler's argmax (torch's NaN and -0.0 rules).

The build happens once per CPU and checkout, into the torch extensions cache under a name carrying a
hash of the CPU's instruction-set flags and of this source file's path, so no CPU loads a library built
for another and two checkouts on one machine never rebuild each other's (torch's build file names the
source's path). A lock left by an
interrupted build is broken once untouched for `STALE_LOCK_S`; while a build runs `build_note()`
says so. `available()` is False where the build fails (said once on stderr; `unavailable_reason()`
keeps why, `build_error()` the compiler's messages) or with BATCHTOP_CPU_KERNEL=0; callers then use
torch. `unbuildable_reason()` says, without building, where no build can succeed (no compiler).
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
EXTENSION = "batchtop_cpu_kernels"
PANEL = 48                     # output columns per packed panel; the kernel's micro-tile width
BLOCK = 32                     # k per scale and offset of a block-packed weight (GGUF's block size)
# From this many rows a block weight's product runs on the AMX tile unit, where there is one (the
# whole model's products, one process: 24 rows level with the FMA path, 20 rows 10% slower).
AMX_MIN_ROWS = 24
# With AVX2 alone, from this many rows torch's matmul runs the products (the whole model's, 2 threads:
# packed 0.79x torch's time at 64 rows, 1.05x at 128, 1.17x at 256; docs/kernels.md).
AVX2_TORCH_FROM_ROWS = 128

# an interrupted build's lock, untouched this long, is broken (a build takes ~1 min)
STALE_LOCK_S = 300.0
LOCK_POLL_S = 0.5
FEATURES_FILE = "cpu_features"  # beside the library: the flags it was compiled for

_lock = threading.Lock()
_module = None
_failed: str | None = None       # the build's error, its first line (said on stderr)
_error: str | None = None        # the whole of it: the compiler's own messages
_building: str | None = None     # what the build is doing right now, for a loading screen


def cpu_features() -> str:
    """The CPU's instruction-set flags, sorted (what `-march=native` compiles for), and its architecture."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((line.split(":",
                                     1)[1] for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:                 # not Linux: the processor's name is the best key at hand
        flags = platform.processor()
    return " ".join([platform.machine(), *sorted(set(flags.split()))])


def extension_name(features: str | None = None) -> str:
    """The cache key: the extension's name with a hash of the CPU features it is compiled for and of
    the source it is compiled from."""
    key = f"{features or cpu_features()}\n{SOURCE.resolve()}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return f"{EXTENSION}_{digest}"


def _load():
    global _module, _failed, _error, _building
    if _module is not None:
        return _module
    with _lock:
        if _module is None and _failed is None:
            try:
                _module = _build(cpu_features())
            except Exception as error:          # no compiler, no headers: the torch paths serve
                _failed, _error = _first_line(error), str(error)
                print(f"batchtop: the C++ CPU kernels are unavailable ({_failed}); the engine uses torch's "
                      f"operators instead, slower (BATCHTOP_VERBOSE_BUILD=1 shows the build)",
                      file=sys.stderr)
            finally:
                _building = None
    return _module


def _build(features: str):
    """Compile (or load the cached build for this CPU) after clearing what would hang or crash it."""
    global _building
    from torch.utils.cpp_extension import _get_build_directory, load
    name = extension_name(features)
    build_dir = Path(_get_build_directory(name, verbose=False))
    _drop_foreign_build(build_dir, features)
    _wait_for_build_lock(build_dir / "lock")
    if not (build_dir / f"{name}.so").exists():
        _building = "compiling the C++ CPU kernels (first start on this CPU, about a minute)"
        print(f"batchtop: {_building}...", file=sys.stderr)
    module = load(name=name, sources=[str(SOURCE)], build_directory=str(build_dir),
                  extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                  extra_ldflags=["-fopenmp"], verbose=bool(os.environ.get("BATCHTOP_VERBOSE_BUILD")))
    (build_dir / FEATURES_FILE).write_text(features + "\n")
    return module


def _drop_foreign_build(build_dir: Path, features: str) -> None:
    """A build marked for other CPU features (a copied cache, a hash collision) is deleted, never loaded."""
    marker = build_dir / FEATURES_FILE
    try:
        marked = marker.read_text().strip()
    except OSError:
        return
    if marked != features:
        print(f"batchtop: {build_dir} was built for other CPU features; rebuilding it for this CPU",
              file=sys.stderr)
        for entry in build_dir.iterdir():
            if entry.is_file() or entry.is_symlink():
                entry.unlink()
            else:
                shutil.rmtree(entry, ignore_errors=True)


def _wait_for_build_lock(lock: Path) -> None:
    """Wait while another process builds; break the lock once nothing in the build folder moved for
    `STALE_LOCK_S` (torch's own wait has no end, and an interrupted build never removes its lock)."""
    global _building
    while lock.exists():
        idle_s = time.time() - _newest_mtime(lock.parent)
        if idle_s > STALE_LOCK_S:
            print(f"batchtop: breaking the stale build lock {lock} (nothing built for {idle_s / 60:.0f} min: "
                  f"an interrupted build left it)", file=sys.stderr)
            lock.unlink(missing_ok=True)
            break
        if _building is None:
            _building = "waiting for another process's build of the C++ CPU kernels"
            print(f"batchtop: {_building} ({lock})...", file=sys.stderr)
        time.sleep(LOCK_POLL_S)
    _building = None


def _newest_mtime(folder: Path) -> float:
    times = [folder.stat().st_mtime]
    for entry in folder.iterdir():
        try:
            times.append(entry.stat().st_mtime)
        except OSError:            # removed while we looked
            pass
    return max(times)


def _first_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else 'no message'}"


def build_note() -> str | None:
    """What the first build is doing while it runs (a loading screen shows it), else None."""
    return _building


def compiler() -> str | None:
    """The C++ compiler torch's build calls ($CXX, else c++), or None where there is none."""
    return shutil.which(os.environ.get("CXX", "c++"))


def unbuildable_reason() -> str | None:
    """Why the kernels cannot be built here at all (switched off, no compiler), without trying; None
    where a build must succeed."""
    if os.environ.get("BATCHTOP_CPU_KERNEL", "1") == "0":
        return "BATCHTOP_CPU_KERNEL=0"
    if compiler() is None:
        return f"no C++ compiler ({os.environ.get('CXX', 'c++')} is not on PATH)"
    from torch.utils.cpp_extension import is_ninja_available
    if not is_ninja_available():
        return "no ninja (torch's extension build needs it)"
    return None


def build_error() -> str | None:
    """The failed build's compiler messages (its lines that say error, else the whole text), or None."""
    if _error is None:
        return None
    lines = [line for line in _error.splitlines() if "error" in line.lower()]
    return "\n".join(lines[:40]) if lines else _error


def unavailable_reason() -> str | None:
    """Why the kernels are off (the build failed, or BATCHTOP_CPU_KERNEL=0), or None when they serve."""
    if os.environ.get("BATCHTOP_CPU_KERNEL", "1") == "0":
        return "BATCHTOP_CPU_KERNEL=0"
    return _failed


def available() -> bool:
    if os.environ.get("BATCHTOP_CPU_KERNEL", "1") == "0":
        return False
    return _load() is not None


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention of `query` `[rows, Hq, D]` (one token per row) over each row's paged KV."""
    if query.stride(2) != 1 or query.stride(1) != query.shape[2]:
        query = query.contiguous()
    return _load().paged_decode(query, k_cache, v_cache, _as(block_table, torch.int32),
                                _as(seq_lens, torch.int32), float(scale))


def _as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` as contiguous `dtype`; the check alone when it already is (a layer's calls, every step)."""
    return tensor if tensor.dtype == dtype and tensor.is_contiguous() else tensor.to(dtype).contiguous()


@dataclass(frozen=True)
class PackedLinear:
    """A weight `[N, K]` packed for `packed_linear`: fp32 panels `[ceil(N / 48), K, 48]` (panel p
    holds output columns 48p..48p+47, zero past N), or, for a weight in block form (`exact_blocks`),
    q panels with a scale and an offset per 32 k of each column `[P, K / 32, 48]`: int8 `[P, K, 48]`,
    or uint8 `[P, K, 24]` of two 4-bit q each when every q is in 0..15 (Q4_1)."""

    out_features: int
    panels: torch.Tensor
    scale: torch.Tensor | None = None
    offset: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        parts = (self.panels, self.scale, self.offset)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


def pack_linear(weight: torch.Tensor, blocks: bool = True) -> PackedLinear:
    """Block panels where the weight is exactly in block form (and `blocks`), fp32 panels otherwise."""
    weight = weight.detach().float()
    found = exact_blocks(weight) if blocks else None
    if found is None:
        return PackedLinear(weight.shape[0], _panels(weight))
    q, scale, offset = found
    panels = _panels(q)
    if q.min() >= 0 and q.max() <= 15:          # Q4_1 throughout: two 4-bit q a byte
        panels = _nibbles(panels)
    return PackedLinear(weight.shape[0], panels, _panels(scale), _panels(offset))


def _nibbles(panels: torch.Tensor) -> torch.Tensor:
    """int8 q panels `[P, K, 48]` of values 0..15 -> uint8 `[P, K, 24]`: byte j < 16 holds column j
    (low nibble) and 16 + j (high), byte 16 + j holds column 32 + j and 40 + j (the kernel's decode)."""
    q = panels.to(torch.uint8)
    return torch.cat([q[..., :16] | q[..., 16:32] << 4, q[..., 32:40] | q[..., 40:] << 4],
                     dim=-1).contiguous()


def _panels(matrix: torch.Tensor) -> torch.Tensor:
    """`[N, k]` -> `[ceil(N / 48), k, 48]`, zero past N."""
    padded = F.pad(matrix, (0, 0, 0, -matrix.shape[0] % PANEL))
    return padded.view(-1, PANEL, matrix.shape[1]).transpose(1, 2).contiguous()


def exact_blocks(weight: torch.Tensor, rows_at_once: int = 4096):
    """`(q int8 [N, K], scale, offset fp32 [N, K / 32])` with `weight == scale * q + offset` exactly
    in every 32 k of a row, or None. The two forms of a dequantised GGUF block: Q4_1 (scale and
    offset fp16 values, q in 0..15; the offset is the block's smallest weight) and Q8_0 (offset 0,
    |q| <= 127, the block's largest |weight| at q = +-127). scale * q is exact in fp32 in both, so
    the one rounding of the sum is the same in the kernel as here."""
    n, k = weight.shape
    if k % BLOCK or n == 0:
        return None
    q = torch.empty(n, k, dtype=torch.int8)
    scale, offset = torch.empty(n, k // BLOCK), torch.empty(n, k // BLOCK)
    for start in range(0, n, rows_at_once):       # a few MB at a time, so the temporaries stay in cache
        v = weight[start:start + rows_at_once].reshape(-1, k // BLOCK, BLOCK)
        low, high = v.amin(-1, keepdim=True), v.amax(-1, keepdim=True)
        scale4 = ((high - low) / 15).half().float()
        q4 = ((v - low) / scale4).nan_to_num_(0).round_().clamp_(0, 15)
        is_q4 = (scale4 * q4 + low == v).all(-1, keepdim=True)
        scale8 = v.abs().amax(-1, keepdim=True) / 127
        q8 = (v / scale8).nan_to_num_(0).round_().clamp_(-127, 127)
        is_q8 = (scale8 * q8 == v).all(-1, keepdim=True)
        if not (is_q4 | is_q8).all():
            return None
        rows = slice(start, start + v.shape[0])
        q[rows] = torch.where(is_q4, q4, q8).view(-1, k).to(torch.int8)
        scale[rows] = torch.where(is_q4, scale4, scale8)[..., 0]
        offset[rows] = torch.where(is_q4, low, 0.0)[..., 0]
    return q, scale, offset


def packed_linear(x: torch.Tensor, packed: PackedLinear,
                  amx_min_rows: int | None = AMX_MIN_ROWS) -> torch.Tensor:
    """`x` `[M, K]` times the packed weight's transpose: `[M, out_features]`. A block weight's
    product runs on the AMX tile unit from `amx_min_rows` rows (None: never, the FMA path, bit for
    bit the fp32 panels' result)."""
    if packed.scale is None:
        return _load().packed_linear(x.contiguous(), packed.panels, packed.out_features)
    return _load().packed_linear_blocks(x.contiguous(), packed.panels, packed.scale, packed.offset,
                                        packed.out_features, amx_min_rows or 0)


def vector_unit() -> str:
    """The product tiles this CPU's build runs: "AVX-512" (8 rows x 48 columns in its 32 registers),
    "AVX2" (with FMA, no AVX-512: 4 rows x 16 columns in 8 of its 16) or "" (the compiler's loop)."""
    flags = set(cpu_features().split())
    if "avx512f" in flags:
        return "AVX-512"
    return "AVX2" if {"avx2", "fma"} <= flags else ""


def product_tile_rows() -> int:
    """Rows of the packed products' micro-tile on this CPU's build (`vector_unit`): a product of M rows
    runs ceil(M / this) tiles, each reading its panel of the weights once."""
    return _load().tile_rows()


def products_pay() -> bool:
    """Whether the packed products beat torch's fp32 matmul on this CPU: where its tiles are written for
    the vector unit (docs/kernels.md). Elsewhere the products stay torch's."""
    return available() and vector_unit() != ""


def torch_products_from_rows() -> int | None:
    """From how many rows torch's matmul is the faster product where the weights are packed (None:
    never). With AVX2 alone the packed products are level with torch's at about 128 rows and slower
    from there (docs/kernels.md): steps of this many tokens or more take torch's."""
    return None if vector_unit() == "AVX-512" else AVX2_TORCH_FROM_ROWS


def amx_available() -> bool:
    """Whether block weights' many-row steps can run on the AMX tile unit (the CPU has it, the
    kernels were built for it and the OS granted the tile state)."""
    return available() and _load().amx_available()


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """`hidden += delta` in place (when given), then transformers' LlamaRMSNorm of `hidden`."""
    return _load().add_rms_norm(hidden, delta, weight, float(eps))


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Rotate q (in place) and k of the fused `[T, (Hq + 2 Hkv) * D]` projection, store k and v in
    the caches at `slot_mapping`; returns q as a `[T, Hq, D]` view."""
    return _load().rope_and_cache(qkv, cos, sin, num_heads, num_kv_heads, k_cache, v_cache,
                                  _as(slot_mapping, torch.int64))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`[T, 2I]` -> `silu(gate) * up` `[T, I]`."""
    return _load().silu_mul(gate_up)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` of fp32 `[R, V]`, same answer (first on ties, NaN largest), ~5x faster."""
    return _load().argmax_rows(logits.contiguous())
