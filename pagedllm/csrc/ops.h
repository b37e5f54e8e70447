// The C++ ops, callable from one another (decoder_layer.cpp runs a whole decode layer through
// them). Each is also registered as torch.ops.pagedllm.<name>; see the defining file for the
// semantics: fused_ops.cpp, paged_attention.cpp, prefill_attention.cpp, quant_gemm.cpp, w8a8.cpp,
// w4a8.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>

#include "cpu_vec.h"

namespace pagedllm {

// An int8 KV cache (kv_cache_dtype="int8") holds each token's row of one KV head as head_dim
// int8 codes followed by their fp32 scale (kKvScaleBytes bytes): the value is code * scale.
// The caches are then [num_blocks, block_size, num_kv_heads, head_dim + kKvScaleBytes] int8.
constexpr int64_t kKvScaleBytes = 4;

// Both attention kernels take the weighted sum of V kFoldTokens positions at a time (counted
// from the first attended one): each chunk's sum from zero in position order, then added to the
// total in chunk order. A long context can so be split between threads by chunk
// (paged_attention.cpp, split_context_attention) and still give bitwise what one thread walking
// it gives, and what the prefill kernel gives the same token's row (prefill_attention.cpp).
constexpr int64_t kFoldTokens = 128;

// Elements a cache row of element type C holds beyond its head_dim values.
template <typename C>
constexpr int64_t kv_row_extra() { return std::is_same_v<C, int8_t> ? kKvScaleBytes : 0; }

// The scale of the cache row that starts at `row` (1 for a float or bfloat16 cache).
template <typename C>
inline float kv_row_scale(const C* row, int64_t head_dim) {
  if constexpr (std::is_same_v<C, int8_t>) {
    float scale;
    std::memcpy(&scale, row + head_dim, sizeof(scale));
    return scale;
  } else {
    return 1.f;
  }
}

// One KV head's row of head_dim values as int8 codes and their fp32 scale (kv_cache_dtype="int8",
// layout in ops.h): scale = max |x| / 127, code = round-half-even(x / scale), in fp32 divisions,
// so the codes equal pagedllm/layers/ops.py quantize_kv's bit for bit. A row of zeros, or
// one holding NaN or infinity, gets codes 0 and its scale 0, NaN or infinity, so it reads back as
// zeros or NaN. The attention kernels round their queries so too (paged_attention.cpp).
template <typename T>
inline void quantize_kv_row(int8_t* dst, const T* x, int64_t head_dim) {
#if defined(__AVX512F__)
  // The same operations 16 lanes at a time (max is exact in any order, the division, rounding
  // to nearest even and clamping are per element), so the codes and scale are bitwise the
  // scalar loop's below; the scalar loop was ~15 % of the prefill attention kernel.
  if (head_dim % 16 == 0) {
    using pagedllm_vec::load16;
    const __m512 sign = _mm512_set1_ps(-0.f);
    __m512 amax16 = _mm512_setzero_ps();
    __mmask16 nan16 = 0;
    for (int64_t d = 0; d < head_dim; d += 16) {
      const __m512 v = load16(x + d);
      nan16 |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      amax16 = _mm512_max_ps(amax16, _mm512_andnot_ps(sign, v));
    }
    const float scale = nan16 ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(amax16) / 127.f;
    const bool finite = scale > 0.f && std::isfinite(scale);
    const __m512 s = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
    for (int64_t d = 0; d < head_dim; d += 16) {
      __m512 code = _mm512_setzero_ps();
      if (finite) {
        code = _mm512_roundscale_ps(_mm512_div_ps(load16(x + d), s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        code = _mm512_min_ps(hi, _mm512_max_ps(lo, code));
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(code)));
    }
    std::memcpy(dst + head_dim, &scale, sizeof(scale));
    return;
  }
#endif
  float amax = 0.f;
  bool nan = false;
  for (int64_t d = 0; d < head_dim; ++d) {
    const float v = static_cast<float>(x[d]);
    nan |= std::isnan(v);
    amax = std::max(amax, std::fabs(v));
  }
  const float scale = nan ? std::numeric_limits<float>::quiet_NaN() : amax / 127.f;
  const bool finite = scale > 0.f && std::isfinite(scale);
  for (int64_t d = 0; d < head_dim; ++d) {
    const float code = finite ? std::nearbyint(static_cast<float>(x[d]) / scale) : 0.f;
    dst[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, code)));
  }
  std::memcpy(dst + head_dim, &scale, sizeof(scale));
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm_(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
void rotary_embedding_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                       int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim);
at::Tensor silu_and_mul(const at::Tensor& x);
void reshape_and_cache_(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                        at::Tensor& value_cache, const at::Tensor& slot_mapping);
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale, int64_t sliding_window);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias);
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& mins, const std::optional<at::Tensor>& bias);
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       bool portable, bool fp32_out = false);
at::Tensor fp32_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& smooth_inv, const std::optional<at::Tensor>& bias, bool portable);
at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       bool portable);
void check_prefill_arguments(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_table, int64_t context_len);

}  // namespace pagedllm
