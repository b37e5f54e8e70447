// Fused element-wise ops of the decoder layer, each one pass over its rows instead of the
// several ATen ops (and several passes) of the torch formulation. The op set and semantics
// mirror vLLM's csrc/layernorm_kernels.cu (rms_norm, fused_add_rms_norm), pos_encoding_kernels.cu
// (rotary_embedding, neox "rotate half" layout), activation_kernels.cu (silu_and_mul) and
// cache_kernels.cu (reshape_and_cache). The arithmetic follows Hugging Face's modeling_llama.py
// (fp32 math, rounding to the storage dtype where it rounds), so fp32 results agree with the
// torch formulation up to summation order; pagedllm/layers/fused.py holds that formulation as
// the reference the tests compare against and as the fallback where this file cannot be built.
//
// Rows are parallelized with at::parallel_for; every op requires a contiguous last dimension.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>

#include "cpu_vec.h"
#include "ops.h"

namespace pagedllm {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// Rows per parallel task: enough work to amortize a task (~2k floats per row here).
constexpr int64_t kGrain = 16;

// Calls f(T{}) with T the element type of t (float or c10::BFloat16).
template <typename F>
void dispatch_dtype(const at::Tensor& t, const char* op, F&& f) {
  if (t.scalar_type() == at::kFloat) {
    f(float{});
  } else if (t.scalar_type() == at::kBFloat16) {
    f(c10::BFloat16{});
  } else {
    TORCH_CHECK_VALUE(false, op, " supports float32 and bfloat16, got ", t.scalar_type());
  }
}

void check_rows(const at::Tensor& x, const char* name, int64_t width) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.stride(1) == 1 && x.size(1) == width, name, " must be [rows, ",
                    width, "] with a contiguous last dimension, got ", x.sizes(), " strides ", x.strides());
}

// out = weight * (x / sqrt(mean(x^2) + eps)), the normalized x rounded to T before the product
// (HF: ``weight * hidden_states.to(input_dtype)``).
// bf16 rows run in AVX-512 registers (the scalar c10::BFloat16 conversions do not vectorize
// and made the bf16 ops 4-12x slower than the vector ones); they round at the same places as the
// scalar code, with sums in another order and exp() to one ulp.
template <typename T>
inline void rms_norm_row(T* out, const T* x, const T* w, int64_t h, float eps) {
  float sum = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= h; i += 16) {
      const __m512 v = pagedllm_vec::load16(x + i);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    sum = _mm512_reduce_add_ps(acc);
  }
#endif
  const int64_t tail = i;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = tail; j < h; ++j) sum += to_float(x[j]) * to_float(x[j]);
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(h) + eps);
  i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m512 scale = _mm512_set1_ps(inv);
    for (; i + 16 <= h; i += 16) {
      const __m512 normed = pagedllm_vec::round_bf16(_mm512_mul_ps(pagedllm_vec::load16(x + i), scale));
      pagedllm_vec::store16(out + i, _mm512_mul_ps(pagedllm_vec::load16(w + i), normed));
    }
  }
#endif
  for (; i < h; ++i) {
    out[i] = static_cast<T>(to_float(w[i]) * to_float(static_cast<T>(to_float(x[i]) * inv)));
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t h = weight.numel();
  TORCH_CHECK_VALUE(weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
                    "weight must be contiguous, in x's dtype");
  check_rows(x, "x", h);
  auto out = at::empty({x.size(0), h}, x.options());
  dispatch_dtype(x, "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t stride = x.stride(0);
    at::parallel_for(0, x.size(0), kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) rms_norm_row(op + r * h, xp + r * stride, wp, h, static_cast<float>(eps));
    });
  });
  return out;
}

// residual += x (rounded to T, as torch's add), then returns rms_norm(residual).
at::Tensor add_rms_norm_(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  const int64_t h = weight.numel();
  TORCH_CHECK_VALUE(weight.is_contiguous() && weight.scalar_type() == x.scalar_type() &&
                        residual.scalar_type() == x.scalar_type(),
                    "x, residual and weight must share one dtype");
  check_rows(x, "x", h);
  check_rows(residual, "residual", h);
  TORCH_CHECK_VALUE(x.size(0) == residual.size(0), "x and residual differ in rows");
  auto out = at::empty({x.size(0), h}, x.options());
  dispatch_dtype(x, "add_rms_norm_", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    T* rp = residual.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t xs = x.stride(0), rs = residual.stride(0);
    at::parallel_for(0, x.size(0), kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        T* res = rp + r * rs;
        const T* xr = xp + r * xs;
        int64_t i = 0;
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          for (; i + 16 <= h; i += 16) {
            pagedllm_vec::store16(res + i, _mm512_add_ps(pagedllm_vec::load16(res + i), pagedllm_vec::load16(xr + i)));
          }
        }
#endif
#pragma omp simd
        for (int64_t j = i; j < h; ++j) res[j] = static_cast<T>(to_float(res[j]) + to_float(xr[j]));
        rms_norm_row(op + r * h, res, wp, h, static_cast<float>(eps));
      }
    });
  });
  return out;
}

// Rotates, in place, the first num_q_heads heads (query) and the next num_kv_heads heads (key)
// of each row of qkv [tokens, (num_q_heads + 2 * num_kv_heads) * head_dim] by the row's position:
// x * cos + rotate_half(x) * sin with cos/sin [max_positions, head_dim] fp32, rounded to T as
// HF does (``cos.to(q.dtype)``).
void rotary_embedding_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                       const at::Tensor& sin, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim) {
  TORCH_CHECK_VALUE(qkv.dim() == 2 && qkv.stride(1) == 1 &&
                        qkv.size(1) == (num_q_heads + 2 * num_kv_heads) * head_dim,
                    "qkv must be [tokens, (q_heads + 2 kv_heads) * head_dim] with a contiguous last dimension");
  TORCH_CHECK_VALUE(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                        positions.numel() == qkv.size(0),
                    "positions must be contiguous int64 [tokens]");
  TORCH_CHECK_VALUE(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                        sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == head_dim && cos.sizes() == sin.sizes(),
                    "cos/sin must be contiguous fp32 [max_positions, head_dim]");
  TORCH_CHECK_VALUE(head_dim % 2 == 0, "head_dim must be even, got ", head_dim);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  for (int64_t t = 0; t < positions.numel(); ++t) {
    TORCH_CHECK_VALUE(pos[t] >= 0 && pos[t] < max_pos, "positions[", t, "] = ", pos[t], " is outside [0, ", max_pos, ")");
  }
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t heads = num_q_heads + num_kv_heads;
  const int64_t half = head_dim / 2;
  dispatch_dtype(qkv, "rotary_embedding_", [&](auto tag) {
    using T = decltype(tag);
    T* base = qkv.data_ptr<T>();
    const int64_t stride = qkv.stride(0);
    at::parallel_for(0, qkv.size(0), kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* c = cp + pos[t] * head_dim;
        const float* s = sp + pos[t] * head_dim;
        for (int64_t hd = 0; hd < heads; ++hd) {
          T* x = base + t * stride + hd * head_dim;
          int64_t i = 0;
#if defined(__AVX512F__)
          if constexpr (std::is_same_v<T, c10::BFloat16>) {
            using namespace pagedllm_vec;
            for (; i + 16 <= half; i += 16) {
              const __m512 x1 = load16(x + i), x2 = load16(x + i + half);
              const __m512 c1 = round_bf16(load16(c + i)), c2 = round_bf16(load16(c + i + half));
              const __m512 s1 = round_bf16(load16(s + i)), s2 = round_bf16(load16(s + i + half));
              store16(x + i, _mm512_sub_ps(_mm512_mul_ps(x1, c1), _mm512_mul_ps(x2, s1)));
              store16(x + i + half, _mm512_add_ps(_mm512_mul_ps(x2, c2), _mm512_mul_ps(x1, s2)));
            }
          }
#endif
#pragma omp simd
          for (int64_t k = i; k < half; ++k) {
            const float x1 = to_float(x[k]), x2 = to_float(x[k + half]);
            const float c1 = to_float(static_cast<T>(c[k])), c2 = to_float(static_cast<T>(c[k + half]));
            const float s1 = to_float(static_cast<T>(s[k])), s2 = to_float(static_cast<T>(s[k + half]));
            x[k] = static_cast<T>(x1 * c1 - x2 * s1);
            x[k + half] = static_cast<T>(x2 * c2 + x1 * s2);
          }
        }
      }
    });
  });
}

// [tokens, 2 * d] (gate | up) -> [tokens, d]: silu(gate) * up, silu rounded to T first.
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
                    "x must be [tokens, 2 * d] with a contiguous last dimension");
  const int64_t d = x.size(1) / 2;
  auto out = at::empty({x.size(0), d}, x.options());
  dispatch_dtype(x, "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t stride = x.stride(0);
    at::parallel_for(0, x.size(0), kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* gate = xp + r * stride;
        const T* up = gate + d;
        T* o = op + r * d;
        int64_t i = 0;
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<T, float>) {  // exp vectorized (std::exp is not)
          for (; i + 16 <= d; i += 16) {
            const __m512 g = _mm512_loadu_ps(gate + i);
            const __m512 e = pagedllm_vec::exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
            const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
            _mm512_storeu_ps(o + i, _mm512_mul_ps(silu, _mm512_loadu_ps(up + i)));
          }
        } else {  // bf16: silu rounded to bf16 before the product, as below
          using namespace pagedllm_vec;
          for (; i + 16 <= d; i += 16) {
            const __m512 g = load16(gate + i);
            const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
            const __m512 silu = round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
            store16(o + i, _mm512_mul_ps(silu, load16(up + i)));
          }
        }
#endif
        for (; i < d; ++i) {
          const float g = to_float(gate[i]);
          const float silu = to_float(static_cast<T>(g / (1.f + std::exp(-g))));
          o[i] = static_cast<T>(silu * to_float(up[i]));
        }
      }
    });
  });
  return out;
}

// Per row of fp32 logits [rows, vocab]: the index of the largest value (the first one on ties,
// as torch.argmax) and log(sum(exp(x))) computed as max + log(sum(exp(x - max))) (torch's
// logsumexp). Two passes over a row that stays in L2: max/argmax, then the sum. Replaces two
// torch reductions that take ~10 ms at 64 x 49152 on this CPU (torch's exp is slow here).
// Special values as torch: a row of -inf gives -inf, a +inf gives +inf, a NaN gives NaN and the
// first NaN's index.
std::tuple<at::Tensor, at::Tensor> argmax_logsumexp(const at::Tensor& logits) {
  TORCH_CHECK_VALUE(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1 &&
                        logits.size(1) > 0,
                    "logits must be float32 [rows, vocab] with a contiguous last dimension, got ", logits.sizes(),
                    " ", logits.scalar_type());
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  auto argmax = at::empty({rows}, logits.options().dtype(at::kLong));
  auto lse = at::empty({rows}, logits.options());
  const float* xp = logits.data_ptr<float>();
  int64_t* ap = argmax.data_ptr<int64_t>();
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = xp + r * stride;
      float best = x[0];
      int64_t best_index = 0;
      bool nan = false;
      int64_t i = 0;
#if defined(__AVX512F__)
      __m512 lane_max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      __m512i lane_index = _mm512_setzero_si512();
      __mmask16 lane_nan = 0;
      const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      // Indices fit 32 bits (vocab < 2^31); strictly greater keeps each lane's first maximum.
      for (; i + 16 <= vocab; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        lane_nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        const __mmask16 greater = _mm512_cmp_ps_mask(v, lane_max, _CMP_GT_OQ);
        lane_max = _mm512_mask_mov_ps(lane_max, greater, v);
        lane_index = _mm512_mask_mov_epi32(lane_index, greater,
                                           _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int>(i))));
      }
      nan = lane_nan != 0;
      if (i > 0) {
        alignas(64) float values[16];
        alignas(64) int32_t indices[16];
        _mm512_store_ps(values, lane_max);
        _mm512_store_si512(indices, lane_index);
        best = values[0];
        best_index = indices[0];
        for (int lane = 1; lane < 16; ++lane) {
          if (values[lane] > best || (values[lane] == best && indices[lane] < best_index)) {
            best = values[lane];
            best_index = indices[lane];
          }
        }
        if (best == -std::numeric_limits<float>::infinity()) best_index = 0;  // all -inf: first
      }
#endif
      for (; i < vocab; ++i) {
        if (std::isnan(x[i])) nan = true;
        if (x[i] > best) {
          best = x[i];
          best_index = i;
        }
      }
      if (nan) {  // torch.argmax ranks NaN above everything: the first NaN
        int64_t first = 0;
        while (!std::isnan(x[first])) ++first;
        ap[r] = first;
        lp[r] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      ap[r] = best_index;
      if (std::isinf(best)) {  // all -inf, or a +inf (whose logsumexp is +inf)
        lp[r] = best;
        continue;
      }
      float sum = 0.f;
      i = 0;
#if defined(__AVX512F__)
      __m512 lane_sum = _mm512_setzero_ps();
      const __m512 shift = _mm512_set1_ps(best);
      for (; i + 16 <= vocab; i += 16) {
        lane_sum = _mm512_add_ps(lane_sum, pagedllm_vec::exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i), shift)));
      }
      sum = _mm512_reduce_add_ps(lane_sum);
#endif
      // The scalar loop (the whole row without AVX-512) sums in double: one fp32 running sum
      // over 49,152 terms was 3e-6 off torch's.
      double rest = 0.0;
      for (; i < vocab; ++i) rest += std::exp(x[i] - best);
      lp[r] = best + std::log(static_cast<float>(sum + rest));
    }
  });
  return {argmax, lse};
}

// Copies each token's K/V rows [tokens, num_kv_heads * head_dim] (row stride free) into its
// slot of the caches [num_blocks, block_size, num_kv_heads, head_dim], converting float32 rows
// to bfloat16 for a bfloat16 cache (kv_cache_dtype="bfloat16"), or quantizing float32 and
// bfloat16 rows into an int8 cache [..., head_dim + 4] (kv_cache_dtype="int8", quantize_kv_row).
void reshape_and_cache_(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                        at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK_VALUE(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.dim() == 4 &&
                        key_cache.sizes() == value_cache.sizes(),
                    "K/V caches must be contiguous [num_blocks, block_size, kv_heads, head_dim] of one shape");
  const bool to_int8 = key_cache.scalar_type() == at::kChar;
  const int64_t num_kv_heads = key_cache.size(2);
  const int64_t head_dim = key_cache.size(3) - (to_int8 ? kKvScaleBytes : 0);
  TORCH_CHECK_VALUE(head_dim > 0, "an int8 K/V cache row must hold head_dim values and a 4-byte scale");
  const int64_t width = num_kv_heads * head_dim;
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  check_rows(key, "key", width);
  check_rows(value, "value", width);
  const bool to_bf16 = key.scalar_type() == at::kFloat && key_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK_VALUE(value.scalar_type() == key.scalar_type() && value_cache.scalar_type() == key_cache.scalar_type() &&
                        (key_cache.scalar_type() == key.scalar_type() || to_bf16 || to_int8),
                    "key and value must share one dtype and the caches one dtype, the same, int8, or bfloat16 "
                    "caches for float32 key/value (got key ", key.scalar_type(), ", key_cache ",
                    key_cache.scalar_type(), ")");
  if (to_int8) {
    TORCH_CHECK_VALUE(key.scalar_type() == at::kFloat || key.scalar_type() == at::kBFloat16,
                      "an int8 K/V cache takes float32 or bfloat16 key/value, got ", key.scalar_type());
  }
  TORCH_CHECK_VALUE(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                        slot_mapping.numel() == key.size(0) && value.size(0) == key.size(0),
                    "slot_mapping must be contiguous int64 [tokens]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < key.size(0); ++t) {
    TORCH_CHECK_VALUE(slots[t] >= 0 && slots[t] < num_slots, "slot_mapping[", t, "] = ", slots[t],
                      " is outside [0, ", num_slots, ")");
  }
  const int64_t row_bytes = num_kv_heads * key_cache.size(3) * key_cache.element_size();
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(key_cache.data_ptr());
  char* vc = static_cast<char*>(value_cache.data_ptr());
  const int64_t ks = key.stride(0) * key.element_size(), vs = value.stride(0) * value.element_size();
  // Rounded to nearest even, as torch's .to(torch.bfloat16).
  auto store = [&](char* dst, const char* src) {
    if (to_int8) {
      int8_t* to = reinterpret_cast<int8_t*>(dst);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        if (key.scalar_type() == at::kFloat) {
          quantize_kv_row(to + h * (head_dim + kKvScaleBytes), reinterpret_cast<const float*>(src) + h * head_dim,
                          head_dim);
        } else {
          quantize_kv_row(to + h * (head_dim + kKvScaleBytes),
                          reinterpret_cast<const c10::BFloat16*>(src) + h * head_dim, head_dim);
        }
      }
      return;
    }
    if (!to_bf16) {
      std::memcpy(dst, src, row_bytes);
      return;
    }
    const float* from = reinterpret_cast<const float*>(src);
    c10::BFloat16* to = reinterpret_cast<c10::BFloat16*>(dst);
    for (int64_t i = 0; i < width; ++i) to[i] = c10::BFloat16(from[i]);
  };
  at::parallel_for(0, key.size(0), 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      store(kc + slots[t] * row_bytes, kp + t * ks);
      store(vc + slots[t] * row_bytes, vp + t * vs);
    }
  });
}

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &pagedllm::rms_norm);
  m.def("add_rms_norm_(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor", &pagedllm::add_rms_norm_);
  m.def("rotary_embedding_(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, int num_q_heads, "
        "int num_kv_heads, int head_dim) -> ()", &pagedllm::rotary_embedding_);
  m.def("silu_and_mul(Tensor x) -> Tensor", &pagedllm::silu_and_mul);
  m.def("argmax_logsumexp(Tensor logits) -> (Tensor, Tensor)", &pagedllm::argmax_logsumexp);
  m.def("reshape_and_cache_(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping) -> ()", &pagedllm::reshape_and_cache_);
}
