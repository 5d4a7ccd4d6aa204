#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>
#include <cstring>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define BATCHTOP_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

template <typename T>
static inline T* aligned64(void* p) {                 // the first 64-byte boundary at or after p
    return (T*)(((uintptr_t)p + 63) & ~(uintptr_t)63);
}

static inline void prefetch_floats(const float* p, int64_t n) {
    for (int64_t f = 0; f < n; f += 16) __builtin_prefetch(p + f);      // one 64-byte line per 16 floats
}

// out[r, h*G + g, :] = softmax(q[r, h*G + g] . K[r, :, h]) V[r, :, h] over the row's seq_len positions,
// K/V read through block_table from caches laid out [num_blocks, block_size, Hkv, D]. q may have a
// row stride (a view into the fused q/k/v projection); its heads and head dims are contiguous.
// HEAD_DIM is the head size when known at compile time (0: read it from q): with it fixed, the
// per-dimension loops unroll into whole vectors (64: 1.65x faster with the KV in cache, 1.2x from memory).
template <int64_t HEAD_DIM>
static torch::Tensor paged_decode_heads(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                        torch::Tensor block_table, torch::Tensor seq_lens, double scale) {
    const int64_t R = q.size(0), Hq = q.size(1), D = HEAD_DIM ? HEAD_DIM : q.size(2);
    const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2), G = Hq / Hkv;
    const int64_t MB = block_table.size(1);
    TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D, "q: [rows, heads, head_dim] with contiguous heads");
    const int64_t q_row_stride = q.stride(0);
    auto out = torch::empty({R, Hq, D}, q.options());
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
            const float* qrow = qp + r * q_row_stride;
            std::fill(acc.begin(), acc.end(), 0.f);
            std::fill(m.begin(), m.end(), -1e30f);    // finite: the build assumes no infinities
            std::fill(l.begin(), l.end(), 0.f);
            for (int64_t start = 0; start < len; start += BS) {
                const int64_t block = bt[r * MB + start / BS];
                const int64_t n = std::min(BS, len - start);
                const float* kb = kp + block * BS * Hkv * D;
                const float* vb = vp + block * BS * Hkv * D;
                // the row's next block is anywhere in the pool: fetch it while this one is computed
                // (measured here, 64 rows x 140 positions x 30 layers: 47 -> 34 ms)
                const int64_t position_floats = Hkv * D;
                const int64_t next = start + BS < len ? bt[r * MB + start / BS + 1] * BS * position_floats : -1;
                // scores of the block's positions for every query head (head q uses KV head q / G)
                for (int64_t j = 0; j < n; ++j) {
                    if (next >= 0) prefetch_floats(kp + next + j * position_floats, position_floats);
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
                    if (next >= 0) prefetch_floats(vp + next + j * position_floats, position_floats);
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

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_table, torch::Tensor seq_lens, double scale) {
    switch (q.size(2)) {
        case 64: return paged_decode_heads<64>(q, k_cache, v_cache, block_table, seq_lens, scale);
        case 128: return paged_decode_heads<128>(q, k_cache, v_cache, block_table, seq_lens, scale);
        default: return paged_decode_heads<0>(q, k_cache, v_cache, block_table, seq_lens, scale);
    }
}


// ---------------------------------------------------------------------------------------------
// out[M, N] = x[M, K] @ W[N, K]^T with W packed as panels [P, K, 48]: panel p holds output
// columns 48p .. 48p+47 (zero past N), one 192-byte run per k, so walking a panel is one
// contiguous stream. A micro-tile is up to 8 rows x 48 columns held in 24 vector registers; it
// reads the panel once and each x row's k-th value as a broadcast. Panels go to threads; the
// panel stays in L2 while the tiles of further rows reuse it. Software prefetches run ahead of
// the panel stream, far ahead into L2 and a little ahead from there into L1: without them the
// tile waits on memory at every k (8 rows 2x slower with none; 64 k into L2 plus 8 into L1 beat
// 16 k into L1 alone by ~10% at 4-8 rows). The tiles after a panel's first compute from L2 and
// leave memory idle, so they also fetch the thread's next panel into L2, a share of its lines
// each (32 rows: 45 -> 37 ms over the model's weights). Rows of a prompt step go in blocks whose
// x (1 MB) stays in L2 while the thread's panels stream past it (2048 rows: 8-15% faster at K=576,
// level at K=1536). Measurements: docs/kernels.md.
typedef float vec16 __attribute__((vector_size(64), aligned(4)));
constexpr int64_t PANEL = 48;
constexpr int64_t X_BLOCK_FLOATS = 1 << 18;
constexpr int64_t PREFETCH_L2_K = 64, PREFETCH_L1_K = 8;     // how many k ahead of the tile each prefetch runs
constexpr int64_t LINE_FLOATS = 16;
// Rows of a tile: its 3 x ROWS accumulators stay in registers (24 of AVX-512's 32). AVX2 has 16
// registers of half the width: its tiles (below) run a third of the panel at a time, 4 rows x 16
// columns in 8 registers. Elsewhere the compiler's loop, 2 rows.
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define BATCHTOP_AVX2_TILES 1
#endif
#if defined(__AVX512F__)
constexpr int64_t TILE_ROWS = 8;
#elif defined(BATCHTOP_AVX2_TILES)
constexpr int64_t TILE_ROWS = 4;
#else
constexpr int64_t TILE_ROWS = 2;
#endif

template <int ROWS>
static inline void store_tile(const vec16 (&acc)[ROWS][3], float* __restrict out, int64_t ldo, int64_t cols) {
    for (int m = 0; m < ROWS; ++m) {
        if (cols == PANEL) {
            for (int j = 0; j < 3; ++j) *(vec16*)(out + m * ldo + 16 * j) = acc[m][j];
        } else {                                   // the last panel of an N that is not a multiple of 48
            float tile[PANEL];
            for (int j = 0; j < 3; ++j) *(vec16*)(tile + 16 * j) = acc[m][j];
            for (int64_t c = 0; c < cols; ++c) out[m * ldo + c] = tile[c];
        }
    }
}

#ifndef BATCHTOP_AVX2_TILES
// `ahead` / `ahead_lines`: cache lines to fetch into L2 while this tile runs (of the next panel)
template <int ROWS>
static void gemm_tile(const float* __restrict x, int64_t K, const float* __restrict panel,
                      float* __restrict out, int64_t ldo, int64_t cols, const float* ahead, int64_t ahead_lines) {
    vec16 acc[ROWS][3];
    for (int m = 0; m < ROWS; ++m) acc[m][0] = acc[m][1] = acc[m][2] = vec16{};
    const int64_t ahead_per_k = (ahead_lines + K - 1) / K;
    for (int64_t k = 0; k < K; ++k) {
        for (int64_t i = k * ahead_per_k; i < std::min(ahead_lines, (k + 1) * ahead_per_k); ++i)
            __builtin_prefetch(ahead + LINE_FLOATS * i, 0, 2);          // prefetcht1: into L2, not L1
        const float* w = panel + k * PANEL;
        for (int64_t j = 0; j < PANEL; j += LINE_FLOATS) {
            __builtin_prefetch(w + PREFETCH_L2_K * PANEL + j, 0, 2);   // prefetcht1: far ahead, into L2
            __builtin_prefetch(w + PREFETCH_L1_K * PANEL + j);         // prefetcht0: from L2 into L1
        }
        const vec16 w0 = *(const vec16*)w, w1 = *(const vec16*)(w + 16), w2 = *(const vec16*)(w + 32);
        #pragma GCC unroll 8
        for (int m = 0; m < ROWS; ++m) {
            const float a = x[m * K + k];
            acc[m][0] += a * w0; acc[m][1] += a * w1; acc[m][2] += a * w2;
        }
    }
    store_tile<ROWS>(acc, out, ldo, cols);
}

#else
// The AVX2 tiles: a third of the panel (16 columns, two registers) at a time, so a tile of 4 rows keeps
// its 8 accumulators, the k's 2 weights and the row's broadcast in 11 of the 16 registers (the
// whole panel's 3 x 4 would spill on every k). x's rows are read three times, from L1; the panel's
// later thirds come from L1/L2, fetched by the first. Each output is one FMA a k in k order, in the
// block tiles as here, so block and fp32 panels give the same result bit for bit (tested). The last
// panel's columns are masked stores: a copy through a buffer made GCC keep the accumulators on the
// stack, stored on every k.
template <int ROWS>
__attribute__((always_inline)) static inline void store_third(const __m256 (&acc)[ROWS][2], float* __restrict out, int64_t ldo,
                                                              int64_t cols) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i low = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), lanes);
    const __m256i high = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols - 8), lanes);
    #pragma GCC unroll 8
    for (int m = 0; m < ROWS; ++m) {
        _mm256_maskstore_ps(out + m * ldo, low, acc[m][0]);
        _mm256_maskstore_ps(out + m * ldo + 8, high, acc[m][1]);
    }
}

template <int ROWS>
__attribute__((always_inline)) static inline void fma_rows(const float* __restrict x, int64_t K, int64_t k, __m256 w0, __m256 w1,
                            __m256 (&acc)[ROWS][2]) {
    __asm__("" : "+x"(w0), "+x"(w1));   // in registers: GCC would load them again as each FMA's operand
    #pragma GCC unroll 8
    for (int m = 0; m < ROWS; ++m) {
        const __m256 a = _mm256_broadcast_ss(x + m * K + k);
        acc[m][0] = _mm256_fmadd_ps(a, w0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(a, w1, acc[m][1]);
    }
}

template <int ROWS>
static void gemm_tile(const float* __restrict x, int64_t K, const float* __restrict panel,
                      float* __restrict out, int64_t ldo, int64_t cols, const float* ahead, int64_t ahead_lines) {
    const int64_t ahead_per_k = (ahead_lines + K - 1) / K;
    for (int64_t third = 0; third < 3 && 16 * third < cols; ++third) {
        __m256 acc[ROWS][2];
        for (int m = 0; m < ROWS; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; ++k) {
            const float* w = panel + k * PANEL;
            if (third == 0) {                // a panel is at most 3 lines a k, so is a later tile's share
                for (int64_t i = 0; i < 3; ++i)
                    if (i < ahead_per_k && k * ahead_per_k + i < ahead_lines)
                        __builtin_prefetch(ahead + LINE_FLOATS * (k * ahead_per_k + i), 0, 2);
                for (int64_t j = 0; j < PANEL; j += LINE_FLOATS)
                    __builtin_prefetch(w + PREFETCH_L2_K * PANEL + j, 0, 2);
            }
            fma_rows<ROWS>(x, K, k, _mm256_loadu_ps(w + 16 * third), _mm256_loadu_ps(w + 16 * third + 8), acc);
        }
        store_third<ROWS>(acc, out + 16 * third, ldo, cols - 16 * third);
    }
}
#endif

typedef void (*tile_fn)(const float*, int64_t, const float*, float*, int64_t, int64_t, const float*, int64_t);
static const tile_fn TILES[9] = {nullptr, gemm_tile<1>, gemm_tile<2>, gemm_tile<3>, gemm_tile<4>,
                                 gemm_tile<5>, gemm_tile<6>, gemm_tile<7>, gemm_tile<8>};

// A weight may instead be held as blocks, as a dequantised GGUF Q4_1 / Q8_0 weight is: int8 q
// panels [P, K, 48] and, per 32 k of each column, a scale and an offset ([P, K/32, 48] each):
// w = scale * q + offset. The scale is an fp16 value and |q| <= 127, so scale * q is exact in fp32
// and w is one rounding of the sum, the fp32 weight bit for bit where pack_linear found the weight
// in this form (kernels/cpu.py). A row block's first tile decodes each k's 48 weights in registers
// as it goes and, when further tiles follow, stores the decoded panel for them to read from L2.
// 1.25 bytes a weight instead of 4 (0.75 as nibbles): the decode steps that stream the weights get
// 2-3x faster (docs/kernels.md).
constexpr int64_t QBLOCK = 32;
constexpr int64_t PREFETCH_Q_K = 64;          // how many k ahead of the tile the block panel is fetched

#if defined(__AVX512F__) || defined(__AVX2__)
// 16 signed bytes to 16 floats: one instruction pair with AVX-512, two halves with AVX2 (AMD's CPUs
// before Zen 4 have no AVX-512; element by element the decode would cost 20x the product).
static inline vec16 bytes_to_vec16(__m128i bytes) {
#ifdef __AVX512F__
    return (vec16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
#else
    const __m256 halves[2] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)),
                              _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)))};
    vec16 v;
    std::memcpy(&v, halves, sizeof v);
    return v;
#endif
}
#endif

static inline vec16 decode16(const int8_t* q, vec16 scale, vec16 offset) {
#if defined(__AVX512F__) || defined(__AVX2__)
    return scale * bytes_to_vec16(_mm_loadu_si128((const __m128i*)q)) + offset;
#else
    vec16 v;
    for (int i = 0; i < 16; ++i) v[i] = q[i];
    return scale * v + offset;
#endif
}

// One k of a panel: 48 weights from int8 q (48 bytes) or, NIBBLES, from 4-bit q (24 bytes: byte j < 16
// holds column j low and column 16 + j high, byte 16 + j holds column 32 + j low and 40 + j high).
template <bool NIBBLES>
static inline void decode_k(const uint8_t* row, const vec16 (&d)[3], const vec16 (&o)[3], vec16 (&w)[3]) {
    if constexpr (!NIBBLES) {
        for (int j = 0; j < 3; ++j) w[j] = decode16((const int8_t*)row + 16 * j, d[j], o[j]);
    } else {
#if defined(__AVX512F__) || defined(__AVX2__)
        const __m128i low = _mm_set1_epi8(0x0F);
        const __m128i a = _mm_loadu_si128((const __m128i*)row), b = _mm_loadl_epi64((const __m128i*)(row + 16));
        const __m128i q[3] = {_mm_and_si128(a, low), _mm_and_si128(_mm_srli_epi16(a, 4), low),
                              _mm_unpacklo_epi64(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low))};
        for (int j = 0; j < 3; ++j) w[j] = d[j] * bytes_to_vec16(q[j]) + o[j];
#else
        for (int j = 0; j < 3; ++j) {
            vec16 v;
            for (int i = 0; i < 16; ++i) {
                const int column = 16 * j + i, byte = column < 32 ? column % 16 : 16 + column % 8;
                v[i] = (column < 32 ? column < 16 : column < 40) ? row[byte] & 15 : row[byte] >> 4;
            }
            w[j] = d[j] * v + o[j];
        }
#endif
    }
}

#ifndef BATCHTOP_AVX2_TILES
template <int ROWS, bool NIBBLES>
static void gemm_tile_blocks(const float* __restrict x, int64_t K, const uint8_t* __restrict q,
                             const float* __restrict scale, const float* __restrict offset,
                             float* __restrict out, int64_t ldo, int64_t cols, float* __restrict decoded) {
    constexpr int64_t ROW_BYTES = NIBBLES ? PANEL / 2 : PANEL;
    vec16 acc[ROWS][3];
    for (int m = 0; m < ROWS; ++m) acc[m][0] = acc[m][1] = acc[m][2] = vec16{};
    for (int64_t b = 0; b < K / QBLOCK; ++b) {
        vec16 d[3], o[3];
        for (int j = 0; j < 3; ++j) {
            d[j] = *(const vec16*)(scale + b * PANEL + 16 * j);
            o[j] = *(const vec16*)(offset + b * PANEL + 16 * j);
        }
        for (int64_t k = b * QBLOCK; k < (b + 1) * QBLOCK; ++k) {
            const uint8_t* row = q + k * ROW_BYTES;
            __builtin_prefetch(row + PREFETCH_Q_K * ROW_BYTES);      // 48 or 24 bytes a k: every line gets one
            vec16 w[3];
            decode_k<NIBBLES>(row, d, o, w);
            if (decoded)
                for (int j = 0; j < 3; ++j) *(vec16*)(decoded + k * PANEL + 16 * j) = w[j];
            #pragma GCC unroll 8
            for (int m = 0; m < ROWS; ++m) {
                const float a = x[m * K + k];
                acc[m][0] += a * w[0]; acc[m][1] += a * w[1]; acc[m][2] += a * w[2];
            }
        }
    }
    store_tile<ROWS>(acc, out, ldo, cols);
}

#else
// 8 q (int8, or 0..15 held one a byte) to floats, scaled and offset: the weights bit for bit.
static inline __m256 decode8(__m128i bytes, __m256 scale, __m256 offset) {
    return _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), offset);
}

// One k of a third of the panel: its 16 weights in two registers (the nibble layout above: thirds 0
// and 1 are the low and high halves of bytes 0-15, third 2 both halves of bytes 16-23).
template <bool NIBBLES>
__attribute__((always_inline)) static inline void decode_third(const uint8_t* row, int64_t third, const __m256 (&d)[2], const __m256 (&o)[2],
                                __m256& w0, __m256& w1) {
    __m128i q;
    if constexpr (!NIBBLES) {
        q = _mm_loadu_si128((const __m128i*)(row + 16 * third));
    } else {
        const __m128i low = _mm_set1_epi8(0x0F);
        if (third < 2) {
            q = _mm_loadu_si128((const __m128i*)row);
            q = _mm_and_si128(third ? _mm_srli_epi16(q, 4) : q, low);
        } else {
            const __m128i b = _mm_loadl_epi64((const __m128i*)(row + 16));
            q = _mm_unpacklo_epi64(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
        }
    }
    w0 = decode8(q, d[0], o[0]);
    w1 = decode8(_mm_srli_si128(q, 8), d[1], o[1]);
}

template <int ROWS, bool NIBBLES>
static void gemm_tile_blocks(const float* __restrict x, int64_t K, const uint8_t* __restrict q,
                             const float* __restrict scale, const float* __restrict offset,
                             float* __restrict out, int64_t ldo, int64_t cols, float* __restrict decoded) {
    constexpr int64_t ROW_BYTES = NIBBLES ? PANEL / 2 : PANEL;
    for (int64_t third = 0; third < 3 && 16 * third < cols; ++third) {
        __m256 acc[ROWS][2];
        for (int m = 0; m < ROWS; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
        for (int64_t b = 0; b < K / QBLOCK; ++b) {
            const float* sb = scale + b * PANEL + 16 * third;
            const float* ob = offset + b * PANEL + 16 * third;
            const __m256 d[2] = {_mm256_loadu_ps(sb), _mm256_loadu_ps(sb + 8)};
            const __m256 o[2] = {_mm256_loadu_ps(ob), _mm256_loadu_ps(ob + 8)};
            for (int64_t k = b * QBLOCK; k < (b + 1) * QBLOCK; ++k) {
                const uint8_t* row = q + k * ROW_BYTES;
                if (third == 0) __builtin_prefetch(row + PREFETCH_Q_K * ROW_BYTES);
                __m256 w0, w1;
                decode_third<NIBBLES>(row, third, d, o, w0, w1);
                if (decoded) {
                    _mm256_storeu_ps(decoded + k * PANEL + 16 * third, w0);
                    _mm256_storeu_ps(decoded + k * PANEL + 16 * third + 8, w1);
                }
                fma_rows<ROWS>(x, K, k, w0, w1, acc);
            }
        }
        store_third<ROWS>(acc, out + 16 * third, ldo, cols - 16 * third);
    }
}
#endif

// The same product on the AMX tile unit, for steps of many rows. A tile multiply takes bf16 pairs and
// sums their products in fp32; q (0..15 or |q| <= 127) is exact in bf16 and x is exactly the sum of
// three bf16 parts (8 + 8 + 8 significand bits), so each part's products are exact and
//     out[m, n] = sum over blocks b of  scale[b, n] * (q_b . x_b)  +  offset[b, n] * sum(x_b)
// is the GGUF weights' product with fp32 sums: not the FMA path's rounding order, its accuracy
// (tests: the error against float64 is no larger than the FMA path's). The scale changes every 32 k,
// one tile multiply's depth, so a 16-row x 16-column tile's C is stored after each block's 3 multiplies
// and added, scaled, into registers while the tile unit runs the next block's. The tile loads cost as
// much as the multiplies (a 16 x 16 x 32 unit's 3 multiplies: ~21 ns alone, ~38 ns with its 4 tile
// loads from L2, ~105 ns from L3), so a row block's x parts and a panel's tiles stay in L2.
// The whole model's products, one process: 32 rows 1.2x the FMA path, 64 1.3x, 256 1.35x, 2048 1.4x.
#ifdef BATCHTOP_AMX
constexpr int64_t AMX_X_BLOCK_BYTES = 1 << 20;  // x parts of a row block, kept in L2 while the panels pass

static bool amx_permitted() {                  // Linux hands out the tile state on request, once a process
    static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return granted;
}

struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
};

typedef uint32_t uvec16 __attribute__((vector_size(64), aligned(4)));

static inline uvec16 bf16_round(vec16 v) {     // to the nearest bf16 (ties to even), as fp32 bits
    const uvec16 bits = (uvec16)v;
    return (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000u;
}

// x [M, K] -> its three bf16 parts in A-tile order [row tile][block][part][16 rows][32 k] (rows past
// M are zero) and each row's sum over each block, [row tile][block][16].
static void split_x(const float* xp, int64_t M, int64_t K, uint16_t* parts, float* sums) {
    const int64_t blocks = K / QBLOCK;
    at::parallel_for(0, (M + 15) / 16, 1, [&](int64_t begin, int64_t end) {
        for (int64_t tile = begin; tile < end; ++tile)
            for (int64_t r = 0; r < 16; ++r) {
                const int64_t m = tile * 16 + r;
                for (int64_t b = 0; b < blocks; ++b) {
                    uint16_t* dst = parts + (tile * blocks + b) * 3 * 512 + r * 32;
                    vec16 sum = {};
                    for (int64_t half = 0; half < 2; ++half) {
                        const vec16 v = m < M ? *(const vec16*)(xp + m * K + b * QBLOCK + 16 * half) : vec16{};
                        sum += v;
                        const uvec16 p1 = bf16_round(v);
                        const vec16 rest = v - (vec16)p1;
                        const uvec16 p2 = bf16_round(rest);
                        const uvec16 p3 = (uvec16)(rest - (vec16)p2);          // 8 bits left: exact
                        for (int part = 0; part < 3; ++part) {
                            const uvec16 bits = part == 0 ? p1 : part == 1 ? p2 : p3;
                            _mm256_storeu_si256((__m256i*)(dst + part * 512 + 16 * half), _mm512_cvtepi32_epi16((__m512i)(bits >> 16)));
                        }
                    }
                    sums[(tile * blocks + b) * 16 + r] = _mm512_reduce_add_ps((__m512)sum);
                }
            }
    });
}

// A block panel's q -> bf16 B tiles [block][column tile][16 k pairs][16 columns][2 k]: each 32-bit
// lane holds one column's q at k (low half) and k + 1 (high half).
template <bool NIBBLES>
static void tile_panel(const uint8_t* q, int64_t K, uint32_t* out) {
    constexpr int64_t ROW_BYTES = NIBBLES ? PANEL / 2 : PANEL;
    const vec16 one[3] = {vec16{} + 1.f, vec16{} + 1.f, vec16{} + 1.f}, zero[3] = {};
    for (int64_t k = 0; k < K; k += 2) {
        vec16 even[3], odd[3];
        decode_k<NIBBLES>(q + k * ROW_BYTES, one, zero, even);          // q as floats: exact in bf16
        decode_k<NIBBLES>(q + (k + 1) * ROW_BYTES, one, zero, odd);
        for (int j = 0; j < 3; ++j)
            *(uvec16*)(out + ((k / QBLOCK * 3 + j) * 16 + k % QBLOCK / 2) * 16) = ((uvec16)even[j] >> 16) | (uvec16)odd[j];
    }
}

// GCC's tile intrinsics take literal tile numbers: C in tile c, A parts in 2-4, B in 7.
#define TILE_UNIT(c, a, b) do { \
    _tile_zero(c); _tile_loadd(7, (b), 64); \
    _tile_loadd(2, (a), 64); _tile_dpbf16ps(c, 2, 7); \
    _tile_loadd(3, (a) + 512, 64); _tile_dpbf16ps(c, 3, 7); \
    _tile_loadd(4, (a) + 1024, 64); _tile_dpbf16ps(c, 4, 7); } while (0)

static torch::Tensor amx_linear_blocks(const torch::Tensor& x, const uint8_t* qp, bool nibbles, const float* sp,
                                       const float* fp, int64_t N, int64_t P) {
    const int64_t M = x.size(0), K = x.size(1), blocks = K / QBLOCK, row_tiles = (M + 15) / 16;
    auto out = torch::empty({M, N}, x.options());
    auto parts_memory = torch::empty({row_tiles * blocks * 3 * 512 + 32}, x.options().dtype(torch::kShort));
    auto sums_memory = torch::empty({row_tiles * blocks * 16}, x.options());
    uint16_t* parts = aligned64<uint16_t>(parts_memory.data_ptr());
    const float* sums = sums_memory.data_ptr<float>();
    float* op = out.data_ptr<float>();
    split_x(x.data_ptr<float>(), M, K, parts, sums_memory.data_ptr<float>());
    const int64_t panel_bytes = K * (nibbles ? PANEL / 2 : PANEL), panel_tiles = blocks * 3 * 256;
    auto convert = [&](int64_t p, uint32_t* dst) { (nibbles ? tile_panel<true> : tile_panel<false>)(qp + p * panel_bytes, K, dst); };
    // One block of rows: each panel is converted just before its tiles run, into the thread's buffer
    // (in L2). More: every panel once, up front, rather than once a row block.
    const int64_t block_tiles = std::max<int64_t>(1, AMX_X_BLOCK_BYTES / (blocks * 3 * 1024));
    const bool up_front = row_tiles > block_tiles;
    auto tiles_memory = torch::empty({(up_front ? P : 0) * panel_tiles * 2 + 32}, x.options().dtype(torch::kShort));
    uint32_t* all_tiles = aligned64<uint32_t>(tiles_memory.data_ptr());
    if (up_front)
        at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
            for (int64_t p = begin; p < end; ++p) convert(p, all_tiles + p * panel_tiles);
        });
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
        TileConfig config;
        for (int t = 0; t < 8; ++t) { config.rows[t] = 16; config.bytes_per_row[t] = 64; }
        _tile_loadconfig(&config);
        std::vector<uint32_t> buffer(up_front ? 0 : panel_tiles + 16);
        uint32_t* own = aligned64<uint32_t>(buffer.data());
        alignas(64) float c[2][16][16];
        for (int64_t t0 = 0; t0 < row_tiles; t0 += block_tiles) {              // one block of rows ...
            for (int64_t p = begin; p < end; ++p) {                            // ... against each of the thread's panels
                const uint32_t* panel = up_front ? all_tiles + p * panel_tiles : own;
                if (!up_front) convert(p, own);
                // converting streams the q from memory: fetch the thread's next panel into L2 while this one multiplies
                const char* next = !up_front && p + 1 < end ? (const char*)(qp + (p + 1) * panel_bytes) : nullptr;
                const int64_t units = (std::min(row_tiles, t0 + block_tiles) - t0) * 3 * blocks;
                const int64_t lines_per_unit = (panel_bytes / 64 + units - 1) / units;
                int64_t unit = 0;
                const float* scale = sp + p * blocks * PANEL;
                const float* offset = fp + p * blocks * PANEL;
                const int64_t cols = std::min(PANEL, N - p * PANEL);
                for (int64_t tile = t0; tile < std::min(row_tiles, t0 + block_tiles); ++tile)
                    for (int64_t j = 0; j < 3 && 16 * j < cols; ++j) {
                        vec16 acc[16];
                        for (int r = 0; r < 16; ++r) acc[r] = vec16{};
                        auto add = [&](int64_t b) {                            // block b's C (in c[b % 2]), scaled, into acc
                            const vec16 s = *(const vec16*)(scale + b * PANEL + 16 * j), o = *(const vec16*)(offset + b * PANEL + 16 * j);
                            const float* row_sums = sums + (tile * blocks + b) * 16;
                            #pragma GCC unroll 16
                            for (int r = 0; r < 16; ++r) acc[r] += s * *(const vec16*)c[b & 1][r] + o * row_sums[r];
                        };
                        for (int64_t b = 0; b < blocks; ++b) {                 // block b multiplies while b - 1 is added
                            const uint16_t* a = parts + (tile * blocks + b) * 3 * 512;
                            const uint32_t* bt = panel + (b * 3 + j) * 256;
                            if (next)
                                for (int64_t line = unit * lines_per_unit; line < std::min(panel_bytes / 64, (unit + 1) * lines_per_unit); ++line)
                                    __builtin_prefetch(next + 64 * line, 0, 2);
                            ++unit;
                            if (b & 1) TILE_UNIT(1, a, bt); else TILE_UNIT(0, a, bt);
                            if (b > 0) {
                                if (b & 1) _tile_stored(0, c[0], 64); else _tile_stored(1, c[1], 64);
                                add(b - 1);
                            }
                        }
                        if ((blocks - 1) & 1) _tile_stored(1, c[1], 64); else _tile_stored(0, c[0], 64);
                        add(blocks - 1);
                        const int64_t width = std::min<int64_t>(16, cols - 16 * j);
                        for (int r = 0; r < 16 && tile * 16 + r < M; ++r) {
                            float* dst = op + (tile * 16 + r) * N + p * PANEL + 16 * j;
                            if (width == 16) *(vec16*)dst = acc[r];
                            else for (int64_t i = 0; i < width; ++i) dst[i] = acc[r][i];
                        }
                    }
            }
        }
        _tile_release();
    });
    return out;
}
#endif

bool amx_available() {
#ifdef BATCHTOP_AMX
    return amx_permitted();
#else
    return false;
#endif
}

typedef void (*block_tile_fn)(const float*, int64_t, const uint8_t*, const float*, const float*, float*, int64_t, int64_t, float*);
template <bool NIBBLES>
static const block_tile_fn BLOCK_TILES[9] = {nullptr, gemm_tile_blocks<1, NIBBLES>, gemm_tile_blocks<2, NIBBLES>,
                                             gemm_tile_blocks<3, NIBBLES>, gemm_tile_blocks<4, NIBBLES>,
                                             gemm_tile_blocks<5, NIBBLES>, gemm_tile_blocks<6, NIBBLES>,
                                             gemm_tile_blocks<7, NIBBLES>, gemm_tile_blocks<8, NIBBLES>};

// The tiles of out = x @ W^T, panels to threads, rows in blocks (above). `first_tile(p, t, decoded)`
// runs panel p's first tile of a row block and returns the fp32 panel the block's later tiles read
// (`decoded` is the thread's buffer for it); those tiles also fetch the thread's next panel into L2
// (`panel_bytes` at `panels + (p + 1) * panel_bytes`: fp32 or block panels), a share each.
template <typename FirstTile>
static void run_tiles(const float* xp, float* op, int64_t M, int64_t K, int64_t N, int64_t P,
                      const char* panels, int64_t panel_bytes, bool needs_buffer, FirstTile first_tile) {
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
        const int64_t tiles = (M + TILE_ROWS - 1) / TILE_ROWS, panel_lines = panel_bytes / 64;
        const int64_t block_tiles = std::max<int64_t>(1, X_BLOCK_FLOATS / (TILE_ROWS * K));
        std::vector<float> buffer(needs_buffer && tiles > 1 ? K * PANEL + LINE_FLOATS : 0);
        float* decoded = aligned64<float>(buffer.data());
        for (int64_t t0 = 0; t0 < tiles; t0 += block_tiles) {          // one block of rows ...
            const int64_t t1 = std::min(tiles, t0 + block_tiles);
            const int64_t share = t1 - t0 > 1 ? (panel_lines + t1 - t0 - 2) / (t1 - t0 - 1) : 0;   // lines per later tile
            for (int64_t p = begin; p < end; ++p) {                       // ... against each of the thread's panels
                const int64_t cols = std::min(PANEL, N - p * PANEL);
                const float* panel = first_tile(p, t0, cols, t1 - t0 > 1 ? decoded : nullptr);
                for (int64_t t = t0 + 1; t < t1; ++t) {
                    const int64_t first = (t - t0 - 1) * share;
                    const int64_t lines = p + 1 == end ? 0 : std::clamp(panel_lines - first, int64_t{0}, share);
                    const float* ahead = lines ? (const float*)(panels + (p + 1) * panel_bytes + 64 * first) : nullptr;
                    TILES[std::min<int64_t>(TILE_ROWS, M - TILE_ROWS * t)](xp + TILE_ROWS * t * K, K, panel, op + TILE_ROWS * t * N + p * PANEL, N,
                                                           cols, ahead, lines);
                }
            }
        }
    });
}

static void check_x(const torch::Tensor& x) {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat, "x: contiguous fp32 [M, K]");
}

torch::Tensor packed_linear(torch::Tensor x, torch::Tensor panels, int64_t N) {
    check_x(x);
    TORCH_CHECK(panels.dim() == 3 && panels.size(2) == PANEL && panels.size(1) == x.size(1), "panels: [P, K, 48]");
    const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
    TORCH_CHECK(N > (P - 1) * PANEL && N <= P * PANEL, "N does not match the panels");
    auto out = torch::empty({M, N}, x.options());
    const float* xp = x.data_ptr<float>();
    const float* wp = panels.data_ptr<float>();
    float* op = out.data_ptr<float>();
    run_tiles(xp, op, M, K, N, P, (const char*)wp, K * PANEL * 4, false,
              [&](int64_t p, int64_t t, int64_t cols, float*) {
                  const float* panel = wp + p * K * PANEL;
                  TILES[std::min<int64_t>(TILE_ROWS, M - TILE_ROWS * t)](xp + TILE_ROWS * t * K, K, panel, op + TILE_ROWS * t * N + p * PANEL, N, cols, nullptr, 0);
                  return panel;
              });
    return out;
}

// tile_rows: from this many rows the product runs on the AMX tile unit where there is one (0: never)
torch::Tensor packed_linear_blocks(torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor offset, int64_t N,
                                   int64_t tile_rows) {
    check_x(x);
    const bool nibbles = q.scalar_type() == torch::kByte;
    TORCH_CHECK(q.dim() == 3 && q.size(1) == x.size(1) && q.is_contiguous()
                && (nibbles ? q.size(2) == PANEL / 2 : q.scalar_type() == torch::kChar && q.size(2) == PANEL),
                "q panels: int8 [P, K, 48] or uint8 nibbles [P, K, 24]");
    const int64_t M = x.size(0), K = x.size(1), P = q.size(0);
    TORCH_CHECK(K % QBLOCK == 0 && scale.sizes() == torch::IntArrayRef({P, K / QBLOCK, PANEL}) && offset.sizes() == scale.sizes()
                && scale.scalar_type() == torch::kFloat && offset.scalar_type() == torch::kFloat && scale.is_contiguous()
                && offset.is_contiguous(), "scale, offset: fp32 [P, K/32, 48]");
    TORCH_CHECK(N > (P - 1) * PANEL && N <= P * PANEL, "N does not match the panels");
    const uint8_t* qp = (const uint8_t*)q.data_ptr();
    const float* sp = scale.data_ptr<float>();
    const float* fp = offset.data_ptr<float>();
#ifdef BATCHTOP_AMX
    if (tile_rows > 0 && M >= tile_rows && amx_permitted()) return amx_linear_blocks(x, qp, nibbles, sp, fp, N, P);
#endif
    auto out = torch::empty({M, N}, x.options());
    const float* xp = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t blocks = K / QBLOCK * PANEL, panel_bytes = K * q.size(2);
    const block_tile_fn* tiles = nibbles ? BLOCK_TILES<true> : BLOCK_TILES<false>;
    run_tiles(xp, op, M, K, N, P, (const char*)qp, panel_bytes, true,
              [&](int64_t p, int64_t t, int64_t cols, float* decoded) {
                  tiles[std::min<int64_t>(TILE_ROWS, M - TILE_ROWS * t)](xp + TILE_ROWS * t * K, K, qp + p * panel_bytes, sp + p * blocks,
                                                         fp + p * blocks, op + TILE_ROWS * t * N + p * PANEL, N, cols, decoded);
                  return (const float*)decoded;
              });
    return out;
}

// ---------------------------------------------------------------------------------------------
// The elementwise steps of a Llama layer, fused so a decode step pays one call each instead of
// transformers' several ops each. Same arithmetic as transformers' modules, in the same order.

// hidden += delta (when given), then weight * (hidden * rsqrt(mean(hidden^2) + eps)) -- LlamaRMSNorm.
torch::Tensor add_rms_norm(torch::Tensor hidden, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps) {
    TORCH_CHECK(hidden.is_contiguous() && hidden.dim() == 2, "hidden: contiguous [T, d]");
    const int64_t T = hidden.size(0), d = hidden.size(1);
    auto out = torch::empty_like(hidden);
    float* hp = hidden.data_ptr<float>();
    const float* dp = delta.has_value() ? delta->contiguous().data_ptr<float>() : nullptr;
    const float* wp = weight.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            float* h = hp + t * d;
            if (dp) {
                const float* dl = dp + t * d;
                #pragma omp simd
                for (int64_t i = 0; i < d; ++i) h[i] += dl[i];
            }
            float sum = 0.f;
            #pragma omp simd reduction(+:sum)
            for (int64_t i = 0; i < d; ++i) sum += h[i] * h[i];
            const float r = 1.f / std::sqrt(sum / d + (float)eps);
            float* o = op + t * d;
            #pragma omp simd
            for (int64_t i = 0; i < d; ++i) o[i] = wp[i] * (h[i] * r);
        }
    });
    return out;
}

// qkv [T, (Hq + 2 Hkv) * D]: rotate q in place and k by (cos, sin) [T, D] with rotate_half
// (x * cos + rotate_half(x) * sin), and store k and v at slot_mapping[t] of the caches
// [num_blocks, block_size, Hkv, D]. Returns q, a [T, Hq, D] view of qkv.
torch::Tensor rope_and_cache(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t Hq, int64_t Hkv,
                             torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping) {
    TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(), "contiguous inputs");
    const int64_t T = qkv.size(0), D = cos.size(1), half = D / 2, width = (Hq + 2 * Hkv) * D;
    TORCH_CHECK(qkv.size(1) == width, "qkv width is not (Hq + 2 Hkv) * D");
    float* qp = qkv.data_ptr<float>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    float* kc = k_cache.data_ptr<float>();
    float* vc = v_cache.data_ptr<float>();
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
        std::vector<float> buffer(D);
        float* __restrict rotated = buffer.data();          // restrict: the loops below vectorise
        for (int64_t t = begin; t < end; ++t) {
            const float* __restrict c = cp + t * D;
            const float* __restrict s = sp + t * D;
            float* row = qp + t * width;
            for (int64_t h = 0; h < Hq + Hkv; ++h) {
                const float* __restrict x = row + h * D;
                #pragma omp simd
                for (int64_t i = 0; i < half; ++i) {
                    rotated[i] = x[i] * c[i] - x[i + half] * s[i];
                    rotated[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
                }
                float* __restrict dest = h < Hq ? row + h * D : kc + (slots[t] * Hkv + (h - Hq)) * D;
                #pragma omp simd
                for (int64_t i = 0; i < D; ++i) dest[i] = rotated[i];
            }
            std::copy(row + (Hq + Hkv) * D, row + width, vc + slots[t] * Hkv * D);
        }
    });
    return qkv.narrow(1, 0, Hq * D).view({T, Hq, D});
}

// gate_up [T, 2I] -> silu(gate) * up [T, I]
torch::Tensor silu_mul(torch::Tensor gate_up) {
    TORCH_CHECK(gate_up.is_contiguous() && gate_up.dim() == 2, "gate_up: contiguous [T, 2I]");
    const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
    auto out = torch::empty({T, I}, gate_up.options());
    const float* gp = gate_up.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            const float* g = gp + t * 2 * I;
            const float* u = g + I;
            float* o = op + t * I;
            #pragma omp simd
            for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
        }
    });
    return out;
}

// logits [R, V] -> the index of each row's largest value, the first one on a tie; a NaN counts as
// the largest and -0.0 equals 0.0 (torch.argmax's rules). torch's argmax walks a row one value at
// a time (45 us for SmolLM2's 49152); this compares integer keys that order like the floats, in
// vectors, and is immune to -ffast-math (which would drop the NaN and infinity cases).
static inline int32_t order_key(int32_t bits) {
    const int32_t magnitude = bits & 0x7fffffff;
    return magnitude > 0x7f800000 ? INT32_MAX : magnitude == 0 ? 0 : bits >= 0 ? bits : bits ^ 0x7fffffff;
}

// While the rows are few (under 4 per thread) each row's vocabulary is split into slices, so that a
// step of 1 to 4 rows uses every thread as a wider one does: with whole rows as tasks, 1 to 4 rows
// ran on one thread (the engine's sample phase, tiny model: 26-79 us, against 21-53 us split).
// The slices' winners are compared in order, so a tie keeps the first index.
static constexpr int64_t MIN_ARGMAX_SLICE = 8192;

torch::Tensor argmax_rows(torch::Tensor logits) {
    TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == torch::kFloat
                && logits.size(1) > 0, "logits: contiguous fp32 [R, V], V > 0");
    const int64_t R = logits.size(0), V = logits.size(1);
    auto out = torch::empty({R}, logits.options().dtype(torch::kLong));
    const int32_t* lp = (const int32_t*)logits.data_ptr<float>();
    int64_t* op = out.data_ptr<int64_t>();
    const int64_t threads = at::get_num_threads();
    // rows x slices a multiple of the threads while the rows are few (3 rows on 2 threads: 6 tasks, not 2 + 1)
    const int64_t slices = R >= 4 * threads ? 1 : std::max<int64_t>(1, std::min(threads / std::gcd(R, threads),
                                                                                 V / MIN_ARGMAX_SLICE));
    std::vector<int32_t> best(R * slices);
    std::vector<int64_t> first(R * slices);
    at::parallel_for(0, R * slices, 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
            const int64_t r = task / slices, slice = task % slices;
            const int64_t lo = slice * V / slices, hi = (slice + 1) * V / slices;
            const int32_t* row = lp + r * V;
            int32_t key = INT32_MIN;
            #pragma omp simd reduction(max:key)
            for (int64_t i = lo; i < hi; ++i) key = std::max(key, order_key(row[i]));
            int64_t index = lo;
            while (order_key(row[index]) != key) ++index;
            best[task] = key;
            first[task] = index;
        }
    });
    for (int64_t r = 0; r < R; ++r) {
        int64_t winner = r * slices;
        for (int64_t task = winner + 1; task < (r + 1) * slices; ++task)
            if (best[task] > best[winner]) winner = task;      // strictly: a tie keeps the earlier slice
        op[r] = first[winner];
    }
    return out;
}

// The GIL is released while a kernel runs, as torch's own ops do, so the engine thread's compute
// does not stall the server's or the dashboard's Python.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    using no_gil = py::call_guard<py::gil_scoped_release>;
    m.def("paged_decode", &paged_decode, no_gil());
    m.def("packed_linear", &packed_linear, no_gil());
    m.def("packed_linear_blocks", &packed_linear_blocks, no_gil());
    m.def("amx_available", &amx_available);
    m.def("tile_rows", [] { return TILE_ROWS; });
    m.def("add_rms_norm", &add_rms_norm, no_gil());
    m.def("rope_and_cache", &rope_and_cache, no_gil());
    m.def("silu_mul", &silu_mul, no_gil());
    m.def("argmax_rows", &argmax_rows, no_gil());
}
