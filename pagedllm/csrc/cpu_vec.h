// Vector helpers shared by the CPU ops: AVX-512 ones where the build has AVX-512F, AVX2 + FMA
// ones (8 fp32 lanes) in the x86-64-v3 build.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace pagedllm_vec {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const int8_t* p) {  // int8 KV cache codes, widened exactly
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// 16 floats rounded to bfloat16 bits, nearest even, NaN -> 0x7FC0: c10::BFloat16(float)'s
// rounding (c10/util/BFloat16.h round_to_nearest_even) in AVX-512F integer ops, so a vector
// store gives bitwise what the scalar conversion gives, on CPUs with and without AVX512_BF16.
inline __m256i bf16_bits(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// x rounded to bfloat16 and widened back: the value a bf16 store then load would give.
inline __m512 round_bf16(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(x)), 16));
}

inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(c10::BFloat16* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits(x));
}

// Masked forms: lanes outside `mask` are read as 0 and left unwritten.
inline __m512 load16_masked(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline void store16_masked(float* p, __m512 x, __mmask16 mask) { _mm512_mask_storeu_ps(p, mask, x); }
inline __m512 load16_masked(const c10::BFloat16* p, __mmask16 mask) {
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store16_masked(c10::BFloat16* p, __m512 x, __mmask16 mask) {
  _mm256_mask_storeu_epi16(p, mask, bf16_bits(x));
}

// exp(x): Cody-Waite range reduction x = n ln2 + r with |r| <= ln2 / 2, a degree-6
// polynomial for exp(r) (relative error ~2e-7, about one ulp), then scaling by 2^n with
// VSCALEFPS. Inputs below -87 give exactly 0 rather than a denormal (denormal operands would
// slow every later FMA by ~100x; their weight is below 1e-38); inputs above 88 give +inf.
inline __m512 exp512(__m512 x) {
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(89.f)), _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.3981999507e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_mov_ps(normal, _mm512_scalef_ps(p, n));
}

// In place: each of `rows` rows of n scores (n apart) becomes exp(score - max), and 1 / the
// row's sum goes to inv_sum. Shared by the decode and prefill kernels: one definition, so a
// prefill row's softmax is bitwise the decode kernel's for the same scores.
inline void softmax_rows(float* scores, int64_t n, int64_t rows, float* inv_sum) {
  for (int64_t g = 0; g < rows; ++g) {
    float* s = scores + g * n;
    __m512 maxv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) maxv = _mm512_max_ps(maxv, _mm512_loadu_ps(s + t));
    float max_score = _mm512_reduce_max_ps(maxv);
    for (; t < n; ++t) max_score = std::max(max_score, s[t]);
    const __m512 m = _mm512_set1_ps(max_score);
    __m512 sum = _mm512_setzero_ps();
    t = 0;
    for (; t + 16 <= n; t += 16) {
      const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + t), m));
      _mm512_storeu_ps(s + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (t < n) {
      const __mmask16 tail = static_cast<__mmask16>((1u << (n - t)) - 1);
      const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + t), m));
      _mm512_mask_storeu_ps(s + t, tail, e);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
    }
    inv_sum[g] = 1.f / _mm512_reduce_add_ps(sum);
  }
}

}  // namespace pagedllm_vec

#endif  // __AVX512F__

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

namespace pagedllm_vec {

// The x86-64-v3 build's attention pieces on 8 fp32 lanes. The decode kernel (paged_attention.cpp,
// its AVX2 group_scores and group_accumulate) and the exact prefill kernel (prefill_attention.cpp,
// prefill_impl's AVX2 twin) share them, so that on this build too a prefill row is bitwise the
// decode kernel's for the same token.

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const int8_t* p) {  // int8 KV cache codes, widened exactly
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// The sum of 8 lanes in a fixed order: x_l = lane l + lane l + 4 (l < 4), then y_l = x_l + x_(l+2)
// (l < 2), then y_0 + y_1. prefill_attention.cpp's float_scores8 adds its lanes in this order.
inline float hsum8(__m256 a) {
  const __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 y = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(y, _mm_movehdup_ps(y)));
}

// exp(x) for 8 floats, as exp512 computes it (Cody-Waite range reduction, the same degree-6
// polynomial), with 2^n built in the exponent bits (AVX2 has no VSCALEFPS): inputs below -87
// give 0 (-inf included), above 88 are taken as 88.
inline __m256 exp256(__m256 x) {
  const __m256 normal = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GE_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.f)), _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.3981999507e-3f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), normal);
}

// The AVX-512 softmax_rows on 8 lanes: each of `rows` rows of n scores (n apart) becomes
// exp(score - max), 1 / the row's sum goes to inv_sum; the sum is 8 lane sums (the last
// partial vector padded with exp(-inf) = 0) added by hsum8.
inline void softmax_rows(float* scores, int64_t n, int64_t rows, float* inv_sum) {
  for (int64_t g = 0; g < rows; ++g) {
    float* s = scores + g * n;
    __m256 maxv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) maxv = _mm256_max_ps(maxv, _mm256_loadu_ps(s + t));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, maxv);
    float max_score = lanes[0];
    for (float lane : lanes) max_score = std::max(max_score, lane);
    for (; t < n; ++t) max_score = std::max(max_score, s[t]);
    const __m256 m = _mm256_set1_ps(max_score);
    __m256 sum = _mm256_setzero_ps();
    t = 0;
    for (; t + 8 <= n; t += 8) {
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
      _mm256_storeu_ps(s + t, e);
      sum = _mm256_add_ps(sum, e);
    }
    if (t < n) {
      std::fill(lanes, lanes + 8, -std::numeric_limits<float>::infinity());
      std::copy(s + t, s + n, lanes);
      const __m256 e = exp256(_mm256_sub_ps(_mm256_load_ps(lanes), m));
      _mm256_store_ps(lanes, e);
      std::copy(lanes, lanes + (n - t), s + t);
      sum = _mm256_add_ps(sum, e);
    }
    inv_sum[g] = 1.f / hsum8(sum);
  }
}

}  // namespace pagedllm_vec

#endif  // AVX2 without AVX-512F
