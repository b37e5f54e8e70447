// Matmuls that stream their weight (decode), and bf16 weights in tiles (bf16_linear, below).
//
// Weight-only quantized matmul for few rows (decode): y = x @ W.T with fp32 activations and
// int8 or 4-bit weights converted to fp32 in registers, so the weight bytes are read once at
// their stored size. At decode batch sizes a linear layer is bound by reading its weight
// (SmolLM2: 540 MB of fp32 weights per step against ~25 GB/s), which is what int8 (4x fewer
// bytes) and int4 (~6x) cut. The formats are those of pagedllm/layers/quantization.py:
//
//   int8: W[n, k] = scales[n] * q[n, k], q int8 [N, K] row-major, scales fp32 [N]; or grouped
//         (the LM head), W[n, k] = scales[n, k / 32] * q[n, k], scales fp32 [N, K / 32].
//   int4: W[n, k] = scales[n, g] * q[n, k] + mins[n, g] for g = k / 32, q in [0, 15] packed
//         [N, K / 2] uint8 with GGUF Q4_1's order inside each 32-weight group: byte i holds
//         weight i (low nibble) and weight i + 16 (high nibble); scales, mins fp32 [N, K / 32].
//
// The loop nest is a register tile of up to 4 rows of x by 4 output channels (16 accumulators),
// K stepped 16 (int8) or 32 (int4) at a time; each tile's weight rows stay in L1 while every
// row tile of x passes over them. Work is split over output channels with at::parallel_for.
// Results equal dequantize-then-matmul in fp32 up to summation order (the int4 weight is
// formed as fma(q, scale, min), exactly the reference's scale * q + min when rounded once).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>

#include "cpu_vec.h"
#include "ops.h"

namespace pagedllm {

constexpr int64_t kRowTile = 4;      // rows of x per register tile
constexpr int64_t kChannelTile = 4;  // output channels per register tile
constexpr int64_t kGroup = 32;       // int4 group size
// Software prefetch distance in channel tiles: DRAM latency x bandwidth is a few KB, more than
// the hardware prefetcher keeps in flight for these short rows (bench/quant_matmul.py).
constexpr int64_t kPrefetchTiles = 4;

void check_common(const at::Tensor& x, int64_t k, const std::optional<at::Tensor>& bias, int64_t n,
                  const char* op) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), op,
                    ": x must be a contiguous float32 [rows, in_features] tensor, got ", x.sizes(), " ",
                    x.scalar_type());
  TORCH_CHECK_VALUE(x.size(1) == k, op, ": x has ", x.size(1), " features, the weight ", k);
  TORCH_CHECK_VALUE(k % 32 == 0, op, ": in_features must be a multiple of 32, got ", k);
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n, op,
                      ": bias must be float32 [", n, "], got ", bias->sizes(), " ", bias->scalar_type());
  }
}

// The tiles below run on one vector width: 16 fp32 lanes with AVX-512, 8 with AVX2 + FMA
// (the x86-64-v3 build; same loops, K stepped 8 at a time).
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define PAGEDLLM_QUANT_TILES 1
#if defined(__AVX512F__)
using VecF = __m512;
constexpr int64_t kLanes = 16;
inline VecF vzero() { return _mm512_setzero_ps(); }
inline VecF vload(const float* p) { return _mm512_loadu_ps(p); }
inline VecF vset1(float v) { return _mm512_set1_ps(v); }
inline VecF vmul(VecF a, VecF b) { return _mm512_mul_ps(a, b); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(VecF a) { return _mm512_reduce_add_ps(a); }
// 16 int8 weights at p as fp32.
inline VecF int8_lanes(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#else
using VecF = __m256;
constexpr int64_t kLanes = 8;
inline VecF vzero() { return _mm256_setzero_ps(); }
inline VecF vload(const float* p) { return _mm256_loadu_ps(p); }
inline VecF vset1(float v) { return _mm256_set1_ps(v); }
inline VecF vmul(VecF a, VecF b) { return _mm256_mul_ps(a, b); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(VecF a) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}
// 8 int8 weights at p as fp32.
inline VecF int8_lanes(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

// acc[r][j] += x[r, k0:k0+kLanes] * w_j for every row r < R of the tile.
template <int R, int C>
inline void fma_tile(VecF (&acc)[kRowTile][kChannelTile], const float* x, int64_t k, int64_t k0,
                     const VecF (&w)[kChannelTile]) {
  VecF xr[kRowTile];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) xr[r] = vload(x + r * k + k0);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int j = 0; j < C; ++j) acc[r][j] = vfma(xr[r], w[j], acc[r][j]);
  }
}

// y[r, n0 + j] = scale_j * sum(acc[r][j]) + bias for the tile's R rows and C channels, with a
// scale and a bias as one std::fma: written as a multiply and an add, GCC contracted them into
// an FMA in some (R, C) instantiations and not in others, so a row's result depended on how
// many rows its call had (found by tests/test_preemption_invariance.py: int8 with biases).
template <int R, int C>
inline void store_tile(float* y, int64_t n, int64_t n0, const VecF (&acc)[kRowTile][kChannelTile],
                       const float* scales, const float* bias) {
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < C; ++j) {
      const float v = vsum(acc[r][j]);
      const float b = bias != nullptr ? bias[n0 + j] : 0.f;
      y[r * n + n0 + j] = scales != nullptr ? std::fma(v, scales[n0 + j], b) : v + b;
    }
  }
}

// Grouped: scales [N, K / 32], applied to each 32-weight group before the FMA; else scales [N],
// applied once to the sum.
template <int R, int C, bool Grouped>
void int8_tile(const float* x, const int8_t* q, const float* scales, const float* bias, float* y, int64_t k,
               int64_t n, int64_t n0) {
  const int64_t groups = k / kGroup;
  VecF acc[kRowTile][kChannelTile];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) acc[r][j] = vzero();
  for (int64_t k0 = 0; k0 < k; k0 += kLanes) {
    VecF w[kChannelTile];
#pragma GCC unroll 4
    for (int j = 0; j < C; ++j) {
      // A later channel tile's rows (prefetch never faults past the end).
      _mm_prefetch(reinterpret_cast<const char*>(q + (n0 + kPrefetchTiles * C + j) * k + k0), _MM_HINT_T0);
      w[j] = int8_lanes(q + (n0 + j) * k + k0);
      if constexpr (Grouped) w[j] = vmul(w[j], vset1(scales[(n0 + j) * groups + k0 / kGroup]));
    }
    fma_tile<R, C>(acc, x, k, k0, w);
  }
  store_tile<R, C>(y, n, n0, acc, Grouped ? nullptr : scales, bias);
}

template <int R, int C>
void int4_tile(const float* x, const uint8_t* q, const float* scales, const float* mins, const float* bias,
               float* y, int64_t k, int64_t n, int64_t n0) {
  const int64_t groups = k / kGroup;
  VecF acc[kRowTile][kChannelTile];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) acc[r][j] = vzero();
#if defined(__AVX512F__)
  const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 lo[kChannelTile], hi[kChannelTile];
#pragma GCC unroll 4
    for (int j = 0; j < C; ++j) {
      const int64_t row = n0 + j;
      _mm_prefetch(reinterpret_cast<const char*>(q + (row + kPrefetchTiles * C) * (k / 2) + g * (kGroup / 2)), _MM_HINT_T0);
      const __m512i bytes = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + row * (k / 2) + g * (kGroup / 2))));
      // The group's 16 possible weights, scale * code + min, as a lookup table: a permute by
      // the low 4 bits of each lane dequantizes 16 codes in one instruction (no int->float
      // conversions), with the same single rounding as fma(float(code), scale, min).
      const __m512 table = _mm512_fmadd_ps(codes, _mm512_set1_ps(scales[row * groups + g]),
                                           _mm512_set1_ps(mins[row * groups + g]));
      lo[j] = _mm512_permutexvar_ps(bytes, table);
      hi[j] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
    }
    fma_tile<R, C>(acc, x, k, g * kGroup, lo);
    fma_tile<R, C>(acc, x, k, g * kGroup + 16, hi);
  }
#else
  // 8 lanes: the group's 16 bytes in two halves of 8, each giving 8 low-nibble weights (inputs
  // h..h+7 of the group) and 8 high-nibble ones (inputs 16+h..); fma(code, scale, min) rounds
  // once, as the AVX-512 table does.
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t h = 0; h < kGroup / 2; h += kLanes) {
      VecF lo[kChannelTile], hi[kChannelTile];
#pragma GCC unroll 4
      for (int j = 0; j < C; ++j) {
        const int64_t row = n0 + j;
        const uint8_t* bytes_at = q + row * (k / 2) + g * (kGroup / 2) + h;
        _mm_prefetch(reinterpret_cast<const char*>(bytes_at + kPrefetchTiles * C * (k / 2)), _MM_HINT_T0);
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes_at)));
        const VecF scale = vset1(scales[row * groups + g]), min = vset1(mins[row * groups + g]);
        lo[j] = vfma(_mm256_cvtepi32_ps(_mm256_and_si256(bytes, low4)), scale, min);
        hi[j] = vfma(_mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4)), scale, min);
      }
      fma_tile<R, C>(acc, x, k, g * kGroup + h, lo);
      fma_tile<R, C>(acc, x, k, g * kGroup + 16 + h, hi);
    }
  }
#endif
  store_tile<R, C>(y, n, n0, acc, nullptr, bias);
}

// Runs tile(R, C, row0, n0) over every (row tile, channel tile), channels split across threads.
// With `one_channel_rows`, up to 4 rows take one channel per tile, so that each thread reads the
// weight rows in one sequential stream: for int8 on Zen 4 (SmolLM2's 120 layer matmuls, 106 MB
// of codes) 5.3-6.0 ms at one row against 7.6-7.8 for four interleaved channel rows, and 1.2 vs
// 1.5 ms for the grouped LM head; int4's rows (288 bytes) ran faster four at a time (4.7 vs
// 5.5-6.3 ms), so it keeps them.
template <typename Tile>
void for_each_tile(int64_t m, int64_t n, bool one_channel_rows, Tile&& tile) {
  if (one_channel_rows && m <= kRowTile) {
    at::parallel_for(0, n, 32, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) tile(std::integral_constant<int, 1>{}, m, 0, c);
    });
    return;
  }
  const int64_t channel_tiles = (n + kChannelTile - 1) / kChannelTile;
  at::parallel_for(0, channel_tiles, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kChannelTile;
      const bool full = n0 + kChannelTile <= n;
      for (int64_t row0 = 0; row0 < m; row0 += kRowTile) {
        const int64_t rows = std::min(kRowTile, m - row0);
        if (full) {
          tile(std::integral_constant<int, kChannelTile>{}, rows, row0, n0);
        } else {
          for (int64_t c = n0; c < n; ++c) tile(std::integral_constant<int, 1>{}, rows, row0, c);
        }
      }
    }
  });
}

// Calls f.template operator()<R>() with R = rows (1..4) as a compile-time constant.
#define PAGEDLLM_ROWS_DISPATCH(rows, C, CALL)      \
  switch (rows) {                                  \
    case 1: CALL(1, C); break;                     \
    case 2: CALL(2, C); break;                     \
    case 3: CALL(3, C); break;                     \
    default: CALL(4, C); break;                    \
  }
#endif  // PAGEDLLM_QUANT_TILES

// ---- bf16 weights in 32-channel tiles (layers/linear.py Linear.pack, bf16 compute) ----
//
// The weight [N, K] (N a multiple of 32) is stored as [N / 32, K / 2, 32, 2]: tile t holds
// channels 32t..32t+31 and, for each pair of inputs (2p, 2p+1), their 32 channels' two weights
// side by side. One 64-byte load gives 16 channels' pairs, and a tile is one sequential
// 64*K-byte stream (the prefetchers keep up with one stream per thread; four interleaved
// channel rows ran at about half the bandwidth, bench/README.md). The product is then a
// broadcast of x's pair against two vectors, accumulated per channel with no horizontal sums,
// for one row (decode) or 12 (prefill) alike: the pair-interleaved ("VNNI") layout that bf16
// dot-product instructions want. On AVX512_BF16 each pair is one VDPBF16PS; elsewhere (or with
// `portable`) both halves are widened to fp32 and multiplied by two FMAs, 16 lanes at a time
// with AVX-512 and 8 with AVX2 (CPUs without bf16 units keep bf16 weights at half the bytes).
constexpr int64_t kBf16Tile = 32;    // output channels per tile: two vectors of 16
constexpr int64_t kBf16MaxRows = 12; // rows of x per register tile: 24 accumulators
constexpr int64_t kBf16RowBlock = 120;  // rows whose x stays in L2 while the weights stream by

#if defined(__AVX512F__)
template <int R, bool Dp, typename TOut>
inline void bf16_rows(const c10::BFloat16* x, int64_t k, const c10::BFloat16* tile, TOut* y, int64_t n,
                      int64_t n0, const c10::BFloat16* bias) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int32_t* pairs = reinterpret_cast<const int32_t*>(x);  // x[r, 2p : 2p + 2] = pairs[r * k / 2 + p]
  const int64_t half = k / 2;
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t p = 0; p < half; ++p) {
    const __m512i w0 = _mm512_loadu_si512(tile + p * 2 * kBf16Tile);
    const __m512i w1 = _mm512_loadu_si512(tile + p * 2 * kBf16Tile + kBf16Tile);
#if defined(__AVX512BF16__)
    if constexpr (Dp) {
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        const __m512i xb = _mm512_set1_epi32(pairs[r * half + p]);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)xb, (__m512bh)w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)xb, (__m512bh)w1);
      }
      continue;
    }
#endif
    // bf16 -> fp32: a bf16 is the high half of its fp32; even inputs shifted up, odd masked.
    const __m512 w0e = _mm512_castsi512_ps(_mm512_slli_epi32(w0, 16));
    const __m512 w0o = _mm512_castsi512_ps(_mm512_and_si512(w0, high));
    const __m512 w1e = _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16));
    const __m512 w1o = _mm512_castsi512_ps(_mm512_and_si512(w1, high));
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512i xb = _mm512_set1_epi32(pairs[r * half + p]);
      const __m512 xe = _mm512_castsi512_ps(_mm512_slli_epi32(xb, 16));
      const __m512 xo = _mm512_castsi512_ps(_mm512_and_si512(xb, high));
      acc[r][0] = _mm512_fmadd_ps(xo, w0o, _mm512_fmadd_ps(xe, w0e, acc[r][0]));
      acc[r][1] = _mm512_fmadd_ps(xo, w1o, _mm512_fmadd_ps(xe, w1e, acc[r][1]));
    }
  }
  const int64_t live = std::min<int64_t>(kBf16Tile, n - n0);
  const __mmask16 lo = static_cast<__mmask16>(live >= 16 ? 0xFFFF : (1u << live) - 1);
  const __mmask16 hi = static_cast<__mmask16>(live >= 32 ? 0xFFFF : live <= 16 ? 0 : (1u << (live - 16)) - 1);
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (bias != nullptr) {
    b0 = pagedllm_vec::load16_masked(bias + n0, lo);
    b1 = pagedllm_vec::load16_masked(bias + n0 + 16, hi);
  }
  for (int r = 0; r < R; ++r) {
    pagedllm_vec::store16_masked(y + r * n + n0, _mm512_add_ps(acc[r][0], b0), lo);
    pagedllm_vec::store16_masked(y + r * n + n0 + 16, _mm512_add_ps(acc[r][1], b1), hi);
  }
}

template <bool Dp, typename TOut>
void bf16_tile_rows(const c10::BFloat16* x, int64_t rows, int64_t k, const c10::BFloat16* tile, TOut* y,
                    int64_t n, int64_t n0, const c10::BFloat16* bias) {
  int64_t r = 0;
  for (; r + kBf16MaxRows <= rows; r += kBf16MaxRows)
    bf16_rows<kBf16MaxRows, Dp>(x + r * k, k, tile, y + r * n, n, n0, bias);
  switch (rows - r) {
#define CASE(R) case R: bf16_rows<R, Dp>(x + r * k, k, tile, y + r * n, n, n0, bias); break;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11)
#undef CASE
    default: break;
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 (the x86-64-v3 build): the portable path above on 256-bit registers, a pair's 32
// channels in four vectors of 8, up to 2 rows at a time (8 accumulators): the same FMAs in the
// same order per channel, so the same bits as AVX-512's `portable` path.
constexpr int64_t kBf16Avx2Rows = 2;

template <int R, typename TOut>
inline void bf16_rows_avx2(const c10::BFloat16* x, int64_t k, const c10::BFloat16* tile, TOut* y, int64_t n,
                           int64_t n0, const c10::BFloat16* bias) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_setzero_ps();
  const int32_t* pairs = reinterpret_cast<const int32_t*>(x);  // x[r, 2p : 2p + 2] = pairs[r * k / 2 + p]
  const int64_t half = k / 2;
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t p = 0; p < half; ++p) {
    __m256 xe[R], xo[R];
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) {
      const __m256i xb = _mm256_set1_epi32(pairs[r * half + p]);
      xe[r] = _mm256_castsi256_ps(_mm256_slli_epi32(xb, 16));
      xo[r] = _mm256_castsi256_ps(_mm256_and_si256(xb, high));
    }
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + p * 2 * kBf16Tile + 16 * v));
      const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
      const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(w, high));
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) acc[r][v] = _mm256_fmadd_ps(xo[r], wo, _mm256_fmadd_ps(xe[r], we, acc[r][v]));
    }
  }
  const int64_t live = std::min<int64_t>(kBf16Tile, n - n0);
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[kBf16Tile];
    for (int v = 0; v < 4; ++v) _mm256_store_ps(out + 8 * v, acc[r][v]);
    for (int64_t c = 0; c < live; ++c) {
      y[r * n + n0 + c] = static_cast<TOut>(out[c] + (bias != nullptr ? static_cast<float>(bias[n0 + c]) : 0.f));
    }
  }
}

template <typename TOut>
void bf16_tile_rows_avx2(const c10::BFloat16* x, int64_t rows, int64_t k, const c10::BFloat16* tile, TOut* y,
                         int64_t n, int64_t n0, const c10::BFloat16* bias) {
  int64_t r = 0;
  for (; r + kBf16Avx2Rows <= rows; r += kBf16Avx2Rows)
    bf16_rows_avx2<kBf16Avx2Rows>(x + r * k, k, tile, y + r * n, n, n0, bias);
  if (r < rows) bf16_rows_avx2<1>(x + r * k, k, tile, y + r * n, n, n0, bias);
}
#endif  // __AVX512F__

// y [M, N] = x [M, K] bf16 @ W.T (+ bias [N] bf16), W in the tiled layout above
// (`weight` [N / 32, K / 2, 32, 2] bf16), accumulated in fp32 and rounded to bf16 once, as
// oneDNN's bf16 matmul, or handed over in fp32 with `fp32_out` (the LM head: bf16 logits have
// steps of 0.125 at SmolLM2's sizes, and near-equal ones became exact ties). `portable` forces
// the FMA path on a CPU with AVX512_BF16 (tests compare the two).
at::Tensor bf16_linear(const at::Tensor& x_in, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       bool portable, bool fp32_out) {
  TORCH_CHECK_VALUE(weight.dim() == 4 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
                        weight.size(2) == kBf16Tile && weight.size(3) == 2,
                    "bf16_linear: weight must be a contiguous bfloat16 [N / 32, K / 2, 32, 2] tensor, got ",
                    weight.sizes());
  const int64_t tiles = weight.size(0), k = weight.size(1) * 2, n = tiles * kBf16Tile;
  TORCH_CHECK_VALUE(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 && x_in.size(1) == k,
                    "bf16_linear: x must be bfloat16 [rows, ", k, "], got ", x_in.scalar_type(), " ", x_in.sizes());
  TORCH_CHECK_VALUE(!bias.has_value() || (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() &&
                                          bias->numel() == n),
                    "bf16_linear: bias must be bfloat16 [", n, "]");
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
  if (m == 0) return y;
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = weight.data_ptr<c10::BFloat16>();
  const c10::BFloat16* bp = bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr;
  auto run = [&](auto* yp) {
    // Each thread takes a contiguous run of tiles (one stream through memory) and, for each
    // block of rows, passes every tile of its run over them.
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t row0 = 0; row0 < m; row0 += kBf16RowBlock) {
        const int64_t rows = std::min(kBf16RowBlock, m - row0);
        for (int64_t t = begin; t < end; ++t) {
          const c10::BFloat16* tile = wp + t * kBf16Tile * k;
#if defined(__AVX512F__)
          if (portable) bf16_tile_rows<false>(xp + row0 * k, rows, k, tile, yp + row0 * n, n, t * kBf16Tile, bp);
          else bf16_tile_rows<true>(xp + row0 * k, rows, k, tile, yp + row0 * n, n, t * kBf16Tile, bp);
#elif defined(__AVX2__) && defined(__FMA__)
          (void)portable;
          bf16_tile_rows_avx2(xp + row0 * k, rows, k, tile, yp + row0 * n, n, t * kBf16Tile, bp);
#else
          (void)portable;
          for (int64_t r = row0; r < row0 + rows; ++r) {
            for (int64_t c = t * kBf16Tile; c < std::min(n, (t + 1) * kBf16Tile); ++c) {
              float sum = 0.f;
              for (int64_t i = 0; i < k; ++i) {
                sum += static_cast<float>(xp[r * k + i]) *
                       static_cast<float>(tile[(i / 2) * 2 * kBf16Tile + (c - t * kBf16Tile) * 2 + i % 2]);
              }
              using TOut = std::remove_pointer_t<decltype(yp)>;
              yp[r * n + c] = static_cast<TOut>(sum + (bp ? static_cast<float>(bp[c]) : 0.f));
            }
          }
#endif
        }
      }
    });
  };
  if (fp32_out) run(y.data_ptr<float>());
  else run(y.data_ptr<c10::BFloat16>());
  return y;
}

// fp32 weights in tiles (Linear.pack, fp32 compute): y [M, N] = x [M, K] @ W.T + bias, all
// fp32, W stored as [N / 32, K, 32] (tile t: channels 32t..32t+31, input i's 32 weights side
// by side; one sequential stream per tile, as bf16_linear's tiles). Every output is
// fma(x[r, K-1], W[c, K-1], ... fma(x[r, 0], W[c, 0], 0)) + bias[c], inputs in order, one
// rounding per FMA, whatever the row count, the rows beside it, the threads or the ISA
// (AVX-512 16 lanes, AVX2 8, std::fma otherwise): a row's result never depends on its batch,
// which torch's fp32 GEMM (MKL, oneDNN) does not promise.
constexpr int64_t kFp32Tile = 32;
constexpr int64_t kFp32RowBlock = 120;  // rows whose x stays in L2 while the weights stream by

#if defined(__AVX512F__)
constexpr int kFp32MaxRows = 12;  // 24 accumulators

template <int R>
inline void fp32_rows(const float* x, int64_t k, const float* tile, float* y, int64_t n, int64_t n0,
                      const float* bias) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const __m512 w0 = _mm512_loadu_ps(tile + i * kFp32Tile), w1 = _mm512_loadu_ps(tile + i * kFp32Tile + 16);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * k + i]);
      acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
  const __m512 b0 = bias != nullptr ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
  const __m512 b1 = bias != nullptr ? _mm512_loadu_ps(bias + n0 + 16) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(y + r * n + n0, _mm512_add_ps(acc[r][0], b0));
    _mm512_storeu_ps(y + r * n + n0 + 16, _mm512_add_ps(acc[r][1], b1));
  }
}

inline void fp32_tile_rows(const float* x, int64_t rows, int64_t k, const float* tile, float* y, int64_t n,
                           int64_t n0, const float* bias) {
  int64_t r = 0;
  for (; r + kFp32MaxRows <= rows; r += kFp32MaxRows) fp32_rows<kFp32MaxRows>(x + r * k, k, tile, y + r * n, n, n0, bias);
  switch (rows - r) {
#define CASE(R) case R: fp32_rows<R>(x + r * k, k, tile, y + r * n, n, n0, bias); break;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11)
#undef CASE
    default: break;
  }
}
// Two neighbouring tiles (64 channels) over up to 6 rows: 24 accumulators from 4 weight loads
// and 6 broadcasts per input, where one tile over 12 rows needs 2 loads and 12 broadcasts. At
// SmolLM2-1.7B's shapes on a Zen 4 (2 threads) 1.12-1.19x faster from 64 rows up, and then
// 1.01-1.08x oneDNN's speed, where one tile at a time ran at 0.84-0.94x it
// (bench/bf16_tiles_vs_onednn.py --dtype float32). A thread's odd last tile goes alone.
constexpr int kFp32PairRows = 6;

template <int R>
inline void fp32_pair_rows(const float* x, int64_t k, const float* tile, float* y, int64_t n, int64_t n0,
                           const float* bias) {
  const float* next = tile + kFp32Tile * k;
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const __m512 w0 = _mm512_loadu_ps(tile + i * kFp32Tile), w1 = _mm512_loadu_ps(tile + i * kFp32Tile + 16);
    const __m512 w2 = _mm512_loadu_ps(next + i * kFp32Tile), w3 = _mm512_loadu_ps(next + i * kFp32Tile + 16);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * k + i]);
      acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(xb, w2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(xb, w3, acc[r][3]);
    }
  }
  for (int v = 0; v < 4; ++v) {
    const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + n0 + 16 * v) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * n + n0 + 16 * v, _mm512_add_ps(acc[r][v], b));
  }
}

inline void fp32_pair_tile_rows(const float* x, int64_t rows, int64_t k, const float* tile, float* y, int64_t n,
                                int64_t n0, const float* bias) {
  int64_t r = 0;
  for (; r + kFp32PairRows <= rows; r += kFp32PairRows)
    fp32_pair_rows<kFp32PairRows>(x + r * k, k, tile, y + r * n, n, n0, bias);
  switch (rows - r) {
#define CASE(R) case R: fp32_pair_rows<R>(x + r * k, k, tile, y + r * n, n, n0, bias); break;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5)
#undef CASE
    default: break;
  }
}
#define PAGEDLLM_FP32_PAIRS 1
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kFp32MaxRows = 3;  // 12 accumulators of the 16 registers

template <int R>
inline void fp32_rows(const float* x, int64_t k, const float* tile, float* y, int64_t n, int64_t n0,
                      const float* bias) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    __m256 xb[R];
    for (int r = 0; r < R; ++r) xb[r] = _mm256_set1_ps(x[r * k + i]);
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      const __m256 w = _mm256_loadu_ps(tile + i * kFp32Tile + 8 * v);
      for (int r = 0; r < R; ++r) acc[r][v] = _mm256_fmadd_ps(xb[r], w, acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < 4; ++v) {
      const __m256 b = bias != nullptr ? _mm256_loadu_ps(bias + n0 + 8 * v) : _mm256_setzero_ps();
      _mm256_storeu_ps(y + r * n + n0 + 8 * v, _mm256_add_ps(acc[r][v], b));
    }
  }
}

inline void fp32_tile_rows(const float* x, int64_t rows, int64_t k, const float* tile, float* y, int64_t n,
                           int64_t n0, const float* bias) {
  int64_t r = 0;
  for (; r + kFp32MaxRows <= rows; r += kFp32MaxRows) fp32_rows<kFp32MaxRows>(x + r * k, k, tile, y + r * n, n, n0, bias);
  if (rows - r == 2) fp32_rows<2>(x + r * k, k, tile, y + r * n, n, n0, bias);
  if (rows - r == 1) fp32_rows<1>(x + r * k, k, tile, y + r * n, n, n0, bias);
}
#else
inline void fp32_tile_rows(const float* x, int64_t rows, int64_t k, const float* tile, float* y, int64_t n,
                           int64_t n0, const float* bias) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < kFp32Tile; ++c) {
      float sum = 0.f;
      for (int64_t i = 0; i < k; ++i) sum = std::fma(x[r * k + i], tile[i * kFp32Tile + c], sum);
      y[r * n + n0 + c] = sum + (bias != nullptr ? bias[n0 + c] : 0.f);
    }
  }
}
#endif

at::Tensor fp32_linear(const at::Tensor& x_in, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(weight.dim() == 3 && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                        weight.size(2) == kFp32Tile,
                    "fp32_linear: weight must be a contiguous float32 [N / 32, K, 32] tensor, got ",
                    weight.scalar_type(), " ", weight.sizes());
  const int64_t tiles = weight.size(0), k = weight.size(1), n = tiles * kFp32Tile;
  TORCH_CHECK_VALUE(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.size(1) == k,
                    "fp32_linear: x must be float32 [rows, ", k, "], got ", x_in.scalar_type(), " ", x_in.sizes());
  TORCH_CHECK_VALUE(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                                          bias->numel() == n),
                    "fp32_linear: bias must be float32 [", n, "]");
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row0 = 0; row0 < m; row0 += kFp32RowBlock) {
      const int64_t rows = std::min(kFp32RowBlock, m - row0);
      int64_t t = begin;
#if defined(PAGEDLLM_FP32_PAIRS)
      for (; t + 2 <= end; t += 2) {
        fp32_pair_tile_rows(xp + row0 * k, rows, k, wp + t * kFp32Tile * k, yp + row0 * n, n, t * kFp32Tile, bp);
      }
#endif
      for (; t < end; ++t) {
        fp32_tile_rows(xp + row0 * k, rows, k, wp + t * kFp32Tile * k, yp + row0 * n, n, t * kFp32Tile, bp);
      }
    }
  });
  return y;
}

const float* optional_ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<float>() : nullptr;
}

// y [M, N] fp32 = x [M, K] fp32 @ (scales * codes).T + bias, scales per channel [N] or per
// channel and 32-weight group [N, K / 32] (GGUF Q8_0's grouping).
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous(),
                    "int8_linear: codes must be a contiguous int8 [N, K] tensor");
  const int64_t m = x.size(0), n = codes.size(0), k = codes.size(1);
  check_common(x, k, bias, n, "int8_linear");
  const bool grouped = scales.dim() == 2;
  TORCH_CHECK_VALUE(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.size(0) == n &&
                        (scales.dim() == 1 || (grouped && scales.size(1) == k / kGroup)),
                    "int8_linear: scales must be float32 [", n, "] or [", n, ", ", k / kGroup, "], got ",
                    scales.sizes());
  at::Tensor y = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = codes.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* bp = optional_ptr(bias);
  float* yp = y.data_ptr<float>();
#if defined(PAGEDLLM_QUANT_TILES)
  for_each_tile(m, n, true, [&](auto channels, int64_t rows, int64_t row0, int64_t n0) {
    constexpr int C = decltype(channels)::value;
#define CALL(R, C)                                                                    \
  if (grouped) int8_tile<R, C, true>(xp + row0 * k, qp, sp, bp, yp + row0 * n, k, n, n0); \
  else int8_tile<R, C, false>(xp + row0 * k, qp, sp, bp, yp + row0 * n, k, n, n0)
    PAGEDLLM_ROWS_DISPATCH(rows, C, CALL)
#undef CALL
  });
#else
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t c = begin; c < end; ++c) {
        float sum = 0.f;
        for (int64_t i = 0; i < k; ++i) {
          const float scale = grouped ? sp[c * (k / kGroup) + i / kGroup] : 1.f;
          sum += xp[r * k + i] * (static_cast<float>(qp[c * k + i]) * scale);
        }
        yp[r * n + c] = (grouped ? sum : sum * sp[c]) + (bp ? bp[c] : 0.f);
      }
    }
  });
#endif
  return y;
}

// y [M, N] fp32 = x [M, K] fp32 @ W.T + bias, W = scales * q + mins per 32-weight group.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& mins, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
                    "int4_linear: packed must be a contiguous uint8 [N, K / 2] tensor");
  const int64_t m = x.size(0), n = packed.size(0), k = packed.size(1) * 2;
  check_common(x, k, bias, n, "int4_linear");
  for (const at::Tensor* t : {&scales, &mins}) {
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == n &&
                          t->size(1) == k / kGroup,
                      "int4_linear: scales and mins must be float32 [", n, ", ", k / kGroup, "], got ", t->sizes());
  }
  at::Tensor y = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* mp = mins.data_ptr<float>();
  const float* bp = optional_ptr(bias);
  float* yp = y.data_ptr<float>();
#if defined(PAGEDLLM_QUANT_TILES)
  for_each_tile(m, n, false, [&](auto channels, int64_t rows, int64_t row0, int64_t n0) {
    constexpr int C = decltype(channels)::value;
#define CALL(R, C) int4_tile<R, C>(xp + row0 * k, qp, sp, mp, bp, yp + row0 * n, k, n, n0)
    PAGEDLLM_ROWS_DISPATCH(rows, C, CALL)
#undef CALL
  });
#else
  const int64_t groups = k / kGroup;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t c = begin; c < end; ++c) {
        float sum = 0.f;
        for (int64_t i = 0; i < k; ++i) {
          const int64_t g = i / kGroup, j = i % kGroup;
          const uint8_t byte = qp[c * (k / 2) + g * (kGroup / 2) + j % 16];
          const int code = j < 16 ? (byte & 0x0F) : (byte >> 4);
          sum += xp[r * k + i] * (static_cast<float>(code) * sp[c * groups + g] + mp[c * groups + g]);
        }
        yp[r * n + c] = sum + (bp ? bp[c] : 0.f);
      }
    }
  });
#endif
  return y;
}

// The [N, K] fp32 weight of int8_linear / int4_linear, for batches too large for the kernels
// above (prefill chunks then run the fp32 GEMM on it). One pass, parallel over rows. int4 is
// computed as scale * code + min with two roundings, as gguf's and Int4Weight.dequantize do.
at::Tensor int8_dequantize(const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK_VALUE(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous(),
                    "int8_dequantize: codes must be a contiguous int8 [N, K] tensor");
  const int64_t n = codes.size(0), k = codes.size(1);
  const bool grouped = scales.dim() == 2;
  TORCH_CHECK_VALUE(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.size(0) == n &&
                        (scales.dim() == 1 || (grouped && k % kGroup == 0 && scales.size(1) == k / kGroup)),
                    "int8_dequantize: scales must be float32 [", n, "] or [", n, ", ", k / kGroup, "]");
  at::Tensor w = at::empty({n, k}, scales.options());
  const int8_t* qp = codes.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t run = grouped ? kGroup : k;  // weights sharing one scale
      for (int64_t i0 = 0; i0 < k; i0 += run) {
        const float scale = sp[grouped ? r * (k / kGroup) + i0 / kGroup : r];
        for (int64_t i = i0; i < i0 + run; ++i) wp[r * k + i] = static_cast<float>(qp[r * k + i]) * scale;
      }
    }
  });
  return w;
}

// No fused multiply-add here: the two roundings are what gguf computes.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
at::Tensor int4_dequantize(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins) {
  TORCH_CHECK_VALUE(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
                    "int4_dequantize: packed must be a contiguous uint8 [N, K / 2] tensor");
  const int64_t n = packed.size(0), k = packed.size(1) * 2, groups = k / kGroup;
  for (const at::Tensor* t : {&scales, &mins}) {
    TORCH_CHECK_VALUE(k % kGroup == 0 && t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                          t->size(0) == n && t->size(1) == groups,
                      "int4_dequantize: scales and mins must be float32 [", n, ", ", groups, "]");
  }
  at::Tensor w = at::empty({n, k}, scales.options());
  const uint8_t* qp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* mp = mins.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* bytes = qp + r * (k / 2) + g * (kGroup / 2);
        const float scale = sp[r * groups + g], min = mp[r * groups + g];
        float* out = wp + r * k + g * kGroup;
        for (int64_t i = 0; i < kGroup / 2; ++i) {
          out[i] = static_cast<float>(bytes[i] & 0x0F) * scale + min;
          out[i + kGroup / 2] = static_cast<float>(bytes[i] >> 4) * scale + min;
        }
      }
    }
  });
  return w;
}
#pragma GCC pop_options

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scales, Tensor? bias) -> Tensor", &pagedllm::int8_linear);
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales, Tensor mins, Tensor? bias) -> Tensor", &pagedllm::int4_linear);
  m.def("bf16_linear(Tensor x, Tensor weight, Tensor? bias, bool portable=False, bool fp32_out=False) -> Tensor",
        &pagedllm::bf16_linear);
  m.def("fp32_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", &pagedllm::fp32_linear);
  m.def("int8_dequantize(Tensor codes, Tensor scales) -> Tensor", &pagedllm::int8_dequantize);
  m.def("int4_dequantize(Tensor packed, Tensor scales, Tensor mins) -> Tensor", &pagedllm::int4_dequantize);
}
