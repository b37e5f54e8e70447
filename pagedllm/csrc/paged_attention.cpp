// Decode attention that reads K/V in place through the block table (PagedAttention, Kwon et al.
// 2023, section 4.1; the work split mirrors vLLM's csrc/cpu/attention.cpp paged_attention_v1:
// one work item per (sequence, KV head), so each K/V row is loaded once for all query heads of
// its group).
//
// Built on first use by pagedllm/layers/attention.py through torch.utils.cpp_extension; the
// pure-torch paged_decode_attention_torch there is the reference the tests compare against.
//
// Layouts (all row-major):
//   query        [num_seqs, num_heads, head_dim]   (head_dim contiguous; other strides free)
//   key/value    [num_blocks, block_size, num_kv_heads, head_dim] contiguous, the query's dtype
//                or bfloat16 under an fp32 query (kv_cache_dtype="bfloat16": half the bytes);
//                or int8 rows of head_dim + 4 (kv_cache_dtype="int8": codes, then their fp32
//                scale; ops.h), whose scale multiplies each score and each softmax weight;
//                over an int8 cache each query head is rounded as a cache row (q * scale to
//                int8 codes and a scale) and its scores are integer dot products
//                (group_scores_int8)
//   block_tables [num_seqs, max_blocks] int64, context_lens [num_seqs] int64
//   sliding_window > 0: each query attends to the last sliding_window tokens of its context only
//                (positions context_len - sliding_window .. context_len - 1, as HF's
//                sliding_window_overlay: kv_idx > q_idx - sliding_window); 0: all of them
//   out          [num_seqs, num_heads, head_dim] contiguous, the query's dtype
// The weighted sum is accumulated in fp32 whatever the storage dtype, and so are the scores
// except over an int8 cache (int32, exact).

// Only ATen and the op registry are included (not torch/extension.h, which pulls in pybind11,
// autograd and torch::nn): the first-use build then takes ~4x less compiler time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"
#include "ops.h"

namespace pagedllm {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(int8_t x) { return static_cast<float>(x); }

// Calls f(row, next, first, count) for the blocks holding tokens start .. context_len - 1 of one
// KV head's cached context (base points at the head's first element in block 0): row points at
// the head's row of the block's first token in that range, next at its first row in the next
// block (this block again for the last), first is that token's index counted from start, count
// the block's tokens in the range. Blocks wholly before start (outside a sliding window) are
// not read.
template <typename T, typename F>
inline void for_each_cached_block(const T* base, const int64_t* table, int64_t start, int64_t context_len,
                                  int64_t block_size, int64_t block_stride, int64_t token_stride, F&& f) {
  const int64_t used_blocks = (context_len + block_size - 1) / block_size;
  for (int64_t b = start / block_size; b < used_blocks; ++b) {
    const int64_t first = std::max(start, b * block_size);
    const T* block = base + table[b] * block_stride;
    const T* next = b + 1 < used_blocks ? base + table[b + 1] * block_stride : block;
    f(block + (first - b * block_size) * token_stride, next, first - start,
      std::min((b + 1) * block_size, context_len) - first);
  }
}

// Blocks are scattered, so the hardware prefetcher cannot run ahead of a block walk: with each
// row of a block the loops below prefetch the same slot's row of the next block. Spread so, one
// row at a time, the loads stay ahead without a burst of a whole block's rows (a burst at each
// block's start measured 12-17 % slower from L3 and DRAM, no prefetch 20-25 % slower;
// bench/README.md, sixth round). The rows are prefetched into L2 (PREFETCHT2), not L1: an L1
// prefetch holds one of the core's few L1 miss buffers until its line arrives, which capped a
// DRAM-bound walk at ~12 GB/s on Zen 4; into L2, 1.5-1.8x faster at 16k-32k tokens and 1.25-1.5x
// at batch 64 (bench/README.md, "Decode attention prefetches into L2").
template <typename T>
inline void prefetch_row(const T* row, int64_t row_bytes) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(bytes + off, 0, 1);
}

// Sequences per thread from which a decode batch is split by sequence, not by KV head.
constexpr int64_t kSeqsPerThread = 4;

// Chunks per thread each sequence needs before a batch of few sequences is split by context,
// and with grouped queries (several query heads per KV head) the tokens it needs.
constexpr int64_t kMinChunksPerThread = 2;
constexpr int64_t kMinGroupedSplitTokens = 4096;

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// The vector paths: AVX-512 where the build has AVX-512F and head_dim is a multiple of 16 (of 64
// over an int8 cache), the x86-64-v3 build's AVX2 + FMA on 8 lanes where head_dim is a multiple of
// 64. Both compute every score, softmax and weighted sum in the same order whatever the work
// split, and each build's exact prefill kernel (prefill_attention.cpp) computes its rows so too.
// Per group of up to kMaxGroup query heads sharing a KV head: every K row is loaded once and
// dotted with all the group's queries, the softmax is exponentiated a vector of scores at a
// time, and every V row is loaded once and accumulated into all the group's outputs. Measured
// 1.6x faster than the scalar path on a cold cache (bench/README.md), ~1.8x faster again after
// the sixth round's changes (row-spread prefetch, accumulators kept in registers per block); the
// AVX2 build's 1.6-3.4x (docs/benchmarks/avx2-build.md).
//
// Three work splits share these pieces (bitwise the same results: every score, sum and
// accumulation happens in the same order, the weighted sum folded by kFoldTokens chunks, ops.h):
//   - one item per (sequence, KV head) when there are few sequences (a batch-1 decode still
//     uses both cores): an item reads its head's part of every token row, head_dim elements
//     of a num_kv_heads * head_dim row;
//   - few sequences of kMinChunksPerThread chunks per thread or more (grouped queries: of
//     kMinGroupedSplitTokens or more): each thread walks a run of every sequence's blocks for
//     all KV heads (split_context_attention). With SmolLM2-1.7B's 32 KV heads of 64 (an item
//     per head reads 128 B of each 4 KiB row) 1.3-1.5x faster at 4k tokens, alike at 1k and
//     16k (bench/README.md, "Decode attention split by context"); with Llama-3-8B's 8 KV heads
//     of 128 and 4 query heads each 1.1-1.25x faster from 8k tokens, alike at 4k, 5-10 %
//     slower from cache at 1k-2k (bench/README.md, "Decode attention: prefetches spread over a
//     block's KV heads");
//   - one item per sequence otherwise: the item walks each block once for all KV heads, so
//     memory is read in whole contiguous blocks (a third of every row at a time measured 1.4x
//     slower at batch 64 with SmolLM2's 3 KV heads and blocks in allocation order; alike with
//     randomly scattered blocks; bench/README.md, "Zen 4 profile").

constexpr int kMaxGroup = 4;

// Calls f(std::integral_constant<int, G>) for the group chunk size G = min(kMaxGroup, left).
template <typename F>
inline void with_group(int64_t left, F&& f) {
  switch (std::min<int64_t>(kMaxGroup, left)) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

// Pieces of one sequence's attention, for the query heads kv_head_begin * group ..
// kv_head_end * group - 1 (a KV head range). q: the sequence's first query head; k/v_base: the
// cache's first element (block 0, KV head 0); start: the first attended position (0, or the
// sliding window's start); scores: one row of n = context_len - start per query head of the
// range, indexed by position - start.
struct HeadRange {
  int64_t group, kv_head_begin, kv_head_end;
  int64_t first_head() const { return kv_head_begin * group; }
  int64_t heads() const { return (kv_head_end - kv_head_begin) * group; }
};

// acc[i] += part[i] for i < size (the fold of a kFoldTokens chunk's weighted sum into the total;
// each element one add, so the compiler's vectors give the same bits).
inline void fold_into(float* acc, const float* part, int64_t size) {
  for (int64_t i = 0; i < size; ++i) acc[i] += part[i];
}
#endif  // a vector build

#if defined(__AVX512F__)
using pagedllm_vec::load16;
using pagedllm_vec::softmax_rows;

// The lane sums of four vectors, [sum(a0), sum(a1), sum(a2), sum(a3)]: a transpose-and-add tree
// of 13 shuffles and adds, where four _mm512_reduce_add_ps take 32 (the score loop below was
// bound by those reductions, bench/README.md "Zen 4 profile").
inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  // 512 -> 256 bits: lanes 0-7 of c01 hold a0's halves added, lanes 8-15 a1's.
  const __m512 c01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
  const __m512 c23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
  // 256 -> 128 bits: 128-bit lane i holds four partial sums of a_i.
  const __m512 d = _mm512_add_ps(_mm512_shuffle_f32x4(c01, c23, 0x88), _mm512_shuffle_f32x4(c01, c23, 0xDD));
  // Within each 128-bit lane: element 0 becomes the lane's sum.
  const __m512 e = _mm512_add_ps(d, _mm512_permute_ps(d, 0x4E));
  const __m512 f = _mm512_add_ps(e, _mm512_permute_ps(e, 0xB1));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), f));
}

// Scores of kGroup query heads (consecutive, one KV head's) for `count` token rows of a block:
// scores[g * n + slot] = q_g . k_slot, q_g the scaled query at q + g * kHeadDim (fp32; a float or
// bfloat16 cache, group_scores_int8 below takes an int8 one). rows: the KV head's part of the
// first row; next: the same row of the next block, prefetched `prefetch_bytes` per row. Rows go
// four at a time (their dot products summed by sum4), the last count % 4 one at a time.
template <typename C, int kHeadDim, int kGroup>
inline void group_scores(const float* q, const C* rows, const C* next, int64_t count, int64_t token_stride,
                         int64_t prefetch_bytes, float* scores, int64_t n) {
  constexpr int kChunks = kHeadDim / 16;
  __m512 qv[kGroup][kChunks];
  for (int g = 0; g < kGroup; ++g) {
    for (int c = 0; c < kChunks; ++c) qv[g][c] = _mm512_loadu_ps(q + g * kHeadDim + 16 * c);
  }
  // q_g . k over head_dim as 16 lane partial sums.
  auto dot = [&](int g, const __m512* kv) {
    __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
    for (int c = 1; c < kChunks; ++c) acc = _mm512_fmadd_ps(qv[g][c], kv[c], acc);
    return acc;
  };
  int64_t slot = 0;
  for (; slot + 4 <= count; slot += 4) {
    __m512 acc[kGroup][4];
    for (int r = 0; r < 4; ++r) {
      prefetch_row(next + (slot + r) * token_stride, prefetch_bytes);
      const C* k = rows + (slot + r) * token_stride;
      __m512 kv[kChunks];
      for (int c = 0; c < kChunks; ++c) kv[c] = load16(k + 16 * c);
      for (int g = 0; g < kGroup; ++g) acc[g][r] = dot(g, kv);
    }
    for (int g = 0; g < kGroup; ++g) _mm_storeu_ps(scores + g * n + slot, sum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
  }
  for (; slot < count; ++slot) {
    prefetch_row(next + slot * token_stride, prefetch_bytes);
    const C* k = rows + slot * token_stride;
    __m512 kv[kChunks];
    for (int c = 0; c < kChunks; ++c) kv[c] = load16(k + 16 * c);
    for (int g = 0; g < kGroup; ++g) scores[g * n + slot] = _mm512_reduce_add_ps(dot(g, kv));
  }
}

#if defined(__AVX512BW__)
// Scores over an int8 cache (kv_cache_dtype="int8") in integers. The query heads were rounded
// as cache rows are (quantize_kv_row of q * scale: int8 codes and one fp32 scale per head; as
// llama.cpp rounds its queries to Q8_0 for a Q8_0 K cache), so q . k is a sum of int8 products,
// exact in int32, and score = float(sum) * (q_scale * k_scale). With AVX512_VNNI one VPDPBUSD
// does 64 multiply-adds: its unsigned operand is the key read as k ^ 0x80 = k + 128 (one XOR
// per row, shared by the group's heads), which adds 128 * sum(q codes) to every dot product
// (kKeyOffset; subtracted once per head). Without VNNI both are widened to int16 and
// multiplied by VPMADDWD. Either way every sum is exact, so the scores are bitwise those of the
// generic path below and of the prefill kernel's.
#if defined(__AVX512VNNI__)
constexpr int32_t kKeyOffset = 128;
struct Int8Chunk { __m512i v; };  // 64 codes: a key's as k + 128 (unsigned), a query's as they are
inline Int8Chunk key_chunk(const int8_t* k) {
  return {_mm512_xor_si512(_mm512_loadu_si512(k), _mm512_set1_epi8(static_cast<char>(0x80)))};
}
inline Int8Chunk query_chunk(const int8_t* q) { return {_mm512_loadu_si512(q)}; }
inline __m512i dot_chunk(__m512i acc, Int8Chunk k, Int8Chunk q) { return _mm512_dpbusd_epi32(acc, k.v, q.v); }
#else
constexpr int32_t kKeyOffset = 0;
struct Int8Chunk { __m512i lo, hi; };  // 64 codes widened to int16
inline Int8Chunk widen_chunk(const int8_t* p) {
  const __m512i v = _mm512_loadu_si512(p);
  return {_mm512_cvtepi8_epi16(_mm512_castsi512_si256(v)), _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(v, 1))};
}
inline Int8Chunk key_chunk(const int8_t* k) { return widen_chunk(k); }
inline Int8Chunk query_chunk(const int8_t* q) { return widen_chunk(q); }
inline __m512i dot_chunk(__m512i acc, Int8Chunk k, Int8Chunk q) {
  return _mm512_add_epi32(acc, _mm512_add_epi32(_mm512_madd_epi16(k.lo, q.lo), _mm512_madd_epi16(k.hi, q.hi)));
}
#endif

// sum4 on int32 lanes: [sum(a0), sum(a1), sum(a2), sum(a3)].
inline __m128i sum4_epi32(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
  const __m512i c01 = _mm512_add_epi32(_mm512_shuffle_i32x4(a0, a1, 0x44), _mm512_shuffle_i32x4(a0, a1, 0xEE));
  const __m512i c23 = _mm512_add_epi32(_mm512_shuffle_i32x4(a2, a3, 0x44), _mm512_shuffle_i32x4(a2, a3, 0xEE));
  const __m512i d = _mm512_add_epi32(_mm512_shuffle_i32x4(c01, c23, 0x88), _mm512_shuffle_i32x4(c01, c23, 0xDD));
  const __m512i e = _mm512_add_epi32(d, _mm512_shuffle_epi32(d, static_cast<_MM_PERM_ENUM>(0x4E)));
  const __m512i f = _mm512_add_epi32(e, _mm512_shuffle_epi32(e, static_cast<_MM_PERM_ENUM>(0xB1)));
  return _mm512_castsi512_si128(_mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), f));
}

// group_scores over an int8 cache: q holds kGroup rounded query rows (codes, then the fp32
// scale; q_row apart), q_offset[g] = kKeyOffset * the sum of head g's codes.
template <int kHeadDim, int kGroup>
inline void group_scores_int8(const int8_t* q, int64_t q_row, const int32_t* q_offset, const int8_t* rows,
                              const int8_t* next, int64_t count, int64_t token_stride, int64_t prefetch_bytes,
                              float* scores, int64_t n) {
  constexpr int kChunks = kHeadDim / 64;
  Int8Chunk qv[kGroup][kChunks];
  float q_scale[kGroup];
  for (int g = 0; g < kGroup; ++g) {
    for (int c = 0; c < kChunks; ++c) qv[g][c] = query_chunk(q + g * q_row + 64 * c);
    q_scale[g] = kv_row_scale(q + g * q_row, kHeadDim);
  }
  auto dot = [&](int g, const Int8Chunk* kv) {
    __m512i acc = dot_chunk(_mm512_setzero_si512(), kv[0], qv[g][0]);
    for (int c = 1; c < kChunks; ++c) acc = dot_chunk(acc, kv[c], qv[g][c]);
    return acc;
  };
  int64_t slot = 0;
  for (; slot + 4 <= count; slot += 4) {
    for (int r = 0; r < 4; ++r) prefetch_row(next + (slot + r) * token_stride, prefetch_bytes);
    // Fully unrolled, so that the 4 x kGroup accumulators stay in registers (GCC kept the
    // array in memory otherwise and reloaded it for the reductions).
    __m512i acc[kGroup][4];
    alignas(16) float row_scales[4];
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const int8_t* k = rows + (slot + r) * token_stride;
      Int8Chunk kv[kChunks];
#pragma GCC unroll 4
      for (int c = 0; c < kChunks; ++c) kv[c] = key_chunk(k + 64 * c);
      row_scales[r] = kv_row_scale(k, kHeadDim);
#pragma GCC unroll 4
      for (int g = 0; g < kGroup; ++g) acc[g][r] = dot(g, kv);
    }
    const __m128 k_scales = _mm_load_ps(row_scales);
#pragma GCC unroll 4
    for (int g = 0; g < kGroup; ++g) {
      const __m128i sums = _mm_sub_epi32(sum4_epi32(acc[g][0], acc[g][1], acc[g][2], acc[g][3]),
                                         _mm_set1_epi32(q_offset[g]));
      _mm_storeu_ps(scores + g * n + slot, _mm_mul_ps(_mm_cvtepi32_ps(sums), _mm_mul_ps(_mm_set1_ps(q_scale[g]), k_scales)));
    }
  }
  for (; slot < count; ++slot) {
    prefetch_row(next + slot * token_stride, prefetch_bytes);
    const int8_t* k = rows + slot * token_stride;
    Int8Chunk kv[kChunks];
    for (int c = 0; c < kChunks; ++c) kv[c] = key_chunk(k + 64 * c);
    const float k_scale = kv_row_scale(k, kHeadDim);
    for (int g = 0; g < kGroup; ++g) {
      const int32_t sum = _mm512_reduce_add_epi32(dot(g, kv)) - q_offset[g];
      scores[g * n + slot] = static_cast<float>(sum) * (q_scale[g] * k_scale);
    }
  }
}
#endif  // __AVX512BW__

// acc[g * kHeadDim ..] += sum over `count` rows of p[g * n + slot] * v_slot, for kGroup heads
// (p times the row's scale in an int8 cache).
// The accumulators live in registers for the block (indexed [g][c] in place, GCC kept them in
// memory and stored all of them after every row: 2x slower). A bf16 row is widened 32 values
// at a time: the low half of each 32-bit pair shifted up is the even element as fp32, the pair
// with its low half cleared the odd one (2 instructions per 32 values where VPMOVZXWD and a
// shift take 4, and 3 temporaries, so the 24 accumulators of a group of 3 heads of 128 stay in
// registers). Its accumulators then hold, per 32 values, the 16 even ones and then the 16 odd
// ones (interleave_pairs puts them back in order); each value's sum runs over the rows in the
// same order as the other dtypes', so the result is bitwise the same.
template <typename C, int kHeadDim, int kGroup>
inline void group_accumulate(const float* p, int64_t n, const C* rows, const C* next, int64_t count,
                             int64_t token_stride, int64_t prefetch_bytes, float* acc) {
  constexpr int kChunks = kHeadDim / 16;
  __m512 a[kGroup * kChunks];
  // Fully unrolled: as a loop GCC turns these copies into REP MOVSQ through a stack copy,
  // measured as a fifth of this function's time at 16-token blocks.
#pragma GCC unroll 64
  for (int i = 0; i < kGroup * kChunks; ++i) a[i] = _mm512_loadu_ps(acc + 16 * i);
  for (int64_t slot = 0; slot < count; ++slot) {
    prefetch_row(next + slot * token_stride, prefetch_bytes);
    const C* v = rows + slot * token_stride;
    const float row_scale = kv_row_scale(v, kHeadDim);
    __m512 w[kGroup];
    for (int g = 0; g < kGroup; ++g) {
      w[g] = _mm512_set1_ps(kv_row_extra<C>() > 0 ? p[g * n + slot] * row_scale : p[g * n + slot]);
    }
    if constexpr (std::is_same_v<C, c10::BFloat16> && kChunks % 2 == 0) {
#pragma GCC unroll 8
      for (int c = 0; c < kChunks; c += 2) {
        const __m512i pairs = _mm512_loadu_si512(v + 16 * c);
        const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
        const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(-65536)));
#pragma GCC unroll 4
        for (int g = 0; g < kGroup; ++g) {
          a[g * kChunks + c] = _mm512_fmadd_ps(w[g], even, a[g * kChunks + c]);
          a[g * kChunks + c + 1] = _mm512_fmadd_ps(w[g], odd, a[g * kChunks + c + 1]);
        }
      }
    } else {
      __m512 vv[kChunks];
      for (int c = 0; c < kChunks; ++c) vv[c] = load16(v + 16 * c);
      for (int g = 0; g < kGroup; ++g) {
        for (int c = 0; c < kChunks; ++c) a[g * kChunks + c] = _mm512_fmadd_ps(w[g], vv[c], a[g * kChunks + c]);
      }
    }
  }
#pragma GCC unroll 64
  for (int i = 0; i < kGroup * kChunks; ++i) _mm512_storeu_ps(acc + 16 * i, a[i]);
}

// One head's accumulators for 32 values of a bf16 cache's rows (group_accumulate: the 16 even

// values, then the 16 odd ones) back in order, as the values 0-15 and 16-31.
inline void interleave_pairs(__m512 even, __m512 odd, __m512& lo, __m512& hi) {
  lo = _mm512_permutex2var_ps(even, _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23), odd);
  hi = _mm512_permutex2var_ps(even, _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31),
                              odd);
}

// [num_heads, kHeadDim]; a bf16 cache's accumulators back in order by interleave_pairs).
template <typename T, typename C, int kHeadDim>
void store_heads(const float* acc, const float* inv_sum, HeadRange r, T* out) {
  for (int64_t head = 0; head < r.heads(); ++head) {
    T* o = out + (r.first_head() + head) * kHeadDim;
    const __m512 inv = _mm512_set1_ps(inv_sum[head]);
    const float* a = acc + head * kHeadDim;
    if constexpr (std::is_same_v<C, c10::BFloat16> && kHeadDim % 32 == 0) {
      for (int c = 0; c < kHeadDim / 16; c += 2) {
        __m512 lo, hi;
        interleave_pairs(_mm512_loadu_ps(a + 16 * c), _mm512_loadu_ps(a + 16 * c + 16), lo, hi);
        pagedllm_vec::store16(o + 16 * c, _mm512_mul_ps(lo, inv));
        pagedllm_vec::store16(o + 16 * c + 16, _mm512_mul_ps(hi, inv));
      }
    } else {
      for (int c = 0; c < kHeadDim / 16; ++c) pagedllm_vec::store16(o + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(a + 16 * c), inv));
    }
  }
}

// One sequence's attention for a KV head range, in one thread: scores of every position,

#elif defined(__AVX2__) && defined(__FMA__)
using pagedllm_vec::hsum8;
using pagedllm_vec::load8;
using pagedllm_vec::softmax_rows;

// group_scores on 8 lanes: each sum over kHeadDim as 8 lane partial sums (lane l adds dimensions
// l, l + 8, ...: a multiply, then FMAs in dimension order), added by hsum8: the order
// prefill_attention.cpp's float_scores8 reproduces. Each 8 values of a row are widened once for
// the group; the queries are read from L1 (16 registers hold too few of them).
template <typename C, int kHeadDim, int kGroup>
inline void group_scores(const float* q, const C* rows, const C* next, int64_t count, int64_t token_stride,
                         int64_t prefetch_bytes, float* scores, int64_t n) {
  for (int64_t slot = 0; slot < count; ++slot) {
    prefetch_row(next + slot * token_stride, prefetch_bytes);
    const C* k = rows + slot * token_stride;
    __m256 acc[kGroup];
    const __m256 k0 = load8(k);
#pragma GCC unroll 4
    for (int g = 0; g < kGroup; ++g) acc[g] = _mm256_mul_ps(_mm256_loadu_ps(q + g * kHeadDim), k0);
#pragma GCC unroll 32
    for (int c = 1; c < kHeadDim / 8; ++c) {
      const __m256 kc = load8(k + 8 * c);
#pragma GCC unroll 4
      for (int g = 0; g < kGroup; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * kHeadDim + 8 * c), kc, acc[g]);
    }
#pragma GCC unroll 4
    for (int g = 0; g < kGroup; ++g) scores[g * n + slot] = hsum8(acc[g]);
  }
}

constexpr int32_t kKeyOffset = 0;  // the codes are multiplied as signed int8 (no VNNI bias)

// The integer dot product of two rows of int8 codes (exact in int32, so in any order).
template <int kHeadDim>
inline int32_t dot_int8(const int8_t* q, const int8_t* k) {
  __m256i acc = _mm256_setzero_si256();
  for (int d = 0; d < kHeadDim; d += 16) {
    const __m256i qw = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + d)));
    const __m256i kw = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k + d)));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(qw, kw));
  }
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
  int32_t sum = 0;
  for (int32_t lane : lanes) sum += lane;
  return sum;
}

// group_scores over an int8 cache (the AVX-512 group_scores_int8's arguments): integer dot
// products of the rounded queries' codes, score = float(sum) * (q_scale * k_scale).
template <int kHeadDim, int kGroup>
inline void group_scores_int8(const int8_t* q, int64_t q_row, const int32_t* q_offset, const int8_t* rows,
                              const int8_t* next, int64_t count, int64_t token_stride, int64_t prefetch_bytes,
                              float* scores, int64_t n) {
  for (int64_t slot = 0; slot < count; ++slot) {
    prefetch_row(next + slot * token_stride, prefetch_bytes);
    const int8_t* k = rows + slot * token_stride;
    const float k_scale = kv_row_scale(k, kHeadDim);
    for (int g = 0; g < kGroup; ++g) {
      const int8_t* qg = q + g * q_row;
      scores[g * n + slot] = static_cast<float>(dot_int8<kHeadDim>(qg, k) - q_offset[g]) *
                             (kv_row_scale(qg, kHeadDim) * k_scale);
    }
  }
}

// group_accumulate on 8 lanes: for each head, 64 values at a time held in registers over the
// block's rows, one FMA per product in row order.
template <typename C, int kHeadDim, int kGroup>
inline void group_accumulate(const float* p, int64_t n, const C* rows, const C* next, int64_t count,
                             int64_t token_stride, int64_t prefetch_bytes, float* acc) {
  static_assert(kHeadDim % 64 == 0, "a head's row is held 64 values at a time");
  for (int g = 0; g < kGroup; ++g) {
    for (int s0 = 0; s0 < kHeadDim; s0 += 64) {
      float* a_out = acc + g * kHeadDim + s0;
      __m256 a[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) a[i] = _mm256_loadu_ps(a_out + 8 * i);
      for (int64_t slot = 0; slot < count; ++slot) {
        const C* v = rows + slot * token_stride;
        if (g == 0 && s0 == 0) prefetch_row(next + slot * token_stride, prefetch_bytes);
        const float w = p[g * n + slot];
        const __m256 pv = _mm256_set1_ps(kv_row_extra<C>() > 0 ? w * kv_row_scale(v, kHeadDim) : w);
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(pv, load8(v + s0 + 8 * i), a[i]);
      }
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(a_out + 8 * i, a[i]);
    }
  }
}

// out[head] = acc[head] * inv_sum[head] for the range's heads (out: the sequence's output row
// [num_heads, kHeadDim]).
template <typename T, typename C, int kHeadDim>
void store_heads(const float* acc, const float* inv_sum, HeadRange r, T* out) {
  for (int64_t head = 0; head < r.heads(); ++head) {
    T* o = out + (r.first_head() + head) * kHeadDim;
    for (int d = 0; d < kHeadDim; ++d) o[d] = static_cast<T>(acc[head * kHeadDim + d] * inv_sum[head]);
  }
}
#endif  // __AVX512F__, or AVX2 + FMA

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// Whether this build scores an int8 cache with integer dot products (AVX-512 reads its rows as
// whole zmm of 64 codes, which needs AVX512BW).
#if defined(__AVX512F__) && !defined(__AVX512BW__)
constexpr bool kInt8Scores = false;
#else
constexpr bool kInt8Scores = true;
#endif

// One thread's scratch for a KV head range's `heads` query heads (attend, split_context_attention):
// q_f the scaled queries (heads rows of head_dim floats); over an int8 cache q8 the queries
// rounded as cache rows (head_dim + 4 bytes each) and q_offset kKeyOffset times each one's code
// sum; acc and part the weighted sums (heads * head_dim floats each); inv_sum 1 / each
// softmax sum; scores one row of n positions per head (left empty where they are shared).
struct AttendScratch {
  std::vector<float> q_f, acc, part, inv_sum, scores;
  std::vector<int8_t> q8;
  std::vector<int32_t> q_offset;
  void resize(int64_t heads, int64_t head_dim, int64_t n) {
    q_f.resize(heads * head_dim);
    acc.resize(heads * head_dim);
    part.resize(heads * head_dim);
    inv_sum.resize(heads);
    scores.resize(heads * n);
    q8.resize(heads * (head_dim + kKvScaleBytes));
    q_offset.resize(heads);
  }
};

// The range's query heads scaled, q * scale, into s.q_f; over an int8 cache also rounded as a
// cache row is (quantize_kv_row; as llama.cpp rounds its queries to Q8_0 for a Q8_0 K cache)
// into s.q8, with s.q_offset.
template <typename T, typename C, int kHeadDim>
void prepare_queries(const T* q, int64_t q_head_stride, HeadRange r, float scale, AttendScratch& s) {
  constexpr int64_t kQ8Row = kHeadDim + kKvScaleBytes;
  for (int64_t head = 0; head < r.heads(); ++head) {
    const T* src = q + (r.first_head() + head) * q_head_stride;
    float* x = s.q_f.data() + head * kHeadDim;
    for (int d = 0; d < kHeadDim; ++d) x[d] = to_float(src[d]) * scale;
    if constexpr (std::is_same_v<C, int8_t>) {
      int8_t* row = s.q8.data() + head * kQ8Row;
      quantize_kv_row(row, x, kHeadDim);
      int32_t sum = 0;
      for (int d = 0; d < kHeadDim; ++d) sum += row[d];
      s.q_offset[head] = kKeyOffset * sum;
    }
  }
}

// The scores of positions begin .. end - 1 (scores[head * n + position - start]), every KV head
// of the range read block by block (an item of one KV head reads its part of each row; of them
// all, whole blocks); s: prepare_queries' output. Each KV head's rows prefetch that head's part
// of the next block's rows, so the prefetches are spread over the whole block's work: the first
// head prefetching the next block's whole span issued them in a burst, measured 1.15x slower
// with 8 KV heads of 128 at batch 16-64 and the reason splitting a grouped-query context cost
// 1.2x (bench/README.md, "Decode attention: prefetches spread over a block's KV heads").
template <typename C, int kHeadDim>
void scores_range(const AttendScratch& s, const C* k_base, const int64_t* table, int64_t start, int64_t begin,
                  int64_t end, int64_t block_size, int64_t block_stride, int64_t token_stride, HeadRange r,
                  float* scores, int64_t n) {
  constexpr int64_t kRow = kHeadDim + kv_row_extra<C>();  // cache elements per KV head row
  constexpr int64_t kQ8Row = kHeadDim + kKvScaleBytes;
  const int64_t head_bytes = kRow * static_cast<int64_t>(sizeof(C));
  const int64_t group = r.group;
  for_each_cached_block(k_base + r.kv_head_begin * kRow, table, begin, end, block_size, block_stride, token_stride,
                        [&](const C* block, const C* next, int64_t first, int64_t count) {
    first += begin - start;
    for (int64_t h = 0; h < r.kv_head_end - r.kv_head_begin; ++h) {
      for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup) {
        const int64_t head = h * group + g0;
        const int64_t prefetch = g0 == 0 ? head_bytes : 0;
        with_group(group - g0, [&](auto size) {
          constexpr int kGroup = decltype(size)::value;
          if constexpr (std::is_same_v<C, int8_t>) {
            if constexpr (kInt8Scores) {
              group_scores_int8<kHeadDim, kGroup>(s.q8.data() + head * kQ8Row, kQ8Row, s.q_offset.data() + head,
                                                  block + h * kRow, next + h * kRow, count, token_stride, prefetch,
                                                  scores + head * n + first, n);
            }
          } else {
            group_scores<C, kHeadDim, kGroup>(s.q_f.data() + head * kHeadDim, block + h * kRow, next + h * kRow,
                                              count, token_stride, prefetch, scores + head * n + first, n);
          }
        });
      }
    }
  });
}

// acc[head * kHeadDim ..] += the softmax weights (scores) of positions begin .. end - 1 times
// their V rows, in position order (a bf16 cache's accumulators in group_accumulate's order).
template <typename C, int kHeadDim>
void accumulate_range(const C* v_base, const int64_t* table, int64_t start, int64_t begin, int64_t end,
                      int64_t block_size, int64_t block_stride, int64_t token_stride, HeadRange r,
                      const float* weights, int64_t n, float* acc) {
  constexpr int64_t kRow = kHeadDim + kv_row_extra<C>();
  const int64_t head_bytes = kRow * static_cast<int64_t>(sizeof(C));
  const int64_t group = r.group;
  for_each_cached_block(v_base + r.kv_head_begin * kRow, table, begin, end, block_size, block_stride, token_stride,
                        [&](const C* block, const C* next, int64_t first, int64_t count) {
    first += begin - start;
    for (int64_t h = 0; h < r.kv_head_end - r.kv_head_begin; ++h) {
      for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup) {
        const int64_t head = h * group + g0;
        with_group(group - g0, [&](auto size) {
          group_accumulate<C, kHeadDim, decltype(size)::value>(
              weights + head * n + first, n, block + h * kRow, next + h * kRow, count, token_stride,
              g0 == 0 ? head_bytes : 0, acc + head * kHeadDim);
        });
      }
    }
  });
}
// The weighted sum of positions begin .. end - 1 into acc (heads * kHeadDim floats), kFoldTokens
// positions (counted from start) at a time: the first chunk's sum accumulates in acc (zeroed
// here), each later chunk's in part (zeroed per chunk), then is added to acc.
template <typename C, int kHeadDim>
void weighted_sum(const C* v_base, const int64_t* table, int64_t start, int64_t begin, int64_t end,
                  int64_t block_size, int64_t block_stride, int64_t token_stride, HeadRange r, const float* weights,
                  int64_t n, float* acc, float* part) {
  const int64_t size = r.heads() * kHeadDim;
  std::fill(acc, acc + size, 0.f);
  for (int64_t c = begin; c < end; c += kFoldTokens) {
    const int64_t c_end = std::min(end, c + kFoldTokens);
    float* into = c == begin ? acc : part;
    if (c != begin) std::fill(part, part + size, 0.f);
    accumulate_range<C, kHeadDim>(v_base, table, start, c, c_end, block_size, block_stride, token_stride, r, weights,
                                  n, into);
    if (c != begin) fold_into(acc, part, size);
  }
}
// One sequence's attention for a KV head range, in one thread: scores of every position,
// softmax_rows, the weighted sum in kFoldTokens chunks, the output (s: sized for the range's
// heads and context_len - start positions).
template <typename T, typename C, int kHeadDim>
void attend(const T* q, int64_t q_head_stride, const C* k_base, const C* v_base, const int64_t* table,
            int64_t start, int64_t context_len, int64_t block_size, int64_t block_stride, int64_t token_stride,
            HeadRange r, float scale, AttendScratch& s, T* out) {
  const int64_t n = context_len - start;
  prepare_queries<T, C, kHeadDim>(q, q_head_stride, r, scale, s);
  scores_range<C, kHeadDim>(s, k_base, table, start, start, context_len, block_size, block_stride, token_stride, r,
                            s.scores.data(), n);
  softmax_rows(s.scores.data(), n, r.heads(), s.inv_sum.data());
  weighted_sum<C, kHeadDim>(v_base, table, start, start, context_len, block_size, block_stride, token_stride, r,
                            s.scores.data(), n, s.acc.data(), s.part.data());
  store_heads<T, C, kHeadDim>(s.acc.data(), s.inv_sum.data(), r, out);
}

// A few long sequences (a batch-1 decode at 1k-32k tokens): each sequence's positions are cut
// into `slices` runs of whole kFoldTokens chunks, and each thread walks one run of every
// sequence for all its KV heads. Memory is then read in whole blocks, where an item per KV head
// reads one head's part of every row (that order alone read 13-16 GB/s on Zen 4 where whole
// blocks read 30-34; bench/README.md, "Decode attention at 32k: the read pattern alone"). Four
// phases in one OpenMP region, a barrier apart: the scores of each run; softmax_rows per query
// head; the weighted sum of each run (the first run's chunks folded into the total as
// weighted_sum folds them, a later run's chunks each kept apart); the later chunks folded in
// order and the output stored. Every score, softmax and chunk sum is computed as attend
// computes it, and the chunks are folded in the same order: bitwise the same result whatever
// the number of threads.
template <typename T, typename C, int kHeadDim>
void split_context_attention(T* out_base, const T* q_base, int64_t q_seq_stride, int64_t q_head_stride,
                             const C* k_base, const C* v_base, const int64_t* tables, int64_t max_blocks,
                             const int64_t* lens, int64_t sliding_window, int64_t num_seqs, int64_t num_kv_heads,
                             int64_t group, int64_t block_size, int64_t block_stride, int64_t token_stride,
                             float scale, int64_t slices) {
  const HeadRange all{group, 0, num_kv_heads};
  const int64_t heads = all.heads(), row = heads * kHeadDim;
  std::vector<int64_t> starts(num_seqs), chunks(num_seqs), score_at(num_seqs + 1, 0), chunk_at(num_seqs + 1, 0);
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    starts[seq] = sliding_window > 0 ? std::max<int64_t>(0, lens[seq] - sliding_window) : 0;
    const int64_t n = lens[seq] - starts[seq];
    chunks[seq] = (n + kFoldTokens - 1) / kFoldTokens;
    score_at[seq + 1] = score_at[seq] + heads * n;
    chunk_at[seq + 1] = chunk_at[seq] + chunks[seq];
  }
  // Not zero-filled (every element is written before it is read): at 32k tokens the scores
  // and chunk sums are MiBs per call.
  const std::unique_ptr<float[]> scores(new float[score_at[num_seqs]]), inv_sum(new float[num_seqs * heads]),
      totals(new float[num_seqs * row]), partials(new float[chunk_at[num_seqs] * row]);
  // Run s of a sequence: chunks [first_chunk(seq, s), first_chunk(seq, s + 1)).
  auto first_chunk = [&](int64_t seq, int64_t s) { return chunks[seq] * s / slices; };
  auto position = [&](int64_t seq, int64_t chunk) {
    return std::min(lens[seq], starts[seq] + chunk * kFoldTokens);
  };
  const int64_t items = num_seqs * slices;
#pragma omp parallel num_threads(static_cast<int>(slices))
  {
    const int64_t tid = omp_get_thread_num(), team = omp_get_num_threads();
    AttendScratch s;
    s.resize(heads, kHeadDim, 0);
    for (int64_t item = tid; item < items; item += team) {
      const int64_t seq = item / slices, run = item % slices;
      const T* q = q_base + seq * q_seq_stride;
      prepare_queries<T, C, kHeadDim>(q, q_head_stride, all, scale, s);
      scores_range<C, kHeadDim>(s, k_base, tables + seq * max_blocks, starts[seq], position(seq, first_chunk(seq, run)),
                                position(seq, first_chunk(seq, run + 1)), block_size, block_stride, token_stride, all,
                                scores.get() + score_at[seq], lens[seq] - starts[seq]);
    }
#pragma omp barrier
    for (int64_t r = tid; r < num_seqs * heads; r += team) {
      const int64_t seq = r / heads, n = lens[seq] - starts[seq];
      softmax_rows(scores.get() + score_at[seq] + (r % heads) * n, n, 1, inv_sum.get() + r);
    }
#pragma omp barrier
    for (int64_t item = tid; item < items; item += team) {
      const int64_t seq = item / slices, run = item % slices, n = lens[seq] - starts[seq];
      const int64_t* table = tables + seq * max_blocks;
      const float* weights = scores.get() + score_at[seq];
      if (run == 0) {
        weighted_sum<C, kHeadDim>(v_base, table, starts[seq], starts[seq], position(seq, first_chunk(seq, 1)),
                                  block_size, block_stride, token_stride, all, weights, n,
                                  totals.get() + seq * row, s.part.data());
        continue;
      }
      for (int64_t c = first_chunk(seq, run); c < first_chunk(seq, run + 1); ++c) {
        float* into = partials.get() + (chunk_at[seq] + c) * row;
        std::fill(into, into + row, 0.f);
        accumulate_range<C, kHeadDim>(v_base, table, starts[seq], position(seq, c), position(seq, c + 1), block_size,
                                      block_stride, token_stride, all, weights, n, into);
      }
    }
#pragma omp barrier
    for (int64_t r = tid; r < num_seqs * heads; r += team) {
      const int64_t seq = r / heads, head = r % heads;
      float* acc = totals.get() + seq * row + head * kHeadDim;
      for (int64_t c = first_chunk(seq, 1); c < chunks[seq]; ++c) {
        fold_into(acc, partials.get() + (chunk_at[seq] + c) * row + head * kHeadDim, kHeadDim);
      }
      store_heads<T, C, kHeadDim>(acc, inv_sum.get() + r, HeadRange{1, head, head + 1},
                                  out_base + seq * heads * kHeadDim);
    }
  }
}
#endif  // a vector build

// kHeadDim > 0 fixes head_dim at compile time: the per-token loops then unroll fully and a
// head's q and output accumulator stay in vector registers (measured ~2x on the decode step
// against the runtime-length loops). kHeadDim == 0 is the generic path for other sizes.
template <typename T, typename C, int kHeadDim>
void decode_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                      const at::Tensor& value_cache, const at::Tensor& block_tables,
                      const at::Tensor& context_lens, float scale, int64_t sliding_window) {
  const int64_t num_seqs = query.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : query.size(2);
  const int64_t num_blocks = key_cache.size(0);
  const int64_t block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t q_seq_stride = query.stride(0);
  const int64_t q_head_stride = query.stride(1);
  const int64_t row_len = head_dim + kv_row_extra<C>();  // cache elements per KV head row
  const int64_t token_stride = num_kv_heads * row_len;
  const int64_t block_stride = block_size * token_stride;

  const T* q_base = query.data_ptr<T>();
  const C* k_base = key_cache.data_ptr<C>();
  const C* v_base = value_cache.data_ptr<C>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* out_base = out.data_ptr<T>();

  constexpr bool kInt8Cache = std::is_same_v<C, int8_t>;
#if defined(__AVX512BW__)  // an int8 cache's rows are read as whole zmm of 64 codes
  constexpr bool kVector = kHeadDim > 0 && kHeadDim % 16 == 0 && (!kInt8Cache || kHeadDim % 64 == 0);
#elif defined(__AVX512F__)
  constexpr bool kVector = kHeadDim > 0 && kHeadDim % 16 == 0 && !kInt8Cache;
#elif defined(__AVX2__) && defined(__FMA__)  // V rows are summed 64 values at a time
  constexpr bool kVector = kHeadDim > 0 && kHeadDim % 64 == 0;
#else
  constexpr bool kVector = false;
#endif
  // Checked before any work is split (a check failing inside a parallel region would throw there).
  int64_t min_n = std::numeric_limits<int64_t>::max();
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t context_len = lens[seq];
    TORCH_CHECK_VALUE(context_len >= 1 && context_len <= max_blocks * block_size,
                      "context_lens[", seq, "] = ", context_len, " must be in [1, ",
                      max_blocks * block_size, "] (max_blocks x block_size)");
    const int64_t* table = tables + seq * max_blocks;
    const int64_t start = sliding_window > 0 ? std::max<int64_t>(0, context_len - sliding_window) : 0;
    min_n = std::min(min_n, context_len - start);
    for (int64_t b = start / block_size; b < (context_len + block_size - 1) / block_size; ++b) {
      TORCH_CHECK_VALUE(table[b] >= 0 && table[b] < num_blocks, "block_tables[", seq, ", ", b,
                        "] = ", table[b], " is outside [0, ", num_blocks, ")");
    }
  }
  const int64_t threads = at::get_num_threads();
  // Whole sequences per item once there are kSeqsPerThread of them per thread (see the vector
  // paths' section); fewer sequences, each long enough, split by context; otherwise one item per
  // KV head. The generic path always takes one KV head per item.
  const bool whole_seqs = kVector && num_seqs >= kSeqsPerThread * threads;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if constexpr (kVector) {
    const bool long_enough = min_n > (kMinChunksPerThread * threads - 1) * kFoldTokens &&
                             (group == 1 || min_n >= kMinGroupedSplitTokens);
    if (!whole_seqs && threads > 1 && long_enough) {
      split_context_attention<T, C, kHeadDim>(out_base, q_base, q_seq_stride, q_head_stride, k_base, v_base, tables,
                                              max_blocks, lens, sliding_window, num_seqs, num_kv_heads, group,
                                              block_size, block_stride, token_stride, scale, threads);
      return;
    }
  }
#endif
  const int64_t heads_per_item = whole_seqs ? num_kv_heads : 1;
  const int64_t items_per_seq = num_kv_heads / heads_per_item;
  at::parallel_for(0, num_seqs * items_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q_f(head_dim);
    std::vector<float> acc(head_dim);
    std::vector<float> scores;
    std::vector<int8_t> q8;  // int8 cache: the rounded query head (quantize_kv_row)
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    AttendScratch scratch;
#endif
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / items_per_seq;
      const int64_t kv_head = (item % items_per_seq) * heads_per_item;
      const int64_t context_len = lens[seq];
      const int64_t* table = tables + seq * max_blocks;
      const int64_t start = sliding_window > 0 ? std::max<int64_t>(0, context_len - sliding_window) : 0;
      const int64_t n = context_len - start;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
      if constexpr (kVector) {
        scratch.resize(heads_per_item * group, kHeadDim, n);
        attend<T, C, kHeadDim>(q_base + seq * q_seq_stride, q_head_stride, k_base, v_base, table, start, context_len,
                               block_size, block_stride, token_stride,
                               HeadRange{group, kv_head, kv_head + heads_per_item}, scale, scratch,
                               out_base + seq * num_heads * head_dim);
        continue;
      }
#endif
      scores.resize(n);
      // One query head at a time: its K/V rows were just read for the previous head of the
      // group and come from cache, while q and the accumulator live in registers.
      for (int64_t g = 0; g < group; ++g) {
        const int64_t head = kv_head * group + g;
        const T* q = q_base + seq * q_seq_stride + head * q_head_stride;
        float* qf = q_f.data();
        for (int64_t d = 0; d < head_dim; ++d) qf[d] = to_float(q[d]) * scale;
        float q_scale = 1.f;  // an int8 cache: q rounded as a cache row, its codes in q8
        if constexpr (kInt8Cache) {
          q8.resize(head_dim + kKvScaleBytes);
          quantize_kv_row(q8.data(), qf, head_dim);
          q_scale = kv_row_scale(q8.data(), head_dim);
        }

        const int64_t row_bytes = row_len * sizeof(C);
        float max_score = -std::numeric_limits<float>::infinity();
        for_each_cached_block(k_base + kv_head * row_len, table, start, context_len, block_size, block_stride,
                              token_stride,
                              [&](const C* block, const C* next, int64_t first, int64_t count) {
          for (int64_t slot = 0; slot < count; ++slot) {
            prefetch_row(next + slot * token_stride, row_bytes);
            const C* k = block + slot * token_stride;
            float dot = 0.f;
            if constexpr (kInt8Cache) {  // exact in int32, as the vector path's
              const int8_t* qc = q8.data();
              int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
              for (int64_t d = 0; d < head_dim; ++d) sum += static_cast<int32_t>(qc[d]) * static_cast<int32_t>(k[d]);
              dot = static_cast<float>(sum) * (q_scale * kv_row_scale(k, head_dim));
            } else {
#pragma omp simd reduction(+ : dot)
              for (int64_t d = 0; d < head_dim; ++d) dot += qf[d] * to_float(k[d]);
            }
            scores[first + slot] = dot;
            max_score = std::max(max_score, dot);
          }
        });
        // Max-subtracted softmax, as torch's.
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) {
          scores[t] = std::exp(scores[t] - max_score);
          sum += scores[t];
        }

        float* a = acc.data();
        for (int64_t d = 0; d < head_dim; ++d) a[d] = 0.f;
        for_each_cached_block(v_base + kv_head * row_len, table, start, context_len, block_size, block_stride,
                              token_stride,
                              [&](const C* block, const C* next, int64_t first, int64_t count) {
          for (int64_t slot = 0; slot < count; ++slot) {
            prefetch_row(next + slot * token_stride, row_bytes);
            const C* v = block + slot * token_stride;
            const float p = scores[first + slot] * kv_row_scale(v, head_dim);
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * to_float(v[d]);
          }
        });
        const float inv_sum = 1.f / sum;
        T* o = out_base + (seq * num_heads + head) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(a[d] * inv_sum);
      }
    }
  });
}

template <typename T, typename C>
void dispatch_head_dim(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& block_tables,
                       const at::Tensor& context_lens, float scale, int64_t window) {
  switch (query.size(2)) {
    case 64:
      return decode_attention<T, C, 64>(out, query, key_cache, value_cache, block_tables, context_lens, scale, window);
    case 128:
      return decode_attention<T, C, 128>(out, query, key_cache, value_cache, block_tables, context_lens, scale, window);
    case 256:  // Gemma 3
      return decode_attention<T, C, 256>(out, query, key_cache, value_cache, block_tables, context_lens, scale, window);
    default:
      return decode_attention<T, C, 0>(out, query, key_cache, value_cache, block_tables, context_lens, scale, window);
  }
}

// Shapes and dtypes are validated by the Python wrapper; only what would corrupt memory is
// checked again here.
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale, int64_t sliding_window) {
  TORCH_CHECK_VALUE(sliding_window >= 0, "sliding_window must be >= 0 (0: none), got ", sliding_window);
  TORCH_CHECK_VALUE(query.dim() == 3 && query.stride(2) == 1, "query must be [seqs, heads, head_dim] with contiguous head_dim");
  TORCH_CHECK_VALUE(key_cache.is_contiguous() && value_cache.is_contiguous(), "K/V caches must be contiguous");
  TORCH_CHECK_VALUE(key_cache.sizes() == value_cache.sizes(), "K and V caches differ in shape");
  const bool int8_cache = key_cache.scalar_type() == at::kChar;
  TORCH_CHECK_VALUE(key_cache.dim() == 4 && key_cache.size(3) == query.size(2) + (int8_cache ? kKvScaleBytes : 0),
                    "K/V cache rows must hold head_dim = ", query.size(2), " values",
                    int8_cache ? " and a 4-byte scale (int8 cache)" : "", ", got ", key_cache.size(3));
  TORCH_CHECK_VALUE(query.size(1) % key_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK_VALUE(key_cache.scalar_type() == value_cache.scalar_type() &&
                        (key_cache.scalar_type() == query.scalar_type() || key_cache.scalar_type() == at::kBFloat16 ||
                         int8_cache),
                    "K/V caches must share one dtype: the query's, bfloat16 or int8 (got query ", query.scalar_type(),
                    ", caches ", key_cache.scalar_type(), ")");
  TORCH_CHECK_VALUE(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) == query.size(0),
              "block_tables must be contiguous int64 [num_seqs, max_blocks]");
  TORCH_CHECK_VALUE(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous() &&
                  context_lens.numel() == query.size(0),
              "context_lens must be contiguous int64 [num_seqs]");
  auto out = at::empty({query.size(0), query.size(1), query.size(2)}, query.options());
  if (query.size(0) == 0) return out;
  const float s = static_cast<float>(scale);
  if (int8_cache && query.scalar_type() == at::kFloat) {
    dispatch_head_dim<float, int8_t>(out, query, key_cache, value_cache, block_tables, context_lens, s, sliding_window);
  } else if (int8_cache && query.scalar_type() == at::kBFloat16) {
    dispatch_head_dim<c10::BFloat16, int8_t>(out, query, key_cache, value_cache, block_tables, context_lens, s,
                                             sliding_window);
  } else if (query.scalar_type() == at::kFloat && key_cache.scalar_type() == at::kFloat) {
    dispatch_head_dim<float, float>(out, query, key_cache, value_cache, block_tables, context_lens, s, sliding_window);
  } else if (query.scalar_type() == at::kFloat) {
    dispatch_head_dim<float, c10::BFloat16>(out, query, key_cache, value_cache, block_tables, context_lens, s, sliding_window);
  } else if (query.scalar_type() == at::kBFloat16) {
    dispatch_head_dim<c10::BFloat16, c10::BFloat16>(out, query, key_cache, value_cache, block_tables, context_lens, s, sliding_window);
  } else {
    TORCH_CHECK_VALUE(false, "paged_decode_attention supports float32 and bfloat16, got ", query.scalar_type());
  }
  return out;
}

// "<variant> <sha256 of the sources>": which build of the ops this is (pagedllm/layers/ops.py).
// Defined in build_info_<variant>.cpp, which setup.py writes for each library it builds.
std::string build_info();

}  // namespace pagedllm

TORCH_LIBRARY(pagedllm, m) {
  m.def("build_info() -> str", &pagedllm::build_info);
  m.def("paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor context_lens, float scale, int sliding_window=0) -> Tensor",
        &pagedllm::paged_decode_attention);
}
