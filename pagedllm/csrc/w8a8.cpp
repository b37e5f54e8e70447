// W8A8 linear layer: int8 weights (per output channel) times int8 activations (per token,
// quantized on the fly), accumulated in int32 by oneDNN through at::_int_mm, which uses the
// CPU's integer dot-product units where it has them (AVX512_VNNI / AVX_VNNI vpdpbusd, AMX-INT8)
// and chooses them at run time. The scheme is SmoothQuant's (Xiao et al. 2023, "SmoothQuant",
// sections 3-4: per-token dynamic activation scales, per-channel weight scales, activation
// outliers migrated into the weights by a per-input-channel factor) and the arithmetic of
// vLLM's CPU int8 W8A8 path (csrc/cpu/dnnl_kernels.cpp: dynamic per-token symmetric int8).
//
//   v[m, k]  = x[m, k] * smooth_inv[k]                     (fp32)
//   s_x[m]   = max_k |v[m, k]| / 127 (1 for an all-zero row)
//   q_x[m,k] = round_half_even(v[m, k] / s_x[m]), clamped to [-127, 127]
//   acc      = q_x @ codes.T                               (int32, exact)
//   y[m, n]  = (float(acc[m, n]) * s_x[m]) * scales[n] + bias[n], stored in x's dtype
//
// The pure-torch twin (pagedllm/layers/quantization.py, w8a8_linear_torch) performs the same
// fp32 operations in the same order, so the two agree bitwise: the integer product is exact
// and every rounding happens in the same place. That needs each multiply and add rounded on
// its own, so this file is compiled without FMA contraction.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

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

// One row of the output: y [N] = (float(acc) * x_scale) * scales (+ bias).
template <typename T>
void dequantize_row(const int32_t* acc, float x_scale, const float* scales, const float* bias, T* y, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 vx = _mm512_set1_ps(x_scale);
  for (; j + 16 <= n; j += 16) {
    const __m512i a = _mm512_loadu_si512(acc + j);
    __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a), vx), _mm512_loadu_ps(scales + j));
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + j));
    pagedllm_vec::store16(y + j, v);
  }
#endif
  for (; j < n; ++j) {
    float v = (static_cast<float>(acc[j]) * x_scale) * scales[j];
    if (bias != nullptr) v = v + bias[j];
    store_scalar(y + j, v);
  }
}

// Few rows (decode): acc[r, n] = sum_k q[r, k] * codes[n, k] by the CPU's u8 x s8 dot product
// (VPDPBUSD) straight from codes [N, K], one channel's row after another (a sequential stream:
// oneDNN's _int_mm takes 3-4x the weight's read time at one row). The unsigned operand is
// |q| and the weight's sign is flipped where q < 0 (llama.cpp's trick for its Q8_0 dot), so
// every product is exact and the int32 sums equal _int_mm's. Without AVX512_VNNI (or with
// `portable`) both are widened to int16 and multiplied by VPMADDWD, exact too.
constexpr int64_t kFewRows = 4;
// Software prefetch of the channel this many rows ahead (prefetches never fault past the end).
constexpr int64_t kPrefetchRows = 4;

#if defined(__AVX512BW__)
template <int R, bool Vnni>
void few_rows_channel(const uint8_t* absq, const __mmask64* negative, const int8_t* w, int64_t k, int32_t* acc_out) {
  __m512i acc[kFewRows];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
  const int64_t chunks = (k + 63) / 64;
  for (int64_t c = 0; c < chunks; ++c) {
    const __mmask64 live = c * 64 + 64 <= k ? ~0ULL : (1ULL << (k - c * 64)) - 1;
    _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchRows * k + c * 64), _MM_HINT_T0);
    const __m512i wv = _mm512_maskz_loadu_epi8(live, w + c * 64);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_loadu_si512(absq + r * chunks * 64 + c * 64);  // padded with zeros
      const __m512i signed_w = _mm512_mask_sub_epi8(wv, negative[r * chunks + c], _mm512_setzero_si512(), wv);
#if defined(__AVX512VNNI__)
      if constexpr (Vnni) {
        acc[r] = _mm512_dpbusd_epi32(acc[r], xv, signed_w);
        continue;
      }
#endif
      // |q| <= 127 and the weights in [-127, 127]: int16 pairs, then VPMADDWD's exact int32 sums.
      const __m512i x_lo = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(xv));
      const __m512i x_hi = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(xv, 1));
      const __m512i w_lo = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(signed_w));
      const __m512i w_hi = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(signed_w, 1));
      acc[r] = _mm512_add_epi32(acc[r], _mm512_add_epi32(_mm512_madd_epi16(x_lo, w_lo), _mm512_madd_epi16(x_hi, w_hi)));
    }
  }
  for (int r = 0; r < R; ++r) acc_out[r] = _mm512_reduce_add_epi32(acc[r]);
}
#endif

// acc [m, n] int32 = q [m, k] @ codes.T for m <= kFewRows.
void few_rows_int_mm(const int8_t* q, int64_t m, const int8_t* codes, int64_t n, int64_t k, int32_t* acc, bool portable) {
#if defined(__AVX512BW__)
  const int64_t chunks = (k + 63) / 64;
  std::vector<uint8_t> absq(m * chunks * 64, 0);
  std::vector<__mmask64> negative(m * chunks, 0);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t i = 0; i < k; ++i) {
      const int8_t v = q[r * k + i];
      absq[r * chunks * 64 + i] = static_cast<uint8_t>(v < 0 ? -v : v);
      if (v < 0) negative[r * chunks + i / 64] |= 1ULL << (i % 64);
    }
  }
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    int32_t sums[kFewRows];
    for (int64_t c = begin; c < end; ++c) {
      switch (m) {
#define CASE(R)                                                                                               \
  case R:                                                                                                     \
    if (portable) few_rows_channel<R, false>(absq.data(), negative.data(), codes + c * k, k, sums);           \
    else few_rows_channel<R, true>(absq.data(), negative.data(), codes + c * k, k, sums);                     \
    break;
        CASE(1) CASE(2) CASE(3) CASE(4)
#undef CASE
        default: break;
      }
      for (int64_t r = 0; r < m; ++r) acc[r * n + c] = sums[r];
    }
  });
#else
  (void)portable;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = begin; c < end; ++c) {
        int32_t sum = 0;
        for (int64_t i = 0; i < k; ++i) sum += static_cast<int32_t>(q[r * k + i]) * codes[c * k + i];
        acc[r * n + c] = sum;
      }
  });
#endif
}

template <typename T>
at::Tensor w8a8_linear_impl(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                            const at::Tensor& smooth_inv, const std::optional<at::Tensor>& bias, bool portable) {
  const int64_t m = x.size(0), k = x.size(1), n = codes.size(0);
  at::Tensor q = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor x_scales = at::empty({m}, x.options().dtype(at::kFloat));
  const T* xp = x.data_ptr<T>();
  const float* sp = smooth_inv.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* xsp = x_scales.data_ptr<float>();
  // Grains of about 64K elements: below that a parallel region costs more than it saves.
  at::parallel_for(0, m, std::max<int64_t>(1, kParallelElements / k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) xsp[r] = quantize_row(xp + r * k, sp, qp + r * k, k);
  });
  at::Tensor acc;
  if (m <= kFewRows) {
    acc = at::empty({m, n}, x.options().dtype(at::kInt));
    few_rows_int_mm(qp, m, codes.data_ptr<int8_t>(), n, k, acc.data_ptr<int32_t>(), portable);
  } else {
    acc = at::_int_mm(q, codes.t());
  }
  at::Tensor y = at::empty({m, n}, x.options());
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* wsp = scales.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, m, std::max<int64_t>(1, kParallelElements / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) dequantize_row(ap + r * n, xsp[r], wsp, bp, yp + r * n, n);
  });
  return y;
}

}  // namespace

at::Tensor w8a8_linear(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& smooth_inv, const std::optional<at::Tensor>& bias, bool portable) {
  TORCH_CHECK_VALUE(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous(),
                    "w8a8_linear: codes must be a contiguous int8 [N, K] tensor");
  const int64_t n = codes.size(0), k = codes.size(1);
  TORCH_CHECK_VALUE(x_in.dim() == 2 && x_in.size(1) == k &&
                        (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
                    "w8a8_linear: x must be float32 or bfloat16 [M, ", k, "], got ", x_in.scalar_type(), " ",
                    x_in.sizes());
  TORCH_CHECK_VALUE(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 1 &&
                        scales.size(0) == n,
                    "w8a8_linear: scales must be float32 [", n, "], got ", scales.sizes());
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
