"""A C++ paged decode-attention kernel for the CPU, compiled on first use.

Why: on the CPU a decode row's attention is bound by reading its KV, and the torch path reads
it three times (gather into a padded copy, write it, read it again in SDPA). This kernel walks
each row's block table and reads every cached K/V exactly once, with an online softmax, rows in
parallel on torch's thread pool (heads too when rows are fewer than threads). fp32 only; rows with query_len == 1.

It compiles with the machine's C++ compiler through torch.utils.cpp_extension the first time it
is used (about a minute) into the torch extensions cache; `available()` is False where that
fails, and the torch path is used instead.
"""
from __future__ import annotations

import os
import threading

import torch

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

// out[r, h*G + g, :] = softmax(q[r, h*G + g] . K[r, :, h]) V[r, :, h] over the row's seq_len positions,
// K/V read through block_table from caches laid out [num_blocks, block_size, Hkv, D].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_table, torch::Tensor seq_lens, double scale) {
    const int64_t R = q.size(0), Hq = q.size(1), D = q.size(2);
    const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2), G = Hq / Hkv;
    const int64_t MB = block_table.size(1);
    auto out = torch::empty_like(q);
    const float* qp = q.data_ptr<float>();
    const float* kp = k_cache.data_ptr<float>();
    const float* vp = v_cache.data_ptr<float>();
    const int32_t* bt = block_table.data_ptr<int32_t>();
    const int32_t* sl = seq_lens.data_ptr<int32_t>();
    float* op = out.data_ptr<float>();
    const float fscale = (float)scale;
    // One task is one row and all its heads, so a block's positions are read as one contiguous
    // [block_size, Hkv, D] run; a row is split across heads only when there are too few rows.
    const int64_t splits = R >= at::get_num_threads() ? 1 : Hkv;
    at::parallel_for(0, R * splits, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> acc(Hq * D), m(Hq), l(Hq), s(Hq * BS);
        for (int64_t task = begin; task < end; ++task) {
            const int64_t r = task / splits;
            const int64_t h0 = splits == 1 ? 0 : task % splits, h1 = splits == 1 ? Hkv : h0 + 1;
            const int64_t len = sl[r];
            const float* qrow = qp + r * Hq * D;
            std::fill(acc.begin(), acc.end(), 0.f);
            std::fill(m.begin(), m.end(), -1e30f);    // finite: the build assumes no infinities
            std::fill(l.begin(), l.end(), 0.f);
            for (int64_t start = 0; start < len; start += BS) {
                const int64_t block = bt[r * MB + start / BS];
                const int64_t n = std::min(BS, len - start);
                const float* kb = kp + block * BS * Hkv * D;
                const float* vb = vp + block * BS * Hkv * D;
                // scores of the block's positions for every query head (head q uses KV head q / G)
                for (int64_t j = 0; j < n; ++j) {
                    for (int64_t h = h0; h < h1; ++h) {
                        const float* k = kb + (j * Hkv + h) * D;
                        for (int64_t g = 0; g < G; ++g) {
                            const float* qh = qrow + (h * G + g) * D;
                            float dot = 0.f;
                            #pragma omp simd reduction(+:dot)
                            for (int64_t d = 0; d < D; ++d) dot += qh[d] * k[d];
                            s[(h * G + g) * BS + j] = dot * fscale;
                        }
                    }
                }
                // online softmax: rescale what was summed so far to the new running max
                for (int64_t q = h0 * G; q < h1 * G; ++q) {
                    float* sq = s.data() + q * BS;
                    float block_max = m[q];
                    for (int64_t j = 0; j < n; ++j) block_max = std::max(block_max, sq[j]);
                    const float correction = std::exp(m[q] - block_max);
                    float sum = 0.f;
                    #pragma omp simd reduction(+:sum)
                    for (int64_t j = 0; j < n; ++j) { sq[j] = std::exp(sq[j] - block_max); sum += sq[j]; }
                    l[q] = l[q] * correction + sum;
                    m[q] = block_max;
                    float* a = acc.data() + q * D;
                    #pragma omp simd
                    for (int64_t d = 0; d < D; ++d) a[d] *= correction;
                }
                for (int64_t j = 0; j < n; ++j) {
                    for (int64_t h = h0; h < h1; ++h) {
                        const float* v = vb + (j * Hkv + h) * D;
                        for (int64_t g = 0; g < G; ++g) {
                            const float p = s[(h * G + g) * BS + j];
                            float* a = acc.data() + (h * G + g) * D;
                            #pragma omp simd
                            for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
                        }
                    }
                }
            }
            for (int64_t q = h0 * G; q < h1 * G; ++q) {
                float* o = op + (r * Hq + q) * D;
                const float inv = l[q] > 0.f ? 1.f / l[q] : 0.f;
                for (int64_t d = 0; d < D; ++d) o[d] = acc[q * D + d] * inv;
            }
        }
    });
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode); }
"""

_lock = threading.Lock()
_module = None
_failed: str | None = None


def _load():
    global _module, _failed
    with _lock:
        if _module is None and _failed is None:
            try:
                from torch.utils.cpp_extension import load_inline
                _module = load_inline(
                    name="batchtop_paged_decode_v3", cpp_sources=[_SOURCE],
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                    extra_ldflags=["-fopenmp"], verbose=bool(os.environ.get("BATCHTOP_VERBOSE_BUILD")))
            except Exception as error:          # no compiler, no headers: the torch path serves
                _failed = f"{type(error).__name__}: {error}"
    return _module


def available() -> bool:
    if os.environ.get("BATCHTOP_CPU_KERNEL", "1") == "0":
        return False
    return _load() is not None


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention of `query` `[rows, Hq, D]` (one token per row) over each row's paged KV."""
    return _load().paged_decode(query.contiguous(), k_cache, v_cache, block_table.to(torch.int32).contiguous(),
                                seq_lens.to(torch.int32).contiguous(), float(scale))
