// Causal attention of one prefill chunk over its sequence's paged K/V (the chunk's own K/V
// already written to the cache), per (head, tile of 16 queries) on fp32 AVX-512 FMAs, K and V
// read through the block table (K transposed once per call into a [kv_head][head_dim][keys] fp32
// scratch, V rows in place). Over an int8 cache with AVX512_VNNI the scores are VPDPBUSD integer
// sums instead (int_scores).
//
// Each query row's output is bitwise what the decode kernel (paged_attention.cpp) gives that
// token as the last of a context_len = its position + 1 sequence: the same scores (summed in
// its order), its softmax_rows over the row's whole score row (two passes, not an online
// softmax, whose rescaling rounds differently), and the weighted sum of V in position order. So
// a token's KV and logits do not depend on whether it was computed in a prefill or a decode
// step: recompute after preemption, a chunk boundary, or a prefix-cache hit change nothing
// where the rest of the model is also row-wise exact (test_prefill_kernel_rows_equal_decode,
// tests/test_preemption_invariance.py).
//
//   query  [q_len, num_heads, head_dim], queries at positions context_len - q_len .. context_len - 1
//   caches [num_blocks, block_size, num_kv_heads, head_dim] (the query's dtype, or bfloat16 under
//          an fp32 query), or int8 rows of head_dim + 4 (codes, then their fp32 scale; ops.h),
//          block_table [>= ceil(context_len / block_size)] int64
//   out    [q_len, num_heads, head_dim] contiguous, the query's dtype
// Query i sees keys 0 .. context_len - q_len + i. Scores, softmax and the weighted sum are fp32.
//
// Why not torch's SDPA: at SmolLM2's shapes (9 heads of 64, 150-500 tokens) its flash kernel
// reached 42-55 GFLOP/s of useful (causal) work on 2 Zen 4 cores, this one ~110, and SDPA
// needs a gathered K/V and an explicit mask for a chunk with a cached prefix (bench/README.md,
// "Zen 4 profile": 1.7-2.4x).
//
// AVX-512 builds, and the x86-64-v3 (AVX2 + FMA) build on 8 lanes (the second
// prefill_impl below); head_dim 64, 128 or 256 (prefill_attention_supported); elsewhere the Python side
// keeps SDPA (pagedllm/layers/attention.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <new>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"
#include "ops.h"

namespace pagedllm {
namespace {

constexpr int64_t kTile = 16;  // queries per tile and keys per tile (one zmm of fp32 scores)
static_assert(kFoldTokens % kTile == 0, "a V chunk (ops.h) is whole key tiles");

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(int8_t x) { return static_cast<float>(x); }

// K of one prefill call transposed by tiles of kKeyTile keys, each tile's kHeadDim x kKeyTile
// floats contiguous, so that the score loop streams them in order (one row per dimension,
// context_len apart, made a tile's kHeadDim lines strided reads; bench/README.md, "Exact
// prefill attention: K packed in key tiles"): kt[((kv_head * padded / kKeyTile + pos /
// kKeyTile) * kHeadDim + d) * kKeyTile + pos % kKeyTile] for pos < context_len (the caller zeroes
// the rest). An int8 cache's codes go in as floats, their scales into k_scales[kv_head * padded
// + pos]. row_of(k_base, pos): the cache row of position pos (its block table's slot).
template <int64_t kKeyTile, int kHeadDim, typename C, typename RowOf>
void pack_key_tiles(const RowOf& row_of, const C* k_base, int64_t context_len, int64_t num_kv_heads,
                    int64_t padded, float* kt, float* k_scales) {
  constexpr int64_t kRow = kHeadDim + kv_row_extra<C>();
  at::parallel_for(0, context_len, 64, [&](int64_t begin, int64_t end) {
    for (int64_t pos = begin; pos < end; ++pos) {
      const C* row = row_of(k_base, pos);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const C* head_row = row + h * kRow;
        float* tile = kt + (h * padded / kKeyTile + pos / kKeyTile) * kHeadDim * kKeyTile + pos % kKeyTile;
        for (int d = 0; d < kHeadDim; ++d) tile[d * kKeyTile] = to_float(head_row[d]);
        if constexpr (std::is_same_v<C, int8_t>) k_scales[h * padded + pos] = kv_row_scale(head_row, kHeadDim);
      }
    }
  });
}

#if defined(__AVX512F__)
using pagedllm_vec::load16;
using pagedllm_vec::softmax_rows;
using pagedllm_vec::store16;


#if defined(__AVX512VNNI__)
constexpr bool kVnni = true;
// s[i] lane j = float(q_i . k_j) for 16 query rows of int8 codes (q_codes [16][kHeadDim],
// q_offsets[i] = 128 * sum of row i's codes) and 16 keys at kt8 (bytes k + 128, 4 dimensions
// per key, rows of 4 dimensions `padded` keys apart: kTile in the packed tiles of prefill_impl). The sums are exact, so these are bitwise
// the fp32 sums of integer products of the generic path. The accumulators are locals indexed
// by unrolled constants and VPDPBUSD is inline asm, so GCC keeps them in registers without a
// copy per instruction (csrc/w8a8.cpp); inlined into prefill_impl, it kept them on the stack.
template <int kHeadDim>
__attribute__((noinline)) void int_scores(const int8_t* q_codes, const int32_t* q_offsets,
                                          const uint8_t* kt8, int64_t padded, __m512 (&s)[kTile]) {
  __m512i acc[kTile];
#pragma GCC unroll 16
  for (int i = 0; i < kTile; ++i) acc[i] = _mm512_setzero_si512();
#pragma GCC unroll 4
  for (int d4 = 0; d4 < kHeadDim / 4; ++d4) {
    const __m512i k = _mm512_loadu_si512(kt8 + d4 * padded * 4);
#pragma GCC unroll 16
    for (int i = 0; i < kTile; ++i) {
      const __m512i q = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(q_codes + i * kHeadDim + 4 * d4));
      asm("vpdpbusd %2, %1, %0" : "+v"(acc[i]) : "v"(k), "v"(q));
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < kTile; ++i) s[i] = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i], _mm512_set1_epi32(q_offsets[i])));
}
#else
constexpr bool kVnni = false;
template <int kHeadDim>
inline void int_scores(const int8_t*, const int32_t*, const uint8_t*, int64_t, __m512 (&)[kTile]) {}
#endif

// s[i] lane j = q_i . k_j for 16 query rows (q: [16][kHeadDim] fp32) and 16 keys of K
// transposed (dimension d of key j at k[d * padded + j]; padded = kTile in prefill_impl's packed
// tiles), each sum taken in the decode kernel's
// order (paged_attention.cpp group_scores): lane l of a 16-lane partial sum adds dimensions
// l, l + 16, l + 32, ... (a multiply, then FMAs), and the 16 lanes are added as
// _mm512_reduce_add_ps and sum4 add them: (l, l + 8), then (l, l + 4), then (0, 2) and (1, 3),
// then the two. Here each lane's partial sums are a vector over the 16 keys, so that tree is
// vertical adds, with no shuffles.
template <int kHeadDim>
inline void float_scores(const float* q, const float* k, int64_t padded, __m512 (&s)[kTile]) {
  constexpr int kChunks = kHeadDim / 16;
  alignas(64) float pairs[8 * kTile * 16];  // [l][i]: lane l's partial sums of row i plus lane l + 8's
  for (int lane = 0; lane < 16; ++lane) {
    __m512 kv[kChunks];
    for (int c = 0; c < kChunks; ++c) kv[c] = _mm512_loadu_ps(k + (16 * c + lane) * padded);
    for (int i = 0; i < kTile; ++i) {
      const float* qi = q + i * kHeadDim + lane;
      __m512 part = _mm512_mul_ps(_mm512_set1_ps(qi[0]), kv[0]);
      for (int c = 1; c < kChunks; ++c) part = _mm512_fmadd_ps(_mm512_set1_ps(qi[16 * c]), kv[c], part);
      float* pair = pairs + ((lane % 8) * kTile + i) * 16;
      _mm512_store_ps(pair, lane < 8 ? part : _mm512_add_ps(_mm512_load_ps(pair), part));
    }
  }
  for (int i = 0; i < kTile; ++i) {
    __m512 quad[4];
    for (int l = 0; l < 4; ++l) {
      quad[l] = _mm512_add_ps(_mm512_load_ps(pairs + (l * kTile + i) * 16), _mm512_load_ps(pairs + ((l + 4) * kTile + i) * 16));
    }
    s[i] = _mm512_add_ps(_mm512_add_ps(quad[0], quad[2]), _mm512_add_ps(quad[1], quad[3]));
  }
}

// Rows of the output accumulator kept in registers while a key tile is added: 16 zmm.
template <int kHeadDim>
constexpr int kRowGroup = 256 / kHeadDim;

template <typename T, typename C, int kHeadDim>
void prefill_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                  const int64_t* table, int64_t context_len, float scale) {
  constexpr int kChunks = kHeadDim / 16;
  constexpr int kRows = kRowGroup<kHeadDim>;
  const int64_t q_len = query.size(0), num_heads = query.size(1);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  constexpr int64_t kRow = kHeadDim + kv_row_extra<C>();  // cache elements per KV head row
  const int64_t token_stride = num_kv_heads * kRow, block_stride = block_size * token_stride;
  const int64_t q_token_stride = query.stride(0), q_head_stride = query.stride(1);
  const int64_t first_pos = context_len - q_len;
  const int64_t padded = (context_len + kTile - 1) / kTile * kTile, key_tiles = padded / kTile;
  const C* k_base = key_cache.data_ptr<C>();
  const C* v_base = value_cache.data_ptr<C>();
  const T* q_base = query.data_ptr<T>();
  T* out_base = out.data_ptr<T>();
  auto row_of = [&](const C* base, int64_t pos) {
    return base + table[pos / block_size] * block_stride + (pos % block_size) * token_stride;
  };

  // K transposed by tiles of kTile keys (pack_key_tiles), zero past context_len. Over an int8
  // cache each query row is rounded as a cache row (quantize_kv_row of q * scale, its codes in
  // q): a score is then an fp32 sum of integer products, exact (|sum| <= 256 * 127 * 127 <
  // 2^24), times q_scale * k_scale, bitwise the decode kernel's score (paged_attention.cpp).
  constexpr bool kInt8Cache = std::is_same_v<C, int8_t>;
  // With AVX512_VNNI an int8 cache's keys go instead into kt8, as unsigned bytes k + 128 grouped
  // by 4 dimensions, in the same tiles: kt8[(((h * key_tiles + pos / kTile) * kHeadDim / 4 +
  // d / 4) * kTile + pos % kTile) * 4 + d % 4], so one 64-byte load is 16 keys x 4 dimensions
  // and one VPDPBUSD adds them times a query's 4 codes (the decode kernel's integer scores,
  // kKeyOffset = 128 * sum(q codes) subtracted per row).
  constexpr bool kIntScores = kInt8Cache && kVnni;
  std::vector<float> kt(kIntScores ? 0 : static_cast<size_t>(num_kv_heads * kHeadDim * padded), 0.f);
  std::vector<uint8_t> kt8(kIntScores ? static_cast<size_t>(num_kv_heads * kHeadDim * padded) : 0, 0x80);
  std::vector<float> k_scales(kInt8Cache ? static_cast<size_t>(num_kv_heads * padded) : 0, 0.f);
  if constexpr (kIntScores) {
    at::parallel_for(0, context_len, 64, [&](int64_t begin, int64_t end) {
      for (int64_t pos = begin; pos < end; ++pos) {
        const C* row = row_of(k_base, pos);
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const C* head_row = row + h * kRow;
          for (int d = 0; d < kHeadDim; ++d) {
            kt8[(((h * key_tiles + pos / kTile) * kHeadDim / 4 + d / 4) * kTile + pos % kTile) * 4 + d % 4] =
                static_cast<uint8_t>(head_row[d] + 128);
          }
          k_scales[h * padded + pos] = kv_row_scale(head_row, kHeadDim);
        }
      }
    });
  } else {
    pack_key_tiles<kTile, kHeadDim>(row_of, k_base, context_len, num_kv_heads, padded, kt.data(), k_scales.data());
  }

  // A (head, query tile) item's cost grows with its tile's last key (causal), so a static split
  // of the items into contiguous runs leaves one thread waiting (~10 % of a 256-token prompt's
  // call). Threads instead take items from a shared counter, the costliest tiles first.
  const int64_t tiles = (q_len + kTile - 1) / kTile, num_items = num_heads * tiles;
  std::atomic<int64_t> next_item{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    alignas(64) float q[kTile * kHeadDim];
    alignas(64) float o[kTile * kHeadDim];
    alignas(64) float oc[kTile * kHeadDim];      // a later kFoldTokens chunk's sum (ops.h)
    alignas(64) float p[kTile * kTile];          // an int8 cache: a tile's weights times V scales
    alignas(64) float v_wide[kTile * kHeadDim];  // an int8 cache: a tile's V codes as fp32
    float inv_sum[kTile], q_scales[kTile];
    int8_t q8[kHeadDim + kKvScaleBytes];
    alignas(64) int8_t q_codes[kTile * kHeadDim];  // kIntScores: the rows' codes
    int32_t q_offsets[kTile];                      // kIntScores: 128 * sum of a row's codes
    // The tile's scores, then softmax weights: row i's key j at scores[i * padded + j].
    std::vector<float> scores(static_cast<size_t>(kTile * padded));
    for (int64_t item = next_item++; item < num_items; item = next_item++) {
      const int64_t head = item % num_heads, tile = tiles - 1 - item / num_heads;
      const int64_t kv_head = head / group;
      const int64_t row0 = tile * kTile, rows = std::min(kTile, q_len - row0);
      const int64_t pos0 = first_pos + row0, last_pos = pos0 + rows - 1;
      const int64_t keys_end = (last_pos + kTile) / kTile * kTile;  // the key tiles' end
      for (int64_t i = 0; i < kTile; ++i) {
        float* qi = q + i * kHeadDim;
        const T* src = q_base + (row0 + i) * q_token_stride + head * q_head_stride;
        for (int c = 0; c < kChunks; ++c) {
          store16(qi + 16 * c, i < rows ? _mm512_mul_ps(load16(src + 16 * c), _mm512_set1_ps(scale)) : _mm512_setzero_ps());
        }
        if constexpr (kInt8Cache) {
          quantize_kv_row(q8, qi, kHeadDim);
          // The integer scores take the codes as bytes, the fp32 scores as floats.
          if constexpr (kIntScores) std::memcpy(q_codes + i * kHeadDim, q8, kHeadDim);
          __m512i sum = _mm512_setzero_si512();
          for (int c = 0; c < kChunks; ++c) {
            const __m512i codes = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q8 + 16 * c)));
            sum = _mm512_add_epi32(sum, codes);
            if constexpr (!kIntScores) _mm512_store_ps(qi + 16 * c, _mm512_cvtepi32_ps(codes));
          }
          q_offsets[i] = 128 * _mm512_reduce_add_epi32(sum);
          q_scales[i] = kv_row_scale(q8, kHeadDim);
        }
      }
      // Scores of every key tile up to the last row's position: s[i] lane j = q_i . k_(key0 + j).
      const float* k_head = kIntScores ? nullptr : kt.data() + kv_head * kHeadDim * padded;
      for (int64_t key0 = 0; key0 < keys_end; key0 += kTile) {
        __m512 s[kTile];
        if constexpr (kIntScores) {
          int_scores<kHeadDim>(q_codes, q_offsets, kt8.data() + (kv_head * padded + key0) * kHeadDim, kTile, s);
        } else {
          float_scores<kHeadDim>(q, k_head + key0 * kHeadDim, kTile, s);
        }
        if constexpr (kInt8Cache) {
          const __m512 ks = _mm512_loadu_ps(k_scales.data() + kv_head * padded + key0);
          for (int i = 0; i < kTile; ++i) s[i] = _mm512_mul_ps(s[i], _mm512_mul_ps(_mm512_set1_ps(q_scales[i]), ks));
        }
        for (int i = 0; i < kTile; ++i) _mm512_storeu_ps(scores.data() + i * padded + key0, s[i]);
      }
      // Each row's softmax over the keys it sees (0 .. its position): the decode kernel's
      // softmax_rows over the same n scores; the weights of the keys it does not see are 0.
      for (int64_t i = 0; i < kTile; ++i) {
        float* row = scores.data() + i * padded;
        const int64_t n = i < rows ? pos0 + i + 1 : 0;
        if (n > 0) softmax_rows(row, n, 1, inv_sum + i);
        std::fill(row + n, row + keys_end, 0.f);
      }
      // o = sum over keys in position order of weight * v, kRows query rows at a time in registers,
      // kFoldTokens keys at a time as the decode kernel sums them (ops.h): the first chunk's
      // sum in o, each later one's in oc, then added to o for the rows that see the chunk.
      std::fill(o, o + kTile * kHeadDim, 0.f);
      auto fold_chunk = [&](int64_t chunk_start) {
        for (int64_t i = std::max<int64_t>(0, chunk_start - pos0); i < rows; ++i) {
          for (int c = 0; c < kChunks; ++c) {
            float* oi = o + i * kHeadDim + 16 * c;
            _mm512_store_ps(oi, _mm512_add_ps(_mm512_load_ps(oi), _mm512_load_ps(oc + i * kHeadDim + 16 * c)));
          }
        }
      };
      for (int64_t key0 = 0; key0 <= last_pos; key0 += kTile) {
        if (key0 > 0 && key0 % kFoldTokens == 0) {
          if (key0 > kFoldTokens) fold_chunk(key0 - kFoldTokens);
          std::fill(oc, oc + kTile * kHeadDim, 0.f);
        }
        float* sum = key0 < kFoldTokens ? o : oc;
        const int64_t keys = std::min(kTile, last_pos + 1 - key0);
        const C* v_rows[kTile];
        alignas(64) float v_scales[kTile] = {};
        for (int64_t j = 0; j < keys; ++j) {
          v_rows[j] = row_of(v_base, key0 + j) + kv_head * kRow;
          v_scales[j] = kv_row_scale(v_rows[j], kHeadDim);
        }
        // An int8 cache: each weight times its key's V scale once (the decode kernel's fp32
        // product), and the tile's V codes widened to fp32 once (exact) for all row groups.
        const float* w = scores.data() + key0;
        int64_t w_stride = padded;
        if constexpr (kInt8Cache) {
          const __m512 vs = _mm512_load_ps(v_scales);
          for (int i = 0; i < kTile; ++i) _mm512_store_ps(p + i * kTile, _mm512_mul_ps(_mm512_loadu_ps(w + i * padded), vs));
          for (int64_t j = 0; j < keys; ++j) {
            for (int c = 0; c < kChunks; ++c) _mm512_store_ps(v_wide + j * kHeadDim + 16 * c, load16(v_rows[j] + 16 * c));
          }
          w = p;
          w_stride = kTile;
        }
        for (int r0 = 0; r0 < kTile; r0 += kRows) {
          __m512 acc[kRows * kChunks];
          for (int r = 0; r < kRows; ++r) {
            for (int c = 0; c < kChunks; ++c) acc[r * kChunks + c] = _mm512_load_ps(sum + (r0 + r) * kHeadDim + 16 * c);
          }
          for (int64_t j = 0; j < keys; ++j) {
            __m512 v[kChunks];
            for (int c = 0; c < kChunks; ++c) {
              if constexpr (kInt8Cache) v[c] = _mm512_load_ps(v_wide + j * kHeadDim + 16 * c);
              else v[c] = load16(v_rows[j] + 16 * c);
            }
            for (int r = 0; r < kRows; ++r) {
              const __m512 wv = _mm512_set1_ps(w[(r0 + r) * w_stride + j]);
              for (int c = 0; c < kChunks; ++c) acc[r * kChunks + c] = _mm512_fmadd_ps(wv, v[c], acc[r * kChunks + c]);
            }
          }
          for (int r = 0; r < kRows; ++r) {
            for (int c = 0; c < kChunks; ++c) _mm512_store_ps(sum + (r0 + r) * kHeadDim + 16 * c, acc[r * kChunks + c]);
          }
        }
      }
      if (last_pos >= kFoldTokens) fold_chunk(last_pos / kFoldTokens * kFoldTokens);
      for (int64_t i = 0; i < rows; ++i) {
        const __m512 inv = _mm512_set1_ps(inv_sum[i]);
        T* dst = out_base + ((row0 + i) * num_heads + head) * kHeadDim;
        for (int c = 0; c < kChunks; ++c) store16(dst + 16 * c, _mm512_mul_ps(_mm512_load_ps(o + i * kHeadDim + 16 * c), inv));
      }
    }
  });
}

#elif defined(__AVX2__) && defined(__FMA__)
// The x86-64-v3 build's twin of prefill_impl on 8 fp32 lanes: tiles of 8 queries and 8 keys,
// each row bitwise what the decode kernel (paged_attention.cpp, attend) gives its token.
using pagedllm_vec::load8;
using pagedllm_vec::softmax_rows;

// A std::vector allocator of 32-byte aligned storage (the packed K tiles are read by aligned loads).
template <typename E>
struct Aligned32 {
  using value_type = E;
  Aligned32() = default;
  template <typename U>
  Aligned32(const Aligned32<U>&) {}
  E* allocate(size_t n) { return static_cast<E*>(::operator new(n * sizeof(E), std::align_val_t{32})); }
  void deallocate(E* p, size_t) { ::operator delete(p, std::align_val_t{32}); }
  template <typename U>
  bool operator==(const Aligned32<U>&) const { return true; }
};

constexpr int64_t kTile8 = 8;    // keys per tile (one ymm of fp32 scores), rows per float_scores8
// Queries per work item (fewer in a shorter chunk): each K/V tile is read from L3 once for all of
// them. At 16k keys the K/V stream per query bounded the kernel: 128 queries per item ran
// 1.3-1.6x faster than 16 (docs/benchmarks/avx2-build.md, "Prefill: 128 queries per item").
constexpr int64_t kQTile8 = 128;
// A thread's scores (an item's rows x the context, fp32) are capped at 8 MiB: fewer rows per item
// past 16k keys (64 at 32k, at least 16), so the scratch grows with the context, not with it
// times 128 rows. At 2,048 x 32,768 (Llama-3.1-8B heads) 64 rows also ran 1.17-1.19x faster than
// 128, 32 rows 0.89-0.94x as fast (docs/benchmarks/avx2-build.md).
constexpr int64_t kMaxScoreBytes8 = 8 << 20;
static_assert(kFoldTokens % kTile8 == 0, "a V chunk (ops.h) is whole key tiles");


// s[i] lane j = q_i . k_j for 8 query rows (q: [8][kHeadDim] fp32) and a tile of 8 keys of K
// transposed (dimension d of key j at k[d * 8 + j]), each sum in the decode kernel's order (its
// AVX2 group_scores): lane l's partial sum adds dimensions l, l + 8, ... (a multiply, then FMAs),
// and the 8 partial sums are added as hsum8 adds them: (l, l + 4), then (l, l + 2), then (0, 1).
// Here each lane's partial sums are a vector over the 8 keys, so that tree is vertical adds. Over
// an int8 cache q and k hold codes: every partial sum is an integer below 2^24, exact, so the
// score equals the decode kernel's integer dot product.
template <int kHeadDim>
inline void float_scores8(const float* q, const float* k, __m256 (&s)[kTile8]) {
  // Lane l's partial sums for the 8 rows at once: each K vector loaded once for all of them.
  alignas(32) float part[8][kTile8][8];
  for (int l = 0; l < 8; ++l) {
    __m256 acc[kTile8];
    const __m256 k0 = _mm256_load_ps(k + l * kTile8);
#pragma GCC unroll 8
    for (int i = 0; i < kTile8; ++i) acc[i] = _mm256_mul_ps(_mm256_broadcast_ss(q + i * kHeadDim + l), k0);
    for (int c = 1; c < kHeadDim / 8; ++c) {
      const __m256 kc = _mm256_load_ps(k + (8 * c + l) * kTile8);
#pragma GCC unroll 8
      for (int i = 0; i < kTile8; ++i) {
        acc[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(q + i * kHeadDim + 8 * c + l), kc, acc[i]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < kTile8; ++i) _mm256_store_ps(part[l][i], acc[i]);
  }
  for (int i = 0; i < kTile8; ++i) {
    __m256 x[4];
    for (int l = 0; l < 4; ++l) x[l] = _mm256_add_ps(_mm256_load_ps(part[l][i]), _mm256_load_ps(part[l + 4][i]));
    s[i] = _mm256_add_ps(_mm256_add_ps(x[0], x[2]), _mm256_add_ps(x[1], x[3]));
  }
}

template <typename T, typename C, int kHeadDim>
void prefill_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                  const int64_t* table, int64_t context_len, float scale) {
  const int64_t q_len = query.size(0), num_heads = query.size(1);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  constexpr int64_t kRow = kHeadDim + kv_row_extra<C>();
  const int64_t token_stride = num_kv_heads * kRow, block_stride = block_size * token_stride;
  const int64_t q_token_stride = query.stride(0), q_head_stride = query.stride(1);
  const int64_t first_pos = context_len - q_len;
  const int64_t padded = (context_len + kTile8 - 1) / kTile8 * kTile8;
  const C* k_base = key_cache.data_ptr<C>();
  const C* v_base = value_cache.data_ptr<C>();
  const T* q_base = query.data_ptr<T>();
  T* out_base = out.data_ptr<T>();
  auto row_of = [&](const C* base, int64_t pos) {
    return base + table[pos / block_size] * block_stride + (pos % block_size) * token_stride;
  };
  // K transposed by tiles of 8 keys (pack_key_tiles), zero past context_len.
  constexpr bool kInt8Cache = std::is_same_v<C, int8_t>;
  std::vector<float, Aligned32<float>> kt(static_cast<size_t>(num_kv_heads * kHeadDim * padded), 0.f);
  std::vector<float> k_scales(kInt8Cache ? static_cast<size_t>(num_kv_heads * padded) : 0, 0.f);
  pack_key_tiles<kTile8, kHeadDim>(row_of, k_base, context_len, num_kv_heads, padded, kt.data(), k_scales.data());

  // Items (head, query tile) from a shared counter, the costliest tiles first (as prefill_impl).
  // A multiple of 8, at most kMaxScoreBytes8 of scores, halved (down to 16) while there would be
  // fewer than 4 items per thread.
  auto round8 = [](int64_t n) { return (n + kTile8 - 1) / kTile8 * kTile8; };
  const int64_t row_cap = std::max<int64_t>(16, kMaxScoreBytes8 / (padded * 4) / kTile8 * kTile8);
  int64_t tile_rows = std::min({kQTile8, round8(q_len), row_cap});
  while (tile_rows > 16 && num_heads * ((q_len + tile_rows - 1) / tile_rows) < 4 * at::get_num_threads()) {
    tile_rows = std::max<int64_t>(16, round8(tile_rows / 2));
  }
  const int64_t tiles = (q_len + tile_rows - 1) / tile_rows, num_items = num_heads * tiles;
  std::atomic<int64_t> next_item{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    const size_t tile_size = static_cast<size_t>(tile_rows * kHeadDim);
    std::vector<float, Aligned32<float>> q_rows(tile_size), o_rows(tile_size), oc_rows(tile_size);
    float *q = q_rows.data(), *o = o_rows.data();
    float* oc = oc_rows.data();  // a later kFoldTokens chunk's sum (ops.h)
    std::vector<float> inv_sum(tile_rows), q_scales(tile_rows);
    int8_t q8[kHeadDim + kKvScaleBytes];
    // The tile's scores, then softmax weights: row i's key j at scores[i * padded + j].
    std::vector<float> scores(static_cast<size_t>(tile_rows * padded));
    for (int64_t item = next_item++; item < num_items; item = next_item++) {
      const int64_t head = item % num_heads, tile = tiles - 1 - item / num_heads;
      const int64_t kv_head = head / group;
      const int64_t row0 = tile * tile_rows, rows = std::min(tile_rows, q_len - row0);
      const int64_t pos0 = first_pos + row0, last_pos = pos0 + rows - 1;
      const int64_t keys_end = (last_pos + kTile8) / kTile8 * kTile8;
      for (int64_t i = 0; i < round8(rows); ++i) {  // rows are scored 8 at a time
        float* qi = q + i * kHeadDim;
        const T* src = q_base + (row0 + i) * q_token_stride + head * q_head_stride;
        for (int d = 0; d < kHeadDim; ++d) qi[d] = i < rows ? to_float(src[d]) * scale : 0.f;
        if constexpr (kInt8Cache) {  // rounded as a cache row; its codes are the scores' operands
          quantize_kv_row(q8, qi, kHeadDim);
          for (int d = 0; d < kHeadDim; ++d) qi[d] = q8[d];
          q_scales[i] = kv_row_scale(q8, kHeadDim);
        }
      }
      // Scores of every key tile up to each group of 8 rows' last position (the later ones are
      // masked: the softmax below fills them with 0).
      const float* k_head = kt.data() + kv_head * kHeadDim * padded;
      for (int64_t key0 = 0; key0 < keys_end; key0 += kTile8) {
        for (int64_t i0 = std::max<int64_t>(0, key0 - pos0) / kTile8 * kTile8; i0 < rows; i0 += kTile8) {
          __m256 s[kTile8];
          float_scores8<kHeadDim>(q + i0 * kHeadDim, k_head + key0 * kHeadDim, s);
          if constexpr (kInt8Cache) {
            const __m256 ks = _mm256_loadu_ps(k_scales.data() + kv_head * padded + key0);
            for (int i = 0; i < kTile8; ++i) {
              s[i] = _mm256_mul_ps(s[i], _mm256_mul_ps(_mm256_set1_ps(q_scales[i0 + i]), ks));
            }
          }
          for (int i = 0; i < kTile8; ++i) _mm256_storeu_ps(scores.data() + (i0 + i) * padded + key0, s[i]);
        }
      }
      for (int64_t i = 0; i < rows; ++i) {
        float* row = scores.data() + i * padded;
        const int64_t n = pos0 + i + 1;
        softmax_rows(row, n, 1, inv_sum.data() + i);
        std::fill(row + n, row + keys_end, 0.f);
      }
      // The weighted sum in position order, kFoldTokens keys at a time (as prefill_impl), each
      // row's 64 values at a time in registers; an int8 cache's weights times the row's scale.
      std::fill(o, o + rows * kHeadDim, 0.f);
      auto fold_chunk = [&](int64_t chunk_start) {
        for (int64_t i = std::max<int64_t>(0, chunk_start - pos0); i < rows; ++i) {
          for (int d = 0; d < kHeadDim; d += 8) {
            float* oi = o + i * kHeadDim + d;
            _mm256_store_ps(oi, _mm256_add_ps(_mm256_load_ps(oi), _mm256_load_ps(oc + i * kHeadDim + d)));
          }
        }
      };
      for (int64_t key0 = 0; key0 <= last_pos; key0 += kTile8) {
        if (key0 > 0 && key0 % kFoldTokens == 0) {
          if (key0 > kFoldTokens) fold_chunk(key0 - kFoldTokens);
          std::fill(oc, oc + rows * kHeadDim, 0.f);
        }
        float* sum = key0 < kFoldTokens ? o : oc;
        const int64_t keys = std::min(kTile8, last_pos + 1 - key0);
        const C* v_rows[kTile8];
        float v_scales[kTile8];
        for (int64_t j = 0; j < keys; ++j) {
          v_rows[j] = row_of(v_base, key0 + j) + kv_head * kRow;
          v_scales[j] = kv_row_scale(v_rows[j], kHeadDim);
        }
        for (int64_t i = std::max<int64_t>(0, key0 - pos0); i < rows; ++i) {  // rows seeing a key of it
          const float* w = scores.data() + i * padded + key0;
          float wv[kTile8];
          for (int64_t j = 0; j < keys; ++j) wv[j] = kInt8Cache ? w[j] * v_scales[j] : w[j];
          for (int s0 = 0; s0 < kHeadDim; s0 += 64) {
            float* a_out = sum + i * kHeadDim + s0;
            __m256 a[8];
#pragma GCC unroll 8
            for (int r = 0; r < 8; ++r) a[r] = _mm256_load_ps(a_out + 8 * r);
            for (int64_t j = 0; j < keys; ++j) {
              const __m256 p = _mm256_set1_ps(wv[j]);
#pragma GCC unroll 8
              for (int r = 0; r < 8; ++r) a[r] = _mm256_fmadd_ps(p, load8(v_rows[j] + s0 + 8 * r), a[r]);
            }
#pragma GCC unroll 8
            for (int r = 0; r < 8; ++r) _mm256_store_ps(a_out + 8 * r, a[r]);
          }
        }
      }
      if (last_pos >= kFoldTokens) fold_chunk(last_pos / kFoldTokens * kFoldTokens);
      for (int64_t i = 0; i < rows; ++i) {
        T* dst = out_base + ((row0 + i) * num_heads + head) * kHeadDim;
        for (int d = 0; d < kHeadDim; ++d) dst[d] = static_cast<T>(o[i * kHeadDim + d] * inv_sum[i]);
      }
    }
  });
}
#endif  // __AVX512F__, or AVX2 + FMA

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
template <typename T, typename C>
void dispatch(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
              const int64_t* table, int64_t context_len, float scale) {
  switch (query.size(2)) {
    case 64: return prefill_impl<T, C, 64>(out, query, key_cache, value_cache, table, context_len, scale);
    case 128: return prefill_impl<T, C, 128>(out, query, key_cache, value_cache, table, context_len, scale);
    default: return prefill_impl<T, C, 256>(out, query, key_cache, value_cache, table, context_len, scale);
  }
}
#endif

}  // namespace

bool prefill_attention_supported(int64_t head_dim) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
#else
  (void)head_dim;
  return false;
#endif
}

// The argument checks both prefill kernels share (ops.h); ValueError on a bad one.
void check_prefill_arguments(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_table, int64_t context_len) {
  TORCH_CHECK_VALUE(query.dim() == 3 && query.stride(2) == 1, "query must be [q_len, heads, head_dim] with contiguous head_dim");
  const bool int8_cache = key_cache.scalar_type() == at::kChar;
  TORCH_CHECK_VALUE(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.dim() == 4 &&
                        key_cache.sizes() == value_cache.sizes() &&
                        key_cache.size(3) == query.size(2) + (int8_cache ? kKvScaleBytes : 0),
                    "K/V caches must be contiguous [num_blocks, block_size, kv_heads, head_dim] of one shape "
                    "(head_dim + 4 in an int8 cache)");
  TORCH_CHECK_VALUE(query.size(1) % key_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK_VALUE(key_cache.scalar_type() == value_cache.scalar_type() &&
                        (key_cache.scalar_type() == query.scalar_type() || key_cache.scalar_type() == at::kBFloat16 ||
                         int8_cache),
                    "K/V caches must share one dtype: the query's, bfloat16 or int8");
  const int64_t block_size = key_cache.size(1);
  TORCH_CHECK_VALUE(block_table.scalar_type() == at::kLong && block_table.is_contiguous() && block_table.dim() == 1,
                    "block_table must be contiguous int64 [blocks]");
  TORCH_CHECK_VALUE(query.size(0) >= 1 && context_len >= query.size(0) &&
                        context_len <= block_table.size(0) * block_size,
                    "context_len ", context_len, " must be in [q_len = ", query.size(0), ", ",
                    block_table.size(0) * block_size, "] (block_table entries x block_size)");
  const int64_t* table = block_table.data_ptr<int64_t>();
  for (int64_t b = 0; b < (context_len + block_size - 1) / block_size; ++b) {
    TORCH_CHECK_VALUE(table[b] >= 0 && table[b] < key_cache.size(0), "block_table[", b, "] = ", table[b],
                      " is outside [0, ", key_cache.size(0), ")");
  }
}

at::Tensor paged_prefill_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                   const at::Tensor& block_table, int64_t context_len, double scale) {
  check_prefill_arguments(query, key_cache, value_cache, block_table, context_len);
  TORCH_CHECK_VALUE(prefill_attention_supported(query.size(2)),
                    "paged_prefill_attention: head_dim ", query.size(2), " is not supported by this build");
  auto out = at::empty({query.size(0), query.size(1), query.size(2)}, query.options());
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const bool int8_cache = key_cache.scalar_type() == at::kChar;
  const int64_t* table = block_table.data_ptr<int64_t>();
  const float s = static_cast<float>(scale);
  if (int8_cache && query.scalar_type() == at::kFloat) {
    dispatch<float, int8_t>(out, query, key_cache, value_cache, table, context_len, s);
  } else if (int8_cache) {
    TORCH_CHECK_VALUE(query.scalar_type() == at::kBFloat16, "paged_prefill_attention supports float32 and bfloat16");
    dispatch<c10::BFloat16, int8_t>(out, query, key_cache, value_cache, table, context_len, s);
  } else if (query.scalar_type() == at::kFloat && key_cache.scalar_type() == at::kFloat) {
    dispatch<float, float>(out, query, key_cache, value_cache, table, context_len, s);
  } else if (query.scalar_type() == at::kFloat) {
    dispatch<float, c10::BFloat16>(out, query, key_cache, value_cache, table, context_len, s);
  } else {
    TORCH_CHECK_VALUE(query.scalar_type() == at::kBFloat16, "paged_prefill_attention supports float32 and bfloat16");
    dispatch<c10::BFloat16, c10::BFloat16>(out, query, key_cache, value_cache, table, context_len, s);
  }
#endif
  return out;
}

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("prefill_attention_supported(int head_dim) -> bool", &pagedllm::prefill_attention_supported);
  m.def("paged_prefill_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, "
        "int context_len, float scale) -> Tensor",
        &pagedllm::paged_prefill_attention);
}
