// W8A8 linear layer: int8 weights (per output channel) times int8 activations (per token,
// quantized on the fly), multiplied in integers by the CPU's u8 x s8 dot product. The scheme is
// SmoothQuant's (Xiao et al. 2023, "SmoothQuant", sections 3-4: per-token dynamic activation
// scales, per-channel weight scales, activation outliers migrated into the weights by a
// per-input-channel factor) and the arithmetic of vLLM's CPU int8 W8A8 path
// (csrc/cpu/dnnl_kernels.cpp: dynamic per-token symmetric int8).
//
//   v[m, k]  = x[m, k] * smooth_inv[k]                     (fp32)
//   s_x[m]   = max_k |v[m, k]| / 127 (1 for an all-zero row)
//   q_x[m,k] = round_half_even(v[m, k] / s_x[m]), clamped to [-127, 127]
//   acc      = q_x @ codes.T                               (int32, exact)
//   y[m, n]  = (float(acc[m, n]) * s_x[m]) * scales[n] + bias[n], stored in x's dtype
//
// The pure-torch twin (pagedllm/layers/quantization.py, w8a8_linear_torch) performs the same
// fp32 operations in the same order, with torch._int_mm for the product, so the two agree
// bitwise: the integer product is exact and every rounding happens in the same place. That
// needs each multiply and add rounded on its own, so this file is compiled without FMA
// contraction. A row's result does not depend on the other rows of the batch.
//
// Weight layout (W8A8Linear.codes, block_w8a8): [ceil(N / 16), ceil(K / 4), 64] uint8, for each
// tile of 16 output channels and each 4 inputs the 16 channels' 4 codes + 128: byte 4 ch + i of
// [t, j] is codes[16 t + ch, 4 j + i] + 128 (padding: 128, code 0). One 64-byte load is a tile's
// next 4 inputs as unsigned bytes, which VPDPBUSD multiplies by a row's 4 signed codes broadcast
// to every lane, summing into one int32 lane per channel: no horizontal sums, and a tile is one
// sequential stream. The + 128 comes back out as 128 * sum_k q[r, k] per row (exact).
//
// oneDNN's _int_mm, used here before, reorders an [N, K] weight on every call. With the weights
// out of cache, as every layer of a step finds them, the 120 matmuls of a 64-row SmolLM2 decode
// step took ~30 ms through it where the same products took ~18 ms from cache; this kernel,
// which reads each weight byte once per block of rows, is as fast as _int_mm from 2,048 rows
// down and faster below (bench/README.md). Without AVX512_VNNI (or with `portable`) the dot
// product is VPMADDUBSW + VPMADDWD on the weight's two nibbles, whose int16 pair sums cannot
// saturate (2 * 15 * 127 < 32767): the same int32 sums. Without AVX512BW, AVX2's VPMADDUBSW on
// the codes' magnitudes and signs (avx2_block); without AVX2 a scalar loop.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_vec.h"
#include "ops.h"

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace pagedllm {
namespace {

constexpr int64_t kParallelElements = 1 << 16;

inline float load_scalar(const float* p) { return *p; }
inline float load_scalar(const c10::BFloat16* p) { return static_cast<float>(*p); }
inline void store_scalar(float* p, float v) { *p = v; }
inline void store_scalar(c10::BFloat16* p, float v) { *p = c10::BFloat16(v); }

// One row: q [K] int8 and its scale, from x [K] and smooth_inv [K].
template <typename T>
float quantize_row(const T* x, const float* smooth_inv, int8_t* q, int64_t k) {
  float amax = 0.f;
  bool finite = true;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 vmax = _mm512_setzero_ps();
  __mmask16 nonfinite = 0;
  for (; i + 16 <= k; i += 16) {
    const __m512 v = _mm512_mul_ps(pagedllm_vec::load16(x + i), _mm512_loadu_ps(smooth_inv + i));
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
    nonfinite |= _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(INFINITY), _CMP_NLT_UQ);
  }
  amax = _mm512_reduce_max_ps(vmax);
  finite = nonfinite == 0;
#endif
  for (; i < k; ++i) {
    const float v = load_scalar(x + i) * smooth_inv[i];
    amax = std::max(amax, std::fabs(v));
    finite = finite && std::isfinite(v);
  }
  // A NaN or infinite input makes the row's scale NaN, so its outputs are NaN (as a float
  // matmul's would be) rather than finite values from clamped codes.
  const float scale = !finite ? NAN : amax > 0.f ? amax / 127.f : 1.f;
  i = 0;
#if defined(__AVX512F__)
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (; i + 16 <= k; i += 16) {
    __m512 v = _mm512_div_ps(_mm512_mul_ps(pagedllm_vec::load16(x + i), _mm512_loadu_ps(smooth_inv + i)), vscale);
    v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
  }
#endif
  for (; i < k; ++i) {
    const float v = std::nearbyint((load_scalar(x + i) * smooth_inv[i]) / scale);
    q[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
  }
  return scale;
}

constexpr int64_t kTile = 16;         // output channels per tile
constexpr int64_t kBlockRows = 8;     // rows per register block (x kBlockTiles int32 accumulators)
constexpr int64_t kBlockTiles = 2;    // tiles per register block
constexpr int64_t kRowBlock = 128;    // rows whose codes stay in L2 while a chunk of tiles passes
constexpr int64_t kChunkBytes = 256 << 10;  // a chunk's weights, in L2 beside the rows

#if defined(__AVX512BW__)
// y[r, 16 t : 16 t + 16] for R rows and TB tiles from `tile` on (`last`: the channels of tile
// TB - 1 that exist). q holds `steps` * 4 codes per row. The accumulators are locals of this
// function only, indexed by unrolled constants, so GCC keeps them in registers (passed by
// reference to a helper, it kept them on the stack).
template <int R, int TB, bool Vnni, typename T>
inline void blocked_block(const int8_t* q, const int32_t* qsum, const float* xs, int64_t steps, const uint8_t* tile,
                          const float* scales, const float* bias, __mmask16 last, T* y, int64_t n) {
  const int64_t kp = steps * 4, tile_bytes = kp * kTile;
  // With fewer than 4 accumulators one chain each would stall on VPDPBUSD's latency: then
  // the inputs alternate between two sets, added at the end (exact).
  constexpr int kChains = R * TB < 4 ? 2 : 1;
  __m512i acc[kChains][R][TB];
#pragma GCC unroll 2
  for (int c = 0; c < kChains; ++c)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int t = 0; t < TB; ++t) acc[c][r][t] = _mm512_setzero_si512();
  const __m512i low4 = _mm512_set1_epi8(0x0F), ones = _mm512_set1_epi16(1);
  for (int64_t j0 = 0; j0 < steps; j0 += kChains) {
#pragma GCC unroll 2
    for (int c = 0; c < kChains; ++c) {
      const int64_t j = j0 + c;
      if (kChains > 1 && j == steps) break;  // an odd number of steps
      __m512i w[TB];
#pragma GCC unroll 2
      for (int t = 0; t < TB; ++t) w[t] = _mm512_loadu_si512(tile + t * tile_bytes + j * 64);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512i x = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(q + r * kp + 4 * j));
#pragma GCC unroll 2
        for (int t = 0; t < TB; ++t) {
#if defined(__AVX512VNNI__)
          if constexpr (Vnni) {
            // Inline asm for an in-place accumulate: through the intrinsic GCC copied every
            // accumulator to another register and back on each VPDPBUSD.
            asm("vpdpbusd %2, %1, %0" : "+v"(acc[c][r][t]) : "v"(w[t]), "v"(x));
            continue;
          }
#endif
          const __m512i lo = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_and_si512(w[t], low4), x), ones);
          const __m512i hi =
              _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_and_si512(_mm512_srli_epi16(w[t], 4), low4), x), ones);
          acc[c][r][t] = _mm512_add_epi32(acc[c][r][t], _mm512_add_epi32(lo, _mm512_slli_epi32(hi, 4)));
        }
      }
    }
  }
#pragma GCC unroll 2
  for (int t = 0; t < TB; ++t) {
    const __mmask16 live = t == TB - 1 ? last : __mmask16(0xFFFF);
    const __m512 sc = pagedllm_vec::load16_masked(scales + t * kTile, live);
    const __m512 b = bias != nullptr ? pagedllm_vec::load16_masked(bias + t * kTile, live) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i sum = kChains == 2 ? _mm512_add_epi32(acc[0][r][t], acc[kChains - 1][r][t]) : acc[0][r][t];
      const __m512i exact = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * qsum[r]));
      __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(xs[r])), sc);
      if (bias != nullptr) v = _mm512_add_ps(v, b);
      pagedllm_vec::store16_masked(y + r * n + t * kTile, v, live);
    }
  }
}

// Rows [0, rows) times TB tiles from `tile` on: blocks of kBlockRows rows, then the rest.
template <int TB, bool Vnni, typename T>
void blocked_rows(const int8_t* q, const int32_t* qsum, const float* xs, int64_t rows, int64_t steps,
                  const uint8_t* tile, const float* scales, const float* bias, __mmask16 last, T* y, int64_t n) {
  const int64_t kp = steps * 4;
  int64_t r = 0;
  for (; r + kBlockRows <= rows; r += kBlockRows)
    blocked_block<kBlockRows, TB, Vnni>(q + r * kp, qsum + r, xs + r, steps, tile, scales, bias, last, y + r * n, n);
  switch (rows - r) {
#define CASE(R)                                                                                                 \
  case R:                                                                                                       \
    blocked_block<R, TB, Vnni>(q + r * kp, qsum + r, xs + r, steps, tile, scales, bias, last, y + r * n, n); \
    break;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7)
#undef CASE
    default: break;
  }
}
#elif defined(__AVX2__)
// AVX2 (the x86-64-v3 build): llama.cpp's AVX2 int8 dot product on the two 32-byte halves of a
// tile's 64-byte step (channels 0-7 and 8-15), R <= 4 rows at a time (8 accumulators of the 16
// vector registers). The codes come back to signed (XOR 0x80); VPMADDUBSW multiplies their
// magnitudes (unsigned) by the row's codes with the weight's sign (VPSIGNB), whose int16 pair
// sums cannot saturate (2 * 127 * 127 < 32767), so each int32 sum is exact and no 128 * qsum
// correction is needed: the same sums as the AVX-512 paths, the same fp32 epilogue. Against the
// nibble split the AVX-512 portable path uses, 4 instructions per row and half-tile instead of 10.
template <int R, typename T>
inline void avx2_block(const int8_t* q, const float* xs, int64_t steps, const uint8_t* tile,
                       const float* scales, const float* bias, int64_t live, T* y, int64_t n) {
  const int64_t kp = steps * 4;
  __m256i acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  for (int64_t j = 0; j < steps; ++j) {
    __m256i w[2], magnitude[2];
    for (int h = 0; h < 2; ++h) {
      w[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + j * 64 + 32 * h)), flip);
      magnitude[h] = _mm256_abs_epi8(w[h]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(q + r * kp + 4 * j));
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i pairs = _mm256_maddubs_epi16(magnitude[h], _mm256_sign_epi8(x, w[h]));
        acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) int32_t sums[kTile];
    _mm256_store_si256(reinterpret_cast<__m256i*>(sums), acc[r][0]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(sums + 8), acc[r][1]);
    for (int64_t ch = 0; ch < live; ++ch) {
      float v = (static_cast<float>(sums[ch]) * xs[r]) * scales[ch];
      if (bias != nullptr) v = v + bias[ch];
      store_scalar(y + r * n + ch, v);
    }
  }
}
#endif

// y [m, n] = the formula above for q [m, steps * 4] (zero-padded rows) and the blocked weight w.
// Threads take contiguous runs of tile pairs; a run is cut into chunks, and each chunk passes
// over every block of kRowBlock rows.
template <typename T>
void blocked_linear(const int8_t* q, const int32_t* qsum, const float* xs, int64_t m, int64_t steps,
                    const uint8_t* w, int64_t n, const float* scales, const float* bias, T* y, bool portable) {
  const int64_t tiles = (n + kTile - 1) / kTile, kp = steps * 4, tile_bytes = kp * kTile;
  const int64_t pairs = (tiles + kBlockTiles - 1) / kBlockTiles;
  const int64_t chunk_pairs = std::max<int64_t>(1, kChunkBytes / (kBlockTiles * tile_bytes));
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = begin; chunk < end; chunk += chunk_pairs) {
      for (int64_t row0 = 0; row0 < m; row0 += kRowBlock) {
        const int64_t rows = std::min(kRowBlock, m - row0);
        for (int64_t p = chunk; p < std::min(end, chunk + chunk_pairs); ++p) {
          const int64_t t = p * kBlockTiles, count = std::min(kBlockTiles, tiles - t);
          const int64_t live = std::min<int64_t>(kTile, n - (t + count - 1) * kTile);  // in the last tile
          const uint8_t* tile = w + t * tile_bytes;
          const float* sc = scales + t * kTile;
          const float* b = bias != nullptr ? bias + t * kTile : nullptr;
          T* out = y + row0 * n + t * kTile;
          const int8_t* qr = q + row0 * kp;
#if defined(__AVX512BW__)
          const __mmask16 last = static_cast<__mmask16>((1u << live) - 1);
          if (count == 2) {
            if (portable) blocked_rows<2, false>(qr, qsum + row0, xs + row0, rows, steps, tile, sc, b, last, out, n);
            else blocked_rows<2, true>(qr, qsum + row0, xs + row0, rows, steps, tile, sc, b, last, out, n);
          } else {
            if (portable) blocked_rows<1, false>(qr, qsum + row0, xs + row0, rows, steps, tile, sc, b, last, out, n);
            else blocked_rows<1, true>(qr, qsum + row0, xs + row0, rows, steps, tile, sc, b, last, out, n);
          }
#elif defined(__AVX2__)
          (void)portable;
          for (int64_t i = 0; i < count; ++i) {
            const int64_t channels = i == count - 1 ? live : kTile;
            const uint8_t* wt = tile + i * tile_bytes;
            const float* bi = b != nullptr ? b + i * kTile : nullptr;
            int64_t r = 0;
            for (; r + 4 <= rows; r += 4)
              avx2_block<4>(qr + r * kp, xs + row0 + r, steps, wt, sc + i * kTile, bi, channels,
                            out + r * n + i * kTile, n);
            switch (rows - r) {
#define CASE(R)                                                                                                 \
  case R:                                                                                                       \
    avx2_block<R>(qr + r * kp, xs + row0 + r, steps, wt, sc + i * kTile, bi, channels,                       \
                  out + r * n + i * kTile, n);                                                                  \
    break;
              CASE(1) CASE(2) CASE(3)
#undef CASE
              default: break;
            }
          }
#else
          (void)portable;
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t ch = 0; ch < (count - 1) * kTile + live; ++ch) {
              const uint8_t* wt = tile + (ch / kTile) * tile_bytes + (ch % kTile) * 4;
              int32_t sum = 0;
              for (int64_t i = 0; i < kp; ++i) sum += static_cast<int32_t>(wt[(i / 4) * 64 + i % 4]) * qr[r * kp + i];
              sum -= 128 * qsum[row0 + r];
              float v = (static_cast<float>(sum) * xs[row0 + r]) * sc[ch];
              if (b != nullptr) v = v + b[ch];
              store_scalar(out + r * n + ch, v);
            }
          }
#endif
        }
      }
    }
  });
}

template <typename T>
at::Tensor w8a8_linear_impl(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                            const at::Tensor& smooth_inv, const std::optional<at::Tensor>& bias, bool portable) {
  const int64_t m = x.size(0), k = x.size(1), n = scales.size(0), steps = codes.size(1), kp = steps * 4;
  at::Tensor q = at::empty({m, kp}, x.options().dtype(at::kChar));
  at::Tensor x_scales = at::empty({m}, x.options().dtype(at::kFloat));
  at::Tensor q_sums = at::empty({m}, x.options().dtype(at::kInt));
  const T* xp = x.data_ptr<T>();
  const float* sp = smooth_inv.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* xsp = x_scales.data_ptr<float>();
  int32_t* qsp = q_sums.data_ptr<int32_t>();
  // Grains of about 64K elements: below that a parallel region costs more than it saves.
  at::parallel_for(0, m, std::max<int64_t>(1, kParallelElements / k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int8_t* row = qp + r * kp;
      xsp[r] = quantize_row(xp + r * k, sp, row, k);
      std::fill(row + k, row + kp, int8_t{0});
      int32_t sum = 0;
      for (int64_t i = 0; i < k; ++i) sum += row[i];
      qsp[r] = sum;
    }
  });
  at::Tensor y = at::empty({m, n}, x.options());
  blocked_linear(qp, qsp, xsp, m, steps, codes.data_ptr<uint8_t>(), n, scales.data_ptr<float>(),
                 bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr<T>(), portable);
  return y;
}

}  // namespace

at::Tensor w8a8_linear(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& smooth_inv, const std::optional<at::Tensor>& bias, bool portable) {
  TORCH_CHECK_VALUE(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 1,
                    "w8a8_linear: scales must be float32 [N], got ", scales.scalar_type(), " ", scales.sizes());
  const int64_t n = scales.size(0);
  TORCH_CHECK_VALUE(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
                    "w8a8_linear: x must be float32 or bfloat16 [M, K], got ", x_in.scalar_type(), " ", x_in.sizes());
  const int64_t k = x_in.size(1);
  TORCH_CHECK_VALUE(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                        codes.size(0) == (n + kTile - 1) / kTile && codes.size(1) == (k + 3) / 4 && codes.size(2) == 64,
                    "w8a8_linear: codes must be a contiguous uint8 [", (n + kTile - 1) / kTile, ", ", (k + 3) / 4,
                    ", 64] tensor (block_w8a8 of an [N, K] = [", n, ", ", k, "] weight), got ", codes.scalar_type(),
                    " ", codes.sizes());
  TORCH_CHECK_VALUE(smooth_inv.scalar_type() == at::kFloat && smooth_inv.is_contiguous() && smooth_inv.dim() == 2 &&
                        smooth_inv.size(0) == 1 && smooth_inv.size(1) == k,
                    "w8a8_linear: smooth_inv must be float32 [1, ", k, "], got ", smooth_inv.sizes());
  TORCH_CHECK_VALUE(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                                          bias->dim() == 1 && bias->size(0) == n),
                    "w8a8_linear: bias must be float32 [", n, "]");
  const at::Tensor x = x_in.contiguous();
  if (x.size(0) == 0) return at::empty({0, n}, x.options());
  return x.scalar_type() == at::kFloat ? w8a8_linear_impl<float>(x, codes, scales, smooth_inv, bias, portable)
                                       : w8a8_linear_impl<c10::BFloat16>(x, codes, scales, smooth_inv, bias, portable);
}

}  // namespace pagedllm

#pragma GCC pop_options

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("w8a8_linear(Tensor x, Tensor codes, Tensor scales, Tensor smooth_inv, Tensor? bias, bool portable=False) -> Tensor",
        &pagedllm::w8a8_linear);
}
