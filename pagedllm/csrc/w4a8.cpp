// W4A8 linear layer: 4-bit weights (group-32 asymmetric, fp16 scale and min) times int8
// activations (per token and 32-input group, quantized on the fly), multiplied in integers by the
// CPU's u8 x s8 dot product. The arithmetic of llama.cpp's Q4_1 x Q8_1 dot (ggml-cpu
// quants.c, ggml_vec_dot_q4_1_q8_1): per group g of 32 inputs, with W = d[n, g] * c + m[n, g]
// (c in [0, 15]) and x ~= s[r, g] * q (q in [-127, 127]),
//
//   s[r, g]    = max |x[r, 32g : 32g + 32]| / 127 (1 for an all-zero group)
//   q[r, k]    = round_half_even(x[r, k] / s[r, g]), clamped to [-127, 127]
//   sum[r, g]  = s[r, g] * float(q[r, 32g] + ... + q[r, 32g + 31])   (the rounded inputs' sum)
//   dot        = sum_k c[n, k] * q[r, k] over the group   (int32, exact)
//   y[r, n]    = sum over g, in order, of  fma(m[n, g], sum[r, g], fma(float(dot), d[n, g] * s[r, g], .))
//                + bias[n], stored in x's dtype
//
// so y is W @ x' for x' = s * q, the activations rounded (Q8_1 stores the same sum). The min
// term must see the same rounded inputs as the scale term: d * c and m are each about as large
// as the group's range and cancel in W, so pairing the exact sum with the rounded products
// would scale the rounding error by |W - m| instead of |W| (twice the error, measured).
//
// Weight layout (pagedllm/layers/quantization.py, block_w4a8): [N / 16, K / 32, 320] bytes, for
// each tile of 16 output channels and each group: 256 bytes of codes, then the 16 channels'
// scales d and mins m as fp16 (32 bytes each). Code byte 64 j + 4 ch + i holds c[ch, 32g + 4j + i]
// in its low nibble and c[ch, 32g + 16 + 4j + i] in its high nibble: one 64-byte load masked
// (or shifted) gives 16 channels x 4 consecutive inputs as unsigned bytes, which VPDPBUSD
// multiplies by the 4 inputs' codes broadcast to every lane, summing into 16 per-channel int32
// lanes. So lanes are channels (no horizontal sums), a tile is one sequential stream of
// 0.625 bytes per weight, and the per-group scaling is two FMAs on 16 channels at once.
//
// The same op multiplies 8-bit weights (GGUF Q8_0: symmetric int8 codes c with an fp32 scale d
// per group of 32; pagedllm's LM head under w4a8 / w8a8) by the same Q8_1 activations: llama.cpp's
// Q8_0 x Q8_0 dot. Written as W = d * u + m with u = c + 128 in [1, 255] and m = -128 d (exact in
// fp32), it is the formula above with unsigned 8-bit codes, so VPDPBUSD takes them as they are.
// Layout [N / 16, K / 32, 576]: for each tile and group 512 code bytes, byte 64 j + 4 ch + i
// holding u[ch, 32g + 4j + i] (j = 0 .. 7), then the 16 channels' d as fp32 (64 bytes). The
// group size in bytes (320 or 576) tells the two layouts apart.
//
// Every row takes the same operations in the same order whatever the batch, so a row's result
// does not depend on the other rows (decode, prefill and mixed steps alike). Without
// AVX512_VNNI (or with `portable`) the dot product is VPMADDUBSW + VPMADDWD, whose int16 pair
// sums cannot saturate here (2 * 15 * 127 < 32767): the same int32 sums, so the same bits.
// Without AVX512BW the same on AVX2's 256-bit registers; without AVX2 a scalar loop.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_vec.h"
#include "ops.h"

namespace pagedllm {
namespace {

constexpr int64_t kTile = 16;          // output channels per tile
constexpr int64_t kGroup = 32;         // inputs per group
// Bytes per tile and group: 4-bit: 256 code bytes + 16 fp16 scales + 16 fp16 mins; 8-bit: 512 code
// bytes + 16 fp32 scales.
template <int Bits>
constexpr int64_t kGroupBytes = Bits == 4 ? 320 : 576;
constexpr int64_t kMaxRows = 8;        // rows per register block: 8 float + 8 int accumulators
constexpr int64_t kRowBlock = 128;     // rows whose activations stay in L2 while a thread's tiles pass
constexpr int64_t kParallelElements = 1 << 16;

inline float load_scalar(const float* p) { return *p; }
inline float load_scalar(const c10::BFloat16* p) { return static_cast<float>(*p); }

// One row's groups: q [K] int8, s [K / 32], sum [K / 32].
template <typename T>
void quantize_row(const T* x, int64_t k, int8_t* q, float* s, float* sum) {
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const T* xg = x + g * kGroup;
#if defined(__AVX512F__)
    const __m512 a = pagedllm_vec::load16(xg), b = pagedllm_vec::load16(xg + 16);
    const __m512 inf = _mm512_set1_ps(INFINITY);
    const bool finite = !(_mm512_cmp_ps_mask(_mm512_abs_ps(a), inf, _CMP_NLT_UQ) |
                          _mm512_cmp_ps_mask(_mm512_abs_ps(b), inf, _CMP_NLT_UQ));
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    // A NaN or infinite input makes the group's scale NaN, so the rows' outputs are NaN (as a
    // float matmul's would be) rather than finite values from clamped codes.
    const float scale = !finite ? NAN : amax > 0.f ? amax / 127.f : 1.f;
    const __m512 vs = _mm512_set1_ps(scale);
    const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
    const __m512 v0 = _mm512_roundscale_ps(_mm512_div_ps(a, vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 v1 = _mm512_roundscale_ps(_mm512_div_ps(b, vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * kGroup),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v0, lo), hi))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * kGroup + 16),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v1, lo), hi))));
#else
    float amax = 0.f;
    bool finite = true;
    for (int64_t i = 0; i < kGroup; ++i) {
      amax = std::max(amax, std::fabs(load_scalar(xg + i)));
      finite = finite && std::isfinite(load_scalar(xg + i));
    }
    const float scale = !finite ? NAN : amax > 0.f ? amax / 127.f : 1.f;
    for (int64_t i = 0; i < kGroup; ++i) {
      const float v = std::nearbyint(load_scalar(xg + i) / scale);
      q[g * kGroup + i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
    }
#endif
    int32_t codes = 0;
    for (int64_t i = 0; i < kGroup; ++i) codes += q[g * kGroup + i];
    s[g] = scale;
    sum[g] = scale * static_cast<float>(codes);
  }
}

#if defined(__AVX512BW__)
// y[r, n0 : n0 + 16] for R rows from one tile (`tile`: K / 32 groups of kGroupBytes).
template <int Bits, int R, bool Vnni, typename T>
inline void tile_rows(const int8_t* q, const float* s, const float* sum, int64_t k, const uint8_t* tile, T* y,
                      int64_t n, const float* bias) {
  const int64_t groups = k / kGroup;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i ones = _mm512_set1_epi16(1);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* p = tile + g * kGroupBytes<Bits>;
    const int8_t* qg = q + g * kGroup;
    // Rows interleaved in the inner loop (independent dependency chains side by side, only two
    // code vectors live); up to 4 rows, each row's sum also split in two chains.
    constexpr int kChains = R <= 4 ? 2 : 1;
    __m512i dot[R][kChains];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kChains; ++c) dot[r][c] = _mm512_setzero_si512();
    if constexpr (Bits == 4) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(p + 64 * j);
        const __m512i lo = _mm512_and_si512(v, low4);                       // inputs 4j .. 4j + 3
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);  // inputs 16 + 4j ..
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) {
          // The row's 4 input codes broadcast straight from memory.
          const __m512i x_lo = _mm512_broadcastd_epi32(_mm_loadu_si32(qg + r * k + 4 * j));
          const __m512i x_hi = _mm512_broadcastd_epi32(_mm_loadu_si32(qg + r * k + 16 + 4 * j));
#if defined(__AVX512VNNI__)
          if constexpr (Vnni) {
            dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], lo, x_lo);
            dot[r][kChains - 1] = _mm512_dpbusd_epi32(dot[r][kChains - 1], hi, x_hi);
            continue;
          }
#endif
          dot[r][0] = _mm512_add_epi32(dot[r][0], _mm512_madd_epi16(_mm512_maddubs_epi16(lo, x_lo), ones));
          dot[r][kChains - 1] =
              _mm512_add_epi32(dot[r][kChains - 1], _mm512_madd_epi16(_mm512_maddubs_epi16(hi, x_hi), ones));
        }
      }
    } else {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m512i v = _mm512_loadu_si512(p + 64 * j);  // 16 channels x inputs 4j .. 4j + 3
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) {
          const __m512i x = _mm512_broadcastd_epi32(_mm_loadu_si32(qg + r * k + 4 * j));
          const int c = kChains == 2 ? (j & 1) : 0;
#if defined(__AVX512VNNI__)
          if constexpr (Vnni) {
            dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], v, x);
            continue;
          }
#endif
          // u = 16 hi + lo: VPMADDUBSW's int16 pair sums of 255 x 127 would saturate, of
          // nibbles they cannot (2 * 15 * 127 < 32767).
          const __m512i lo = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_and_si512(v, low4), x), ones);
          const __m512i hi = _mm512_madd_epi16(
              _mm512_maddubs_epi16(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), x), ones);
          dot[r][c] = _mm512_add_epi32(dot[r][c], _mm512_add_epi32(lo, _mm512_slli_epi32(hi, 4)));
        }
      }
    }
    __m512 d, m;
    if constexpr (Bits == 4) {
      d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 256)));
      m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 288)));
    } else {
      d = _mm512_loadu_ps(reinterpret_cast<const float*>(p + 512));
      m = _mm512_mul_ps(d, _mm512_set1_ps(-128.f));
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i sum_r = kChains == 2 ? _mm512_add_epi32(dot[r][0], dot[r][kChains - 1]) : dot[r][0];
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum_r), _mm512_mul_ps(d, _mm512_set1_ps(s[r * groups + g])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sum[r * groups + g]), acc[r]);
    }
  }
  const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) pagedllm_vec::store16(y + r * n, _mm512_add_ps(acc[r], b));
}

template <int Bits, bool Vnni, typename T>
void tile_all_rows(const int8_t* q, const float* s, const float* sum, int64_t rows, int64_t k, const uint8_t* tile,
                   T* y, int64_t n, const float* bias) {
  const int64_t groups = k / kGroup;
  int64_t r = 0;
  for (; r + kMaxRows <= rows; r += kMaxRows)
    tile_rows<Bits, kMaxRows, Vnni>(q + r * k, s + r * groups, sum + r * groups, k, tile, y + r * n, n, bias);
  switch (rows - r) {
#define CASE(R) \
  case R: tile_rows<Bits, R, Vnni>(q + r * k, s + r * groups, sum + r * groups, k, tile, y + r * n, n, bias); break;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7)
#undef CASE
    default: break;
  }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2 (the x86-64-v3 build): the same VPMADDUBSW + VPMADDWD dot products and FMAs on the two
// 32-byte halves of each 64-byte step (channels 0-7 and 8-15), up to 4 rows at a time: the
// same int32 sums and the same fp32 roundings, lane for lane.
template <int Bits, int R, typename T>
inline void tile_rows_avx2(const int8_t* q, const float* s, const float* sum, int64_t k, const uint8_t* tile, T* y,
                           int64_t n, const float* bias) {
  const int64_t groups = k / kGroup;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  auto dot4 = [&](__m256i codes, __m256i x) { return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), ones); };
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* p = tile + g * kGroupBytes<Bits>;
    const int8_t* qg = q + g * kGroup;
    __m256i dot[R][2];
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    for (int j = 0; j < (Bits == 4 ? 4 : 8); ++j) {
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * j + 32 * h));
        const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m256i x = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(qg + r * k + 4 * j));
          if constexpr (Bits == 4) {
            // low nibbles: inputs 4j .. 4j + 3; high nibbles: inputs 16 + 4j ..
            const __m256i x_hi = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(qg + r * k + 16 + 4 * j));
            dot[r][h] = _mm256_add_epi32(dot[r][h], _mm256_add_epi32(dot4(lo, x), dot4(hi, x_hi)));
          } else {
            // u = 16 hi + lo (nibbles, so the int16 pair sums cannot saturate).
            dot[r][h] = _mm256_add_epi32(dot[r][h], _mm256_add_epi32(dot4(lo, x), _mm256_slli_epi32(dot4(hi, x), 4)));
          }
        }
      }
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m256 d, m;
      if constexpr (Bits == 4) {
        d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 256 + 16 * h)));
        m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 288 + 16 * h)));
      } else {
        d = _mm256_loadu_ps(reinterpret_cast<const float*>(p + 512 + 32 * h));
        m = _mm256_mul_ps(d, _mm256_set1_ps(-128.f));
      }
      for (int r = 0; r < R; ++r) {
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), _mm256_mul_ps(d, _mm256_set1_ps(s[r * groups + g])),
                                    acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(sum[r * groups + g]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[kTile];
    _mm256_store_ps(out, acc[r][0]);
    _mm256_store_ps(out + 8, acc[r][1]);
    for (int64_t ch = 0; ch < kTile; ++ch) y[r * n + ch] = static_cast<T>(out[ch] + (bias != nullptr ? bias[ch] : 0.f));
  }
}

template <int Bits, typename T>
void tile_all_rows_avx2(const int8_t* q, const float* s, const float* sum, int64_t rows, int64_t k,
                        const uint8_t* tile, T* y, int64_t n, const float* bias) {
  const int64_t groups = k / kGroup;
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4)
    tile_rows_avx2<Bits, 4>(q + r * k, s + r * groups, sum + r * groups, k, tile, y + r * n, n, bias);
  switch (rows - r) {
#define CASE(R) \
  case R: tile_rows_avx2<Bits, R>(q + r * k, s + r * groups, sum + r * groups, k, tile, y + r * n, n, bias); break;
    CASE(1) CASE(2) CASE(3)
#undef CASE
    default: break;
  }
}
#else
// The same formula one lane at a time (std::fma rounds as the vector FMA does).
template <int Bits, typename T>
void tile_all_rows_scalar(const int8_t* q, const float* s, const float* sum, int64_t rows, int64_t k,
                          const uint8_t* tile, T* y, int64_t n, const float* bias) {
  const int64_t groups = k / kGroup;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t ch = 0; ch < kTile; ++ch) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* p = tile + g * kGroupBytes<Bits>;
        int32_t dot = 0;
        float d, m;
        if constexpr (Bits == 4) {
          for (int64_t j = 0; j < 4; ++j) {
            for (int64_t i = 0; i < 4; ++i) {
              const uint8_t byte = p[64 * j + 4 * ch + i];
              dot += static_cast<int32_t>(byte & 0x0F) * q[r * k + g * kGroup + 4 * j + i];
              dot += static_cast<int32_t>(byte >> 4) * q[r * k + g * kGroup + 16 + 4 * j + i];
            }
          }
          c10::Half dh, mh;
          std::memcpy(&dh, p + 256 + 2 * ch, 2);
          std::memcpy(&mh, p + 288 + 2 * ch, 2);
          d = static_cast<float>(dh);
          m = static_cast<float>(mh);
        } else {
          for (int64_t j = 0; j < 8; ++j) {
            for (int64_t i = 0; i < 4; ++i) {
              dot += static_cast<int32_t>(p[64 * j + 4 * ch + i]) * q[r * k + g * kGroup + 4 * j + i];
            }
          }
          std::memcpy(&d, p + 512 + 4 * ch, 4);
          m = d * -128.f;
        }
        acc = std::fma(static_cast<float>(dot), d * s[r * groups + g], acc);
        acc = std::fma(m, sum[r * groups + g], acc);
      }
      y[r * n + ch] = static_cast<T>(acc + (bias != nullptr ? bias[ch] : 0.f));
    }
  }
}
#endif

template <int Bits, typename T>
at::Tensor w4a8_linear_impl(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            bool portable) {
  const int64_t m = x.size(0), k = x.size(1), tiles = weight.size(0), n = tiles * kTile, groups = k / kGroup;
  at::Tensor q = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor s = at::empty({m, groups}, x.options().dtype(at::kFloat));
  at::Tensor sum = at::empty({m, groups}, x.options().dtype(at::kFloat));
  const T* xp = x.data_ptr<T>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = s.data_ptr<float>();
  float* sump = sum.data_ptr<float>();
  at::parallel_for(0, m, std::max<int64_t>(1, kParallelElements / k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(xp + r * k, k, qp + r * k, sp + r * groups, sump + r * groups);
  });
  at::Tensor y = at::empty({m, n}, x.options());
  T* yp = y.data_ptr<T>();
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  // Each thread takes a contiguous run of tiles (one stream through memory) and, for each block
  // of rows, passes every tile of its run over them.
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row0 = 0; row0 < m; row0 += kRowBlock) {
      const int64_t rows = std::min(kRowBlock, m - row0);
      for (int64_t t = begin; t < end; ++t) {
        const uint8_t* tile = wp + t * groups * kGroupBytes<Bits>;
        const float* tile_bias = bp != nullptr ? bp + t * kTile : nullptr;
        T* out = yp + row0 * n + t * kTile;
#if defined(__AVX512BW__)
        if (portable) tile_all_rows<Bits, false>(qp + row0 * k, sp + row0 * groups, sump + row0 * groups, rows, k, tile, out, n, tile_bias);
        else tile_all_rows<Bits, true>(qp + row0 * k, sp + row0 * groups, sump + row0 * groups, rows, k, tile, out, n, tile_bias);
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
        (void)portable;
        tile_all_rows_avx2<Bits>(qp + row0 * k, sp + row0 * groups, sump + row0 * groups, rows, k, tile, out, n, tile_bias);
#else
        (void)portable;
        tile_all_rows_scalar<Bits>(qp + row0 * k, sp + row0 * groups, sump + row0 * groups, rows, k, tile, out, n, tile_bias);
#endif
      }
    }
  });
  return y;
}

}  // namespace

at::Tensor w4a8_linear(const at::Tensor& x_in, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       bool portable) {
  TORCH_CHECK_VALUE(weight.dim() == 3 && weight.scalar_type() == at::kByte && weight.is_contiguous() &&
                        (weight.size(2) == kGroupBytes<4> || weight.size(2) == kGroupBytes<8>),
                    "w4a8_linear: weight must be a contiguous uint8 [N / 16, K / 32, 320 or 576] tensor, got ",
                    weight.scalar_type(), " ", weight.sizes());
  const int64_t n = weight.size(0) * kTile, k = weight.size(1) * kGroup;
  TORCH_CHECK_VALUE(x_in.dim() == 2 && x_in.size(1) == k &&
                        (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
                    "w4a8_linear: x must be float32 or bfloat16 [M, ", k, "], got ", x_in.scalar_type(), " ",
                    x_in.sizes());
  TORCH_CHECK_VALUE(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                                          bias->dim() == 1 && bias->size(0) == n),
                    "w4a8_linear: bias must be float32 [", n, "]");
  const at::Tensor x = x_in.contiguous();
  if (x.size(0) == 0) return at::empty({0, n}, x.options());
  const bool eight = weight.size(2) == kGroupBytes<8>;
  if (x.scalar_type() == at::kFloat) {
    return eight ? w4a8_linear_impl<8, float>(x, weight, bias, portable)
                 : w4a8_linear_impl<4, float>(x, weight, bias, portable);
  }
  return eight ? w4a8_linear_impl<8, c10::BFloat16>(x, weight, bias, portable)
               : w4a8_linear_impl<4, c10::BFloat16>(x, weight, bias, portable);
}

// Rows `index` [T] int64 of an 8-bit tiled weight [N / 16, K / 32, 576] (Q8_0Linear.blocked), as
// [T, K] values (code - 128) * scale in fp32, returned in `dtype` (float32 or bfloat16): the token
// embedding tied to a Q8_0 LM head. Bitwise Q8_0Linear.rows's torch formula; one call instead of
// its ~12 ops (0.16 ms of a 4.5 ms single-stream step on the Zen 4 of bench/README.md).
at::Tensor q8_0_rows(const at::Tensor& weight, const at::Tensor& index, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(weight.dim() == 3 && weight.scalar_type() == at::kByte && weight.is_contiguous() &&
                        weight.size(2) == kGroupBytes<8>,
                    "q8_0_rows: weight must be a contiguous uint8 [N / 16, K / 32, 576] tensor");
  TORCH_CHECK_VALUE(index.dim() == 1 && index.scalar_type() == at::kLong, "q8_0_rows: index must be int64 [T]");
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16, "q8_0_rows: dtype must be float32 or bfloat16");
  const int64_t groups = weight.size(1), k = groups * kGroup, n = weight.size(0) * kTile, t = index.size(0);
  const at::Tensor ids = index.contiguous();
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK_VALUE(idp[i] >= 0 && idp[i] < n, "q8_0_rows: index ", idp[i], " is outside [0, ", n, ")");
  }
  at::Tensor out = at::empty({t, k}, weight.options().dtype(dtype));
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  auto fill = [&](auto* op) {
    at::parallel_for(0, t, std::max<int64_t>(1, kParallelElements / k), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t tile = idp[i] / kTile, ch = idp[i] % kTile;
        for (int64_t g = 0; g < groups; ++g) {
          // Group layout: byte 64 j + 4 ch + i is channel ch's code 4 j + i, stored + 128; the
          // channel's fp32 scale at byte 512 + 4 ch.
          const uint8_t* p = wp + (tile * groups + g) * kGroupBytes<8>;
          float scale;
          std::memcpy(&scale, p + 512 + 4 * ch, sizeof(scale));
          for (int64_t j = 0; j < 8; ++j) {
            for (int64_t c = 0; c < 4; ++c) {
              const float value = (static_cast<float>(p[64 * j + 4 * ch + c]) - 128.f) * scale;
              op[i * k + g * kGroup + 4 * j + c] = static_cast<std::remove_pointer_t<decltype(op)>>(value);
            }
          }
        }
      }
    });
  };
  if (dtype == at::kFloat) fill(out.data_ptr<float>());
  else fill(out.data_ptr<c10::BFloat16>());
  return out;
}

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("w4a8_linear(Tensor x, Tensor weight, Tensor? bias, bool portable=False) -> Tensor", &pagedllm::w4a8_linear);
  m.def("q8_0_rows(Tensor weight, Tensor index, ScalarType dtype) -> Tensor", &pagedllm::q8_0_rows);
}
