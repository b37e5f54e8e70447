// Causal attention of one bfloat16 prefill chunk over its sequence's paged bfloat16 K/V on
// AVX512_BF16 dot products (VDPBF16PS: each of 16 fp32 lanes adds two bf16 products), with an
// online softmax over blocks of 32 keys (FlashAttention-2, Dao 2023, Algorithm 1): a block's
// scores are q . k summed in fp32 from the bf16 values as stored, times the scale; its weights
// exp(score - running max) are rounded to bf16 for the P . V products, as flash kernels on GPUs
// do, and the output and the row sums are rescaled when the running max grows.
//
//   query  [q_len, num_heads, head_dim] bfloat16, queries at positions context_len - q_len ..
//          context_len - 1; caches [num_blocks, block_size, num_kv_heads, head_dim] bfloat16,
//          block_table [>= ceil(context_len / block_size)] int64 (checks: prefill_attention.cpp)
//   out    [q_len, num_heads, head_dim] bfloat16
//
// Why another kernel: prefill_attention.cpp's rows are bitwise the decode kernel's, so its sums
// run in fp32 FMAs (16 products per instruction); VDPBF16PS does 32. On an AMD EPYC Zen 4
// (2 cores, 2026-12-06) this one took 0.14-0.63x that kernel's time and 0.20-0.55x torch's
// flash SDPA's from 150 x 150 to 2,048 x 16,384 queries x keys, and ran ~300 GFLOP/s of causal
// work at 2,048 x 16,384 with 32 heads of 128, 0.78 of that CPU's bf16 GEMM rate (bench/README.md,
// "Prefill attention on bf16 dot products").
// Its rows differ from the decode kernel's by bf16 rounding of the weights, so
// PAGEDLLM_BATCH_INVARIANT=1 keeps the exact kernel (pagedllm/layers/attention.py).
//
// Work is split into (KV head, tile of 16 query positions) items, each running the tile's rows
// of all query heads that share the KV head against one key block at a time, so a block's K and
// V (32 keys, packed once per call into the layouts VDPBF16PS reads) serve the whole group while
// they are in L1.
//
// AVX512_BF16 builds only, head_dim 64, 128 or 256 (prefill_attention_bf16_supported).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "cpu_vec.h"
#include "ops.h"

namespace pagedllm {
namespace {

#if defined(__AVX512BF16__)
using pagedllm_vec::exp512;

constexpr int kRows = 16;  // query positions per tile (one accumulator register each)
constexpr int kKeys = 32;  // keys per block: two 16-lane score vectors per row

// c[i] (16 fp32 lanes, row i of 16, rows c_stride floats apart) = init[i] + sum over p of
// a_i[2p] * b_p[2 lane] + a_i[2p + 1] * b_p[2 lane + 1], where a_i holds row i's bf16 pairs
// (a + i * a_stride, as uint32) and b_p the 16 lanes' pairs for pair p (b + 16 p). init is 0,
// or c[i] times alpha[i] when alpha is given. Scores: a = query rows, b = 16 keys' pairs of
// dimensions. Output: a = rows' weights of 32 keys, b = 16 dimensions' pairs of keys.
template <int kPairs>
__attribute__((noinline)) void dot_rows(const uint32_t* a, int64_t a_stride, const uint32_t* b, float* c,
                                        int64_t c_stride, const float* alpha) {
  __m512 acc[kRows];
#pragma GCC unroll 16
  for (int i = 0; i < kRows; ++i) {
    acc[i] = alpha ? _mm512_mul_ps(_mm512_loadu_ps(c + i * c_stride), _mm512_set1_ps(alpha[i])) : _mm512_setzero_ps();
  }
#pragma GCC unroll 2
  for (int p = 0; p < kPairs; ++p) {
    const __m512bh bv = (__m512bh)_mm512_loadu_si512(b + 16 * p);
#pragma GCC unroll 16
    for (int i = 0; i < kRows; ++i) {
      acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(static_cast<int>(a[i * a_stride + p])), bv);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < kRows; ++i) _mm512_storeu_ps(c + i * c_stride, acc[i]);
}

template <int kHeadDim>
void flash_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                const int64_t* table, int64_t context_len, float scale) {
  constexpr int kPairs = kHeadDim / 2;     // bf16 pairs of dimensions per row
  constexpr int kChunks = kHeadDim / 16;   // 16-dimension output vectors per row
  const int64_t q_len = query.size(0), num_heads = query.size(1);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * kHeadDim, block_stride = block_size * token_stride;
  const int64_t first_pos = context_len - q_len;
  const int64_t num_blocks = (context_len + kKeys - 1) / kKeys;
  const auto* k_base = reinterpret_cast<const uint16_t*>(key_cache.data_ptr<c10::BFloat16>());
  const auto* v_base = reinterpret_cast<const uint16_t*>(value_cache.data_ptr<c10::BFloat16>());
  auto row_of = [&](const uint16_t* base, int64_t pos, int64_t kv_head) {
    return base + table[pos / block_size] * block_stride + (pos % block_size) * token_stride + kv_head * kHeadDim;
  };

  // Packed per KV head and key block (32 keys, zeros past context_len), as uint32 pairs of bf16:
  //   K: kp[((h * num_blocks + blk) * 2 + half) * kPairs * 16 + p * 16 + j] = dimensions 2p, 2p + 1
  //      of key blk * 32 + half * 16 + j;
  //   V: vp[((h * num_blocks + blk) * kChunks + c) * 16 * 16 + m * 16 + d] = dimension 16 c + d of
  //      keys blk * 32 + 2m (low half) and blk * 32 + 2m + 1 (high half).
  const size_t block_words = static_cast<size_t>(kKeys) * kPairs;  // uint32 per block, each of K and V
  const size_t words = static_cast<size_t>(num_kv_heads * num_blocks) * block_words;
  std::unique_ptr<uint32_t[]> kp(new uint32_t[words]), vp(new uint32_t[words]);
  at::parallel_for(0, num_kv_heads * num_blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / num_blocks, blk = item % num_blocks;
      uint32_t* kb = kp.get() + item * block_words;
      uint32_t* vb = vp.get() + item * block_words;
      for (int j = 0; j < kKeys; ++j) {
        const int64_t pos = blk * kKeys + j;
        uint32_t* kdst = kb + (j / 16) * kPairs * 16 + j % 16;
        if (pos < context_len) {
          const uint16_t* krow = row_of(k_base, pos, h);
          for (int p = 0; p < kPairs; ++p) {
            uint32_t pair;
            std::memcpy(&pair, krow + 2 * p, sizeof(pair));
            kdst[p * 16] = pair;
          }
        } else {
          for (int p = 0; p < kPairs; ++p) kdst[p * 16] = 0;
        }
      }
      for (int m = 0; m < kKeys / 2; ++m) {
        const int64_t pos = blk * kKeys + 2 * m;
        const uint16_t* v0 = pos < context_len ? row_of(v_base, pos, h) : nullptr;
        const uint16_t* v1 = pos + 1 < context_len ? row_of(v_base, pos + 1, h) : nullptr;
        for (int c = 0; c < kChunks; ++c) {
          const __m512i lo = v0 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + 16 * c)))
                                : _mm512_setzero_si512();
          const __m512i hi = v1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + 16 * c)))
                                : _mm512_setzero_si512();
          _mm512_storeu_si512(vb + (c * 16 + m) * 16, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
      }
    }
  });

  // Items are (KV head, query tile); a tile's cost grows with its last position (causal), so
  // threads take items from a shared counter, the costliest tiles first.
  const int64_t tiles = (q_len + kRows - 1) / kRows, num_items = num_kv_heads * tiles;
  const auto* q_base = reinterpret_cast<const uint16_t*>(query.data_ptr<c10::BFloat16>());
  const int64_t q_token_stride = query.stride(0), q_head_stride = query.stride(1);
  auto* out_base = out.data_ptr<c10::BFloat16>();
  std::atomic<int64_t> next_item{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    // Per query head of the group: its 16 query rows (bf16, zero past q_len), output rows (fp32),
    // running max (in scaled units) and per-lane partial row sums.
    std::vector<uint16_t> q(static_cast<size_t>(group * kRows * kHeadDim));
    std::vector<float> o(static_cast<size_t>(group * kRows * kHeadDim));
    std::vector<float> row_max(static_cast<size_t>(group * kRows));
    std::vector<float> row_sum(static_cast<size_t>(group * kRows * 16));
    alignas(64) float s[kRows * kKeys];          // a block's scores, row i's at s[i * kKeys]
    alignas(64) uint16_t p[kRows * kKeys];       // their weights in bf16
    alignas(64) float alpha[kRows];              // exp(old max - new max) per row
    for (int64_t item = next_item++; item < num_items; item = next_item++) {
      const int64_t kv_head = item % num_kv_heads, tile = tiles - 1 - item / num_kv_heads;
      const int64_t row0 = tile * kRows, rows = std::min<int64_t>(kRows, q_len - row0);
      const int64_t pos0 = first_pos + row0, last_pos = pos0 + rows - 1;
      for (int64_t g = 0; g < group; ++g) {
        const int64_t head = kv_head * group + g;
        for (int64_t i = 0; i < kRows; ++i) {
          uint16_t* dst = q.data() + (g * kRows + i) * kHeadDim;
          if (i < rows) std::memcpy(dst, q_base + (row0 + i) * q_token_stride + head * q_head_stride, kHeadDim * 2);
          else std::memset(dst, 0, kHeadDim * 2);
        }
      }
      std::fill(o.begin(), o.end(), 0.f);
      std::fill(row_max.begin(), row_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(row_sum.begin(), row_sum.end(), 0.f);
      const __m512 scale_v = _mm512_set1_ps(scale);
      for (int64_t blk = 0; blk <= last_pos / kKeys; ++blk) {
        const int64_t key0 = blk * kKeys;
        const uint32_t* kb = kp.get() + (kv_head * num_blocks + blk) * block_words;
        const uint32_t* vb = vp.get() + (kv_head * num_blocks + blk) * block_words;
        for (int64_t g = 0; g < group; ++g) {
          const auto* qg = reinterpret_cast<const uint32_t*>(q.data() + g * kRows * kHeadDim);
          dot_rows<kPairs>(qg, kPairs, kb, s, kKeys, nullptr);
          dot_rows<kPairs>(qg, kPairs, kb + kPairs * 16, s + 16, kKeys, nullptr);
          float* gmax = row_max.data() + g * kRows;
          float* gsum = row_sum.data() + g * kRows * 16;
          alignas(64) float block_max[kRows];
          for (int i = 0; i < kRows; ++i) {
            // Keys after the row's position are masked; padding rows past q_len act as the last row.
            const int64_t visible = std::min<int64_t>(pos0 + i, last_pos) - key0 + 1;
            __m512 lo = _mm512_load_ps(s + i * kKeys), hi = _mm512_load_ps(s + i * kKeys + 16);
            if (visible < kKeys) {
              const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
              const auto mask = [](int64_t n) {
                return static_cast<__mmask16>(n >= 16 ? 0xFFFF : n <= 0 ? 0 : (1u << n) - 1);
              };
              lo = _mm512_mask_mov_ps(neg_inf, mask(visible), lo);
              hi = _mm512_mask_mov_ps(neg_inf, mask(visible - 16), hi);
              _mm512_store_ps(s + i * kKeys, lo);
              _mm512_store_ps(s + i * kKeys + 16, hi);
            }
            block_max[i] = _mm512_reduce_max_ps(_mm512_max_ps(lo, hi));
          }
          // Block 0 holds key 0, which every row sees, so a row's max is finite from there on.
          const __m512 old_max = _mm512_loadu_ps(gmax);
          const __m512 new_max = _mm512_max_ps(old_max, _mm512_mul_ps(_mm512_load_ps(block_max), scale_v));
          _mm512_store_ps(alpha, exp512(_mm512_sub_ps(old_max, new_max)));
          _mm512_storeu_ps(gmax, new_max);
          for (int i = 0; i < kRows; ++i) {
            const __m512 m = _mm512_set1_ps(gmax[i]);
            const __m512 w_lo = exp512(_mm512_fmsub_ps(_mm512_load_ps(s + i * kKeys), scale_v, m));
            const __m512 w_hi = exp512(_mm512_fmsub_ps(_mm512_load_ps(s + i * kKeys + 16), scale_v, m));
            const __m512 sum = _mm512_loadu_ps(gsum + i * 16);
            _mm512_storeu_ps(gsum + i * 16, _mm512_fmadd_ps(sum, _mm512_set1_ps(alpha[i]), _mm512_add_ps(w_lo, w_hi)));
            _mm512_store_si512(p + i * kKeys, (__m512i)_mm512_cvtne2ps_pbh(w_hi, w_lo));
          }
          float* og = o.data() + g * kRows * kHeadDim;
          for (int c = 0; c < kChunks; ++c) {
            dot_rows<kKeys / 2>(reinterpret_cast<const uint32_t*>(p), kKeys / 2, vb + c * 16 * 16, og + 16 * c,
                                kHeadDim, alpha);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const int64_t head = kv_head * group + g;
        for (int64_t i = 0; i < rows; ++i) {
          const float* oi = o.data() + (g * kRows + i) * kHeadDim;
          const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(row_sum.data() + (g * kRows + i) * 16)));
          c10::BFloat16* dst = out_base + ((row0 + i) * num_heads + head) * kHeadDim;
          for (int c = 0; c < kChunks; ++c) pagedllm_vec::store16(dst + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(oi + 16 * c), inv));
        }
      }
    }
  });
}
#endif  // __AVX512BF16__

}  // namespace

bool prefill_attention_bf16_supported(int64_t head_dim) {
#if defined(__AVX512BF16__)
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
#else
  (void)head_dim;
  return false;
#endif
}

at::Tensor paged_prefill_attention_bf16(const at::Tensor& query, const at::Tensor& key_cache,
                                        const at::Tensor& value_cache, const at::Tensor& block_table,
                                        int64_t context_len, double scale) {
  check_prefill_arguments(query, key_cache, value_cache, block_table, context_len);
  TORCH_CHECK_VALUE(prefill_attention_bf16_supported(query.size(2)), "paged_prefill_attention_bf16: head_dim ",
                    query.size(2), " is not supported by this build");
  TORCH_CHECK_VALUE(query.scalar_type() == at::kBFloat16 && key_cache.scalar_type() == at::kBFloat16,
                    "paged_prefill_attention_bf16 takes a bfloat16 query and bfloat16 K/V caches");
  auto out = at::empty({query.size(0), query.size(1), query.size(2)}, query.options());
#if defined(__AVX512BF16__)
  const int64_t* table = block_table.data_ptr<int64_t>();
  const float s = static_cast<float>(scale);
  switch (query.size(2)) {
    case 64: flash_impl<64>(out, query, key_cache, value_cache, table, context_len, s); break;
    case 128: flash_impl<128>(out, query, key_cache, value_cache, table, context_len, s); break;
    default: flash_impl<256>(out, query, key_cache, value_cache, table, context_len, s); break;
  }
#endif
  return out;
}

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("prefill_attention_bf16_supported(int head_dim) -> bool", &pagedllm::prefill_attention_bf16_supported);
  m.def("paged_prefill_attention_bf16(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, "
        "int context_len, float scale) -> Tensor",
        &pagedllm::paged_prefill_attention_bf16);
}
