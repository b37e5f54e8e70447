"""Paged attention: the C++ decode kernel and the torch paths against a dense reference.

The reference rebuilds each sequence's K/V token by token from its block table in Python and
computes ``softmax(q k^T * scale) v`` with explicit matmuls, one query head at a time: no
block gathers, no SDPA, no GQA broadcasting shared with the code under test.
"""

from __future__ import annotations

import functools
import logging

from typing import Optional

import pytest
import torch

from pagedllm.layers import custom_op as ops_module
from pagedllm.layers.attention import (AttentionMetadata, PrefillSequence, paged_attention,
                                       paged_decode_attention, paged_decode_attention_torch,
                                       prefill_attention, prefill_attention_sdpa, write_kv_cache)
from pagedllm.layers.ops import native_ops, quantize_kv

NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM = 64, 16, 64


def dense_reference(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_table: list[int], context_len: int, query_positions: list[int],
                    scale: float, window: Optional[int] = None) -> torch.Tensor:
    """Attention of queries ``[q_len, H, D]`` at ``query_positions`` over one sequence, fp64,
    rebuilt token by token from the block table; each query sees keys ``pos - window + 1 ..
    pos`` (all of ``0 .. pos`` for window None: a sliding window, as Gemma 3's local layers)."""
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    if key_cache.dtype == torch.int8:  # each query head is rounded as a cache row (as_cached_query)
        query, scale = cached_values(quantize_kv(query.float() * scale)), 1.0
    keys = torch.stack([cached_values(key_cache[block_table[p // block_size], p % block_size])
                        for p in range(context_len)])
    values = torch.stack([cached_values(value_cache[block_table[p // block_size], p % block_size])
                          for p in range(context_len)])
    out = torch.empty(query.shape, dtype=torch.float64)
    for head in range(query.shape[1]):
        k, v = keys[:, head // group].double(), values[:, head // group].double()
        for row, pos in enumerate(query_positions):
            lo = 0 if window is None else max(0, pos - window + 1)
            scores = (k[lo:pos + 1] @ query[row, head].double()) * scale
            out[row, head] = scores.softmax(0) @ v[lo:pos + 1]
    return out


def cached_values(rows: torch.Tensor) -> torch.Tensor:
    """Cache rows ``[..., width]`` as fp64 values: an int8 cache's rows are ``head_dim`` codes
    and then the 4 bytes of their float32 scale."""
    if rows.dtype != torch.int8:
        return rows.double()
    scale = torch.frombuffer(bytearray(rows[..., -4:].contiguous().numpy().tobytes()), dtype=torch.float32)
    return rows[..., :-4].double() * scale.double().view(*rows.shape[:-1], 1)


def random_caches(num_kv_heads: int, dtype: torch.dtype, seed: int, head_dim: int = HEAD_DIM):
    """K and V caches of random normal values; an int8 cache holds them quantized
    (``quantize_kv``, the rows ``reshape_and_cache_`` writes)."""
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
    if dtype == torch.int8:
        return quantize_kv(torch.randn(shape, generator=g)), quantize_kv(torch.randn(shape, generator=g)), g
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype), g


def random_decode_batch(num_seqs: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype, seed: int,
                        head_dim: int = HEAD_DIM):
    """Caches, queries and random (non-contiguous, shuffled) block tables for a decode batch."""
    key_cache, value_cache, g = random_caches(num_kv_heads, dtype, seed, head_dim)
    context_lens = torch.randint(1, 12 * BLOCK_SIZE, (num_seqs,), generator=g)
    context_lens[0] = 1  # a sequence whose first token is also its only one
    context_lens[-1] = 12 * BLOCK_SIZE  # exactly full blocks
    max_blocks = int(-(-context_lens.max() // BLOCK_SIZE))
    # Padding entries beyond a sequence's blocks hold arbitrary valid ids, as the runner's 0s.
    block_tables = torch.stack([torch.randperm(NUM_BLOCKS, generator=g)[:max_blocks] for _ in range(num_seqs)])
    query_dtype = torch.float32 if dtype == torch.int8 else dtype
    query = torch.randn(num_seqs, num_heads, head_dim, generator=g).to(query_dtype)
    return query, key_cache, value_cache, block_tables, context_lens


def decode_reference(query, key_cache, value_cache, block_tables, context_lens, scale):
    return torch.cat([dense_reference(query[i:i + 1], key_cache, value_cache, block_tables[i].tolist(),
                                      int(context_lens[i]), [int(context_lens[i]) - 1], scale)
                      for i in range(query.shape[0])])


@pytest.fixture(scope="module")
def kernel():
    ops = native_ops()
    if ops is None:
        pytest.fail("the C++ kernel did not build (see the warning logged by native_ops)")
    return ops


# Groups of 1, 4, 3 (SmolLM2), 7 (Qwen2.5-0.5B: two passes of 4 + 3) and 5 (4 + 1) query heads
# per KV head; head_dim 64 and 128 take the AVX-512 path where the CPU has it, 32 and 48 the
# generic one.
@pytest.mark.parametrize("head_dim", [32, 48, 64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (9, 3), (14, 2), (10, 2)])
def test_decode_kernel_matches_reference_fp32(kernel, num_heads, num_kv_heads, head_dim):
    batch = random_decode_batch(13, num_heads, num_kv_heads, torch.float32, seed=num_heads, head_dim=head_dim)
    scale = head_dim ** -0.5
    expected = decode_reference(*batch, scale)
    out = kernel.paged_decode_attention(*batch, scale)
    assert out.dtype == torch.float32 and out.shape == batch[0].shape
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(paged_decode_attention_torch(*batch, scale).double(), expected,
                               rtol=1e-5, atol=1e-5)


def test_decode_kernel_softmax_with_underflowing_weights(kernel):
    """Scores spread over hundreds: most weights underflow to 0 (no NaN, no denormal slowdown)."""
    query, key_cache, value_cache, block_tables, context_lens = random_decode_batch(6, 9, 3, torch.float32, 11,
                                                                                   head_dim=64)
    query = query * 40
    scale = 64 ** -0.5
    expected = decode_reference(query, key_cache, value_cache, block_tables, context_lens, scale)
    out = kernel.paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [32, 64])
def test_decode_kernel_bf16_matches_fp32_math(kernel, head_dim):
    query, key_cache, value_cache, block_tables, context_lens = random_decode_batch(
        9, 8, 2, torch.bfloat16, seed=7, head_dim=head_dim)
    scale = head_dim ** -0.5
    # The kernel reads bf16 and accumulates in fp32: compare with fp64 math on the same values,
    # allowing one bf16 rounding of the output (relative 2^-8).
    expected = decode_reference(query, key_cache, value_cache, block_tables, context_lens, scale)
    out = kernel.paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, rtol=2 ** -8, atol=1e-3)


@pytest.mark.parametrize("head_dim", [32, 48, 64, 128])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_over_an_int8_cache(kernel, head_dim, query_dtype):
    """kv_cache_dtype="int8": the kernel widens each code exactly and folds its row's scale
    into the score and the softmax weight, in fp32: fp64 math on the dequantized values agrees
    as closely as an all-fp32 call (up to a bf16 rounding of the output), and so does the torch
    path, which dequantizes."""
    query, key_cache, value_cache, block_tables, context_lens = random_decode_batch(
        11, 9, 3, torch.int8, seed=head_dim + 1, head_dim=head_dim)
    assert key_cache.shape[-1] == head_dim + 4
    query = query.to(query_dtype)
    scale = head_dim ** -0.5
    expected = decode_reference(query, key_cache, value_cache, block_tables, context_lens, scale)
    out = kernel.paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale)
    assert out.dtype == query_dtype and out.shape == query.shape
    tolerance = dict(rtol=1e-5, atol=1e-5) if query_dtype == torch.float32 else dict(rtol=2 ** -8, atol=1e-3)
    torch.testing.assert_close(out.double(), expected, **tolerance)
    torch.testing.assert_close(
        paged_decode_attention_torch(query.float(), key_cache, value_cache, block_tables, context_lens,
                                     scale).double(), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="K/V cache rows must hold head_dim = 64 values and a 4-byte scale"):
        kernel.paged_decode_attention(torch.randn(1, 9, 64), key_cache[..., :64].contiguous(),
                                      value_cache[..., :64].contiguous(), block_tables[:1], context_lens[:1], scale)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_decode_kernel_fp32_query_over_bf16_cache(kernel, head_dim):
    """kv_cache_dtype="bfloat16": the kernel widens each bf16 K/V element exactly and does fp32
    math, so it matches fp64 math on the same values as closely as an all-fp32 call does."""
    query, key_cache, value_cache, block_tables, context_lens = random_decode_batch(
        11, 9, 3, torch.bfloat16, seed=head_dim, head_dim=head_dim)
    query = query.float() + torch.randn(query.shape, generator=torch.Generator().manual_seed(1)) * 1e-3
    scale = head_dim ** -0.5
    expected = decode_reference(query, key_cache, value_cache, block_tables, context_lens, scale)
    out = kernel.paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        paged_decode_attention_torch(query, key_cache, value_cache, block_tables, context_lens, scale).double(),
        expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="K/V caches must share one dtype: the query's, bfloat16 or int8"):
        kernel.paged_decode_attention(query.bfloat16(), key_cache.float(), value_cache.float(), block_tables,
                                      context_lens, scale)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (14, 2, 128), (4, 1, 256), (8, 2, 64)])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.float32, torch.bfloat16), (torch.float32, torch.int8),
                                    (torch.bfloat16, torch.int8)])
@pytest.mark.parametrize("window", [0, 40])
def test_decode_kernel_work_splits_agree_bitwise(kernel, num_heads, num_kv_heads, head_dim, dtypes, window):
    """A batch of 16 sequences is split one item per sequence (every KV head of a block read
    together), one sequence alone one item per KV head: the same arithmetic in the same order,
    so each sequence's output is bitwise the same either way, and matches the reference."""
    query_dtype, cache_dtype = dtypes
    query, key_cache, value_cache, block_tables, context_lens = random_decode_batch(
        16, num_heads, num_kv_heads, cache_dtype, seed=head_dim + num_heads, head_dim=head_dim)
    query = query.to(query_dtype)
    scale = head_dim ** -0.5
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # 16 sequences >= 4 per thread: split by sequence
    try:
        batched = kernel.paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale,
                                                window)
    finally:
        torch.set_num_threads(threads)
    for i in range(16):
        alone = kernel.paged_decode_attention(query[i:i + 1], key_cache, value_cache, block_tables[i:i + 1],
                                              context_lens[i:i + 1], scale, window)
        assert torch.equal(batched[i:i + 1], alone), f"sequence {i}"
    if window == 0 and query_dtype == torch.float32:
        expected = decode_reference(query, key_cache, value_cache, block_tables, context_lens, scale)
        torch.testing.assert_close(batched.double(), expected, rtol=1e-5, atol=1e-5)


def check_same_at_1_2_3_threads_and_alone(kernel, query, key_cache, value_cache, block_tables, context_lens, scale,
                                          window) -> list[torch.Tensor]:
    """The batch's decode outputs at 1, 2 and 3 threads (returned), asserted bitwise equal to
    each other and to each sequence's alone at 2 threads."""
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(kernel.paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens,
                                                      scale, window))
        torch.set_num_threads(2)
        alone = [kernel.paged_decode_attention(query[i:i + 1], key_cache, value_cache, block_tables[i:i + 1],
                                               context_lens[i:i + 1], scale, window) for i in range(len(context_lens))]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert torch.equal(outs[0], torch.cat(alone))
    return outs


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (14, 2, 128), (32, 32, 64), (4, 4, 128)])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.float32, torch.bfloat16), (torch.float32, torch.int8),
                                    (torch.bfloat16, torch.int8)])
@pytest.mark.parametrize("window", [0, 700])
def test_decode_kernel_long_context_split_by_threads_bitwise(kernel, num_heads, num_kv_heads, head_dim, dtypes,
                                                              window):
    """A few sequences of 385-1,024 tokens are split by context between threads where a KV head
    has one query head (runs of whole 128-token chunks, each chunk's weighted sum folded in
    order), one thread walks them whole: bitwise the same output at 1, 2 and 3 threads and alone
    or batched, and the reference's."""
    query_dtype, cache_dtype = dtypes
    key_cache, value_cache, g = random_caches(num_kv_heads, cache_dtype, seed=head_dim + num_heads, head_dim=head_dim)
    context_lens = torch.tensor([385, 1024, 700, 513])  # chunk boundaries at 128, 256, ... from the window's start
    block_tables = torch.stack([torch.randperm(NUM_BLOCKS, generator=g) for _ in range(len(context_lens))])
    query = torch.randn(len(context_lens), num_heads, head_dim, generator=g).to(query_dtype)
    scale = head_dim ** -0.5
    outs = check_same_at_1_2_3_threads_and_alone(kernel, query, key_cache, value_cache, block_tables, context_lens,
                                                 scale, window)
    if query_dtype == torch.float32:
        expected = torch.cat([dense_reference(query[i:i + 1], key_cache, value_cache, block_tables[i].tolist(),
                                              int(context_lens[i]), [int(context_lens[i]) - 1], scale,
                                              window or None) for i in range(len(context_lens))])
        torch.testing.assert_close(outs[0].double(), expected, rtol=1e-5, atol=1e-5)


def test_decode_kernel_reads_strided_query(kernel):
    """The model passes q as a view into the fused QKV projection (row stride > H * D)."""
    query, key_cache, value_cache, block_tables, context_lens = random_decode_batch(5, 4, 2, torch.float32, 3)
    fused = torch.cat([query.flatten(1), torch.randn(5, 2 * 2 * HEAD_DIM)], dim=1)
    strided = fused[:, :4 * HEAD_DIM].view(5, 4, HEAD_DIM)
    assert not strided.is_contiguous()
    scale = 0.3
    torch.testing.assert_close(
        kernel.paged_decode_attention(strided, key_cache, value_cache, block_tables, context_lens, scale),
        kernel.paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale))


def test_decode_kernel_rejects_bad_block_ids_and_lengths(kernel):
    query, key_cache, value_cache, block_tables, context_lens = random_decode_batch(3, 4, 2, torch.float32, 5)
    bad_tables = block_tables.clone()
    bad_tables[1, 0] = NUM_BLOCKS
    with pytest.raises(ValueError, match=r"block_tables\[1, 0\] = 64 is outside \[0, 64\)"):
        kernel.paged_decode_attention(query, key_cache, value_cache, bad_tables, context_lens, 1.0)
    too_long = context_lens.clone()
    too_long[2] = block_tables.shape[1] * BLOCK_SIZE + 1
    with pytest.raises(ValueError, match=r"context_lens\[2\]"):
        kernel.paged_decode_attention(query, key_cache, value_cache, block_tables, too_long, 1.0)
    with pytest.raises(ValueError, match="int64"):
        kernel.paged_decode_attention(query, key_cache, value_cache, block_tables.int(), context_lens, 1.0)


def test_decode_falls_back_to_torch_when_the_ops_cannot_load(monkeypatch, caplog, tmp_path):
    """A library that cannot be loaded (here: not built) leaves the torch path, with a warning
    that says why."""
    query, key_cache, value_cache, block_tables, context_lens = random_decode_batch(4, 4, 2, torch.float32, 9)
    expected = decode_reference(query, key_cache, value_cache, block_tables, context_lens, 0.2)
    monkeypatch.delenv("PAGEDLLM_ISA", raising=False)
    monkeypatch.setattr(ops_module, "PACKAGE_DIR", tmp_path)
    monkeypatch.setattr(ops_module, "load_native_ops", functools.lru_cache(maxsize=1)(
        ops_module.load_native_ops.__wrapped__))
    native_ops.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=ops_module.__name__):
            assert native_ops() is None
            out = paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, 0.2)
        assert ".so is not built" in caplog.text and "using the pure-torch path" in caplog.text
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    finally:
        native_ops.cache_clear()


# 300 and 200 rows span several query blocks (QUERY_BLOCK = 128), the last one partial.
@pytest.mark.parametrize("num_cached,q_len", [(0, 37), (16, 16), (23, 40), (150, 7), (0, 300), (50, 200)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8])
def test_prefill_with_cached_context_matches_reference(num_cached, q_len, cache_dtype):
    """A chunk at positions [num_cached, num_cached + q_len) over a prefix already in the cache;
    an int8 cache holds the chunk's K/V within half a quantization step of each value."""
    num_heads, num_kv_heads = 6, 2
    key_cache, value_cache, g = random_caches(num_kv_heads, cache_dtype, seed=num_cached + q_len)
    context_len = num_cached + q_len
    table = torch.randperm(NUM_BLOCKS, generator=g)[:-(-context_len // BLOCK_SIZE)]
    query = torch.randn(q_len, num_heads, HEAD_DIM, generator=g)
    key = torch.randn(q_len, num_kv_heads, HEAD_DIM, generator=g)
    value = torch.randn(q_len, num_kv_heads, HEAD_DIM, generator=g)
    positions = range(num_cached, context_len)
    slots = torch.tensor([int(table[p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in positions])
    metadata = AttentionMetadata(slot_mapping=slots, prefills=[PrefillSequence(0, q_len, context_len, table)])
    scale = HEAD_DIM ** -0.5
    out = paged_attention(query, key, value, key_cache, value_cache, metadata, scale)
    # paged_attention wrote the chunk's K/V into its slots.
    for cache, rows in ((key_cache, key), (value_cache, value)):
        written = cached_values(cache.view(-1, num_kv_heads, cache.shape[-1])[slots])
        step = rows.abs().amax(-1, keepdim=True).double() / 127 if cache_dtype == torch.int8 else 0
        assert ((written - rows.double()).abs() <= step / 2 * (1 + 1e-6)).all()
    expected = dense_reference(query, key_cache, value_cache, table.tolist(), context_len, list(positions), scale)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_mixed_batch_of_decodes_and_prefill_chunks(kernel):
    """Decode rows first, then two prefill chunks (one with context): each row as alone."""
    num_heads, num_kv_heads = 4, 2
    key_cache, value_cache, g = random_caches(num_kv_heads, torch.float32, seed=11)
    blocks = torch.randperm(NUM_BLOCKS, generator=g)
    # (context already in the cache, new tokens, block table)
    seqs = [(40, 1, blocks[0:3]), (5, 1, blocks[3:4]), (0, 20, blocks[4:6]), (33, 12, blocks[6:9])]
    rows, slots, prefills = 0, [], []
    for num_cached, num_new, table in seqs:
        end = num_cached + num_new
        slots += [int(table[p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(num_cached, end)]
        if num_new > 1:
            prefills.append(PrefillSequence(rows, rows + num_new, end, table))
        rows += num_new
    query = torch.randn(rows, num_heads, HEAD_DIM, generator=g)
    key = torch.randn(rows, num_kv_heads, HEAD_DIM, generator=g)
    value = torch.randn(rows, num_kv_heads, HEAD_DIM, generator=g)
    decode_tables = torch.stack([blocks[0:3], blocks[3:4].repeat(3)])  # padded with a valid id
    metadata = AttentionMetadata(slot_mapping=torch.tensor(slots), num_decode_tokens=2,
                                 decode_block_tables=decode_tables,
                                 decode_context_lens=torch.tensor([41, 6]), prefills=prefills)
    out = paged_attention(query, key, value, key_cache, value_cache, metadata, 0.25)
    row = 0
    for num_cached, num_new, table in seqs:
        end = num_cached + num_new
        expected = dense_reference(query[row:row + num_new], key_cache, value_cache, table.tolist(), end,
                                   list(range(num_cached, end)), 0.25)
        torch.testing.assert_close(out[row:row + num_new].double(), expected, rtol=1e-5, atol=1e-5)
        row += num_new


@pytest.mark.parametrize("q_len", [48, 300])
def test_prefill_bf16_close_to_fp32(q_len):
    num_heads, num_kv_heads = 4, 2
    key_cache, value_cache, g = random_caches(num_kv_heads, torch.float32, seed=2)
    query = torch.randn(q_len, num_heads, HEAD_DIM, generator=g)
    key = torch.randn(q_len, num_kv_heads, HEAD_DIM, generator=g)
    value = torch.randn(q_len, num_kv_heads, HEAD_DIM, generator=g)
    seq = PrefillSequence(0, q_len, q_len, torch.arange(-(-q_len // BLOCK_SIZE)))
    expected = prefill_attention(query, key, value, key_cache, value_cache, seq, 0.2)
    out = prefill_attention(query.bfloat16(), key.bfloat16(), value.bfloat16(), key_cache.bfloat16(),
                            value_cache.bfloat16(), seq, 0.2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=2 ** -6, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
def test_sdpa_prefill_after_a_cached_prefix_equals_masked_softmax(dtype, num_heads, num_kv_heads):
    """A chunk after a cached prefix (no window) takes two mask-free SDPA calls, prefix and
    chunk, merged by log-sum-exp (``_attention_over_prefix_and_chunk``, query heads folded per
    KV head): equal to a bottom-right causal softmax over the cache's rows in float64."""
    key_cache, value_cache, g = random_caches(num_kv_heads, dtype, seed=11)
    q_len, context_len = 40, 150
    table = torch.randperm(NUM_BLOCKS, generator=g)[:-(-context_len // BLOCK_SIZE)]
    query = torch.randn(q_len, num_heads, HEAD_DIM, generator=g).to(dtype)
    key = value = torch.zeros(q_len, num_kv_heads, HEAD_DIM, dtype=dtype)  # read from the cache
    seq = PrefillSequence(0, q_len, context_len, table)
    out = prefill_attention_sdpa(query, key, value, key_cache, value_cache, seq, 0.125)
    keys, values = (c[table].reshape(-1, num_kv_heads, HEAD_DIM)[:context_len].double()
                    .repeat_interleave(num_heads // num_kv_heads, dim=1) for c in (key_cache, value_cache))
    scores = torch.einsum("qhd,khd->hqk", query.double(), keys) * 0.125
    query_pos = torch.arange(context_len - q_len, context_len)[:, None]
    scores.masked_fill_(torch.arange(context_len)[None, :] > query_pos, float("-inf"))
    expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2 ** -7, "atol": 1e-2}
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, **tol)


@pytest.mark.parametrize("window", [50])
def test_sdpa_prefill_in_query_slices_equals_one_call(monkeypatch, window):
    """Under a sliding window ``prefill_attention_sdpa`` masks, and bounds the mask by slicing
    the queries (``SDPA_MASK_BYTES``): slices of 7 rows give what one call over all 40 rows
    gives."""
    from pagedllm.layers import attention as attention_module
    key_cache, value_cache, g = random_caches(2, torch.float32, seed=9)
    q_len, context_len = 40, 150
    table = torch.randperm(NUM_BLOCKS, generator=g)[:-(-context_len // BLOCK_SIZE)]
    query = torch.randn(q_len, 4, HEAD_DIM, generator=g)
    key = value = torch.zeros(q_len, 2, HEAD_DIM)  # read from the cache: a prefix is cached
    seq = PrefillSequence(0, q_len, context_len, table)
    whole = prefill_attention_sdpa(query, key, value, key_cache, value_cache, seq, 0.125, window)
    monkeypatch.setattr(attention_module, "SDPA_MASK_BYTES", 7 * context_len * 4)
    sliced = prefill_attention_sdpa(query, key, value, key_cache, value_cache, seq, 0.125, window)
    torch.testing.assert_close(sliced, whole, rtol=1e-6, atol=1e-6)


def loaded_variant() -> str:
    """The instruction-set variant of the loaded C++ ops (``pagedllm/cpu_isa.py``)."""
    return torch.ops.pagedllm.build_info().partition(" ")[0]


@pytest.mark.parametrize("amx,invariant,dtypes,q_len,context_len,path", [
    (True, "0", (torch.bfloat16, torch.bfloat16), 1024, 2048, "sdpa"),
    (True, "0", (torch.float32, torch.float32), 1024, 2048, "sdpa"),
    (True, "0", (torch.bfloat16, torch.bfloat16), 1024, 2047, "bf16"),
    (True, "0", (torch.float32, torch.bfloat16), 1024, 2048, "exact"),
    (False, "0", (torch.bfloat16, torch.bfloat16), 1024, 1024 + 8192, "bf16"),
    (False, "0", (torch.bfloat16, torch.bfloat16), 37, 40, "bf16"),
    (False, "1", (torch.bfloat16, torch.bfloat16), 37, 40, "exact"),
    (False, "0", (torch.float32, torch.float32), 1024, 2048, "exact"),
    (False, "0", (torch.bfloat16, torch.int8), 37, 40, "exact")])
def test_prefill_attention_picks_the_fastest_kernel(kernel, monkeypatch, amx, invariant, dtypes, q_len,
                                                    context_len, path):
    """On CPUs with AMX (patched), from ``SDPA_MIN_PAIRS`` query x key pairs with a cache of the
    query's dtype, prefill attention is torch's SDPA (AMX tiles, 2-5x faster there); else bf16
    over a bf16 cache is the AVX512_BF16 kernel where this build has it (the exact kernel under
    ``PAGEDLLM_BATCH_INVARIANT=1``), and everything else the exact kernel."""
    from pagedllm.layers import attention as attention_module
    if not kernel.prefill_attention_supported(HEAD_DIM):
        pytest.skip("this build has no exact prefill kernel (prefill_attention always uses SDPA)")
    assert 1024 * 2048 == attention_module.SDPA_MIN_PAIRS
    monkeypatch.setattr(attention_module, "amx_preferred", lambda: amx)
    monkeypatch.setenv("PAGEDLLM_BATCH_INVARIANT", invariant)
    if path == "bf16" and not kernel.prefill_attention_bf16_supported(HEAD_DIM):
        path = "exact"
    query_dtype, cache_dtype = dtypes
    num_blocks, num_heads, num_kv_heads = -(-context_len // BLOCK_SIZE), 2, 1
    g = torch.Generator().manual_seed(context_len)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    key_cache, value_cache = (torch.randn(shape, generator=g).to(query_dtype) for _ in range(2))
    if cache_dtype == torch.int8:
        key_cache, value_cache = quantize_kv(key_cache), quantize_kv(value_cache)
    else:
        key_cache, value_cache = key_cache.to(cache_dtype), value_cache.to(cache_dtype)
    table = torch.randperm(num_blocks, generator=g)
    query = torch.randn(q_len, num_heads, HEAD_DIM, generator=g).to(query_dtype)
    key = value = torch.zeros(q_len, num_kv_heads, HEAD_DIM, dtype=query_dtype)  # read from the cache
    seq, scale = PrefillSequence(0, q_len, context_len, table), HEAD_DIM ** -0.5
    out = prefill_attention(query, key, value, key_cache, value_cache, seq, scale)
    args = (query, key_cache, value_cache, table, context_len, scale)
    expected = {"sdpa": lambda: prefill_attention_sdpa(query, key, value, key_cache, value_cache, seq, scale),
                "bf16": lambda: kernel.paged_prefill_attention_bf16(*args),
                "exact": lambda: kernel.paged_prefill_attention(*args)}[path]()
    assert torch.equal(out, expected)


@pytest.mark.parametrize("num_prompt_tokens", [None, 30, 60, 100, 149, 150, 400])
def test_rows_of_output_tokens_take_the_exact_kernel(kernel, monkeypatch, num_prompt_tokens):
    """A chunk that recomputes a preempted request's output tokens (positions from
    ``num_prompt_tokens`` on, which decode steps computed first) gives those rows the exact
    kernel, bitwise the decode kernel's, and its prompt rows the bf16 kernel; a bf16 kernel row
    does not depend on where a chunk starts or ends (case B18: the recompute's chunks are not the
    first run's)."""
    from pagedllm.layers import attention as attention_module
    from pagedllm.layers.attention import prefill_attention

    if not kernel.prefill_attention_bf16_supported(HEAD_DIM):
        pytest.skip("no AVX512_BF16 prefill kernel in this build: bf16 prefill runs the exact kernel throughout")
    monkeypatch.delenv("PAGEDLLM_BATCH_INVARIANT", raising=False)
    monkeypatch.setattr(attention_module, "amx_preferred", lambda: False)
    context_len, q_len, num_heads, num_kv_heads = 150, 90, 6, 2
    g = torch.Generator().manual_seed(18)
    num_blocks = -(-context_len // BLOCK_SIZE)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    key_cache, value_cache = (torch.randn(shape, generator=g).bfloat16() for _ in range(2))
    table = torch.randperm(num_blocks, generator=g)
    queries = torch.randn(context_len, num_heads, HEAD_DIM, generator=g).bfloat16()
    scale = HEAD_DIM ** -0.5
    first = context_len - q_len
    query, key = queries[first:], torch.zeros(q_len, num_kv_heads, HEAD_DIM, dtype=torch.bfloat16)

    def rows(name, begin, end):  # query rows at positions begin .. end - 1, in one call
        op = getattr(kernel, f"paged_prefill_attention{'_bf16' if name == 'bf16' else ''}")
        return op(queries[begin:end], key_cache, value_cache, table, end, scale)

    whole = rows("bf16", 0, context_len)
    assert not torch.equal(rows("exact", first, context_len), whole[first:])  # the kernels' rows differ
    for cut in (37, 64, 100):
        assert torch.equal(torch.cat([rows("bf16", 0, cut), rows("bf16", cut, context_len)]), whole)
    out = prefill_attention(query, key, key, key_cache, value_cache,
                            PrefillSequence(0, q_len, context_len, table, num_prompt_tokens), scale)
    split = context_len if num_prompt_tokens is None else min(context_len, max(first, num_prompt_tokens))
    expected = [rows("bf16", first, split)] if split > first else []
    expected += [rows("exact", split, context_len)] if split < context_len else []
    assert torch.equal(out, torch.cat(expected)) and torch.equal(out[:split - first], whole[first:split])


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (14, 2, 128), (4, 1, 256), (8, 8, 64)])
@pytest.mark.parametrize("num_cached,q_len,block_size", [(0, 1, 16), (0, 37, 16), (23, 40, 16), (150, 7, 16),
                                                         (5, 130, 16), (31, 33, 5), (64, 64, 1)])
def test_bf16_prefill_kernel_matches_reference_and_sdpa(kernel, num_heads, num_kv_heads, head_dim, num_cached,
                                                        q_len, block_size):
    """The AVX512_BF16 prefill kernel (online softmax over 32-key blocks, bf16 weights) against
    fp64 math on the cached values and against SDPA: the head shapes of SmolLM2, Qwen2.5-0.5B,
    Gemma 3 and a group of 1; chunks with and without a cached prefix that start and end inside
    key blocks and query tiles, a single token, block sizes that do not divide a key block.
    Builds without AVX512_BF16 refuse it (``prefill_attention_bf16_supported`` is False)."""
    args_ok = kernel.prefill_attention_bf16_supported(head_dim)
    assert args_ok == (loaded_variant() == "avx512_bf16")
    g = torch.Generator().manual_seed(num_cached + q_len + head_dim)
    context_len = num_cached + q_len
    num_blocks = -(-context_len // block_size) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = (torch.randn(shape, generator=g).bfloat16() for _ in range(2))
    table = torch.randperm(num_blocks, generator=g)[:-(-context_len // block_size)]
    query = (2 * torch.randn(q_len, num_heads, head_dim, generator=g)).bfloat16()
    scale = head_dim ** -0.5
    if not args_ok:
        with pytest.raises(ValueError, match=f"head_dim {head_dim} is not supported by this build"):
            kernel.paged_prefill_attention_bf16(query, key_cache, value_cache, table, context_len, scale)
        return
    out = kernel.paged_prefill_attention_bf16(query, key_cache, value_cache, table, context_len, scale)
    assert out.dtype == torch.bfloat16 and out.shape == query.shape
    positions = list(range(num_cached, context_len))
    expected = dense_reference(query, key_cache, value_cache, table.tolist(), context_len, positions, scale)
    # The weights' bf16 rounding (relative 2^-9) on top of the output's.
    torch.testing.assert_close(out.double(), expected, rtol=2 ** -7, atol=4e-3)
    chunk = torch.arange(num_cached, context_len)  # SDPA takes the chunk's own K/V as arguments
    key, value = (cache[table[chunk // block_size], chunk % block_size] for cache in (key_cache, value_cache))
    seq = PrefillSequence(0, q_len, context_len, table)
    sdpa = prefill_attention_sdpa(query, key, value, key_cache, value_cache, seq, scale)
    torch.testing.assert_close(out.float(), sdpa.float(), rtol=2 ** -6, atol=2e-2)


def test_bf16_prefill_kernel_rejects_bad_arguments(kernel):
    """Other dtypes, bad tables and lengths: ValueError naming the limit and the value."""
    key_cache, value_cache = (torch.randn(8, BLOCK_SIZE, 2, HEAD_DIM).bfloat16() for _ in range(2))
    query = torch.randn(20, 4, HEAD_DIM).bfloat16()
    if not kernel.prefill_attention_bf16_supported(HEAD_DIM):
        with pytest.raises(ValueError, match="not supported by this build"):
            kernel.paged_prefill_attention_bf16(query, key_cache, value_cache, torch.tensor([1, 2]), 20, 1.0)
        return
    with pytest.raises(ValueError, match="bfloat16 query and bfloat16 K/V caches"):
        kernel.paged_prefill_attention_bf16(query.float(), key_cache, value_cache, torch.tensor([1, 2]), 20, 1.0)
    with pytest.raises(ValueError, match="bfloat16 query and bfloat16 K/V caches"):
        kernel.paged_prefill_attention_bf16(query, quantize_kv(key_cache), quantize_kv(value_cache),
                                            torch.tensor([1, 2]), 20, 1.0)
    with pytest.raises(ValueError, match=r"block_table\[1\] = 8 is outside \[0, 8\)"):
        kernel.paged_prefill_attention_bf16(query, key_cache, value_cache, torch.tensor([5, 8]), 20, 1.0)
    with pytest.raises(ValueError, match=r"context_len 40 must be in \[q_len = 20, 32\]"):
        kernel.paged_prefill_attention_bf16(query, key_cache, value_cache, torch.tensor([1, 2]), 40, 1.0)
    with pytest.raises(ValueError, match="head_dim 48 is not supported"):
        kernel.paged_prefill_attention_bf16(torch.randn(4, 4, 48).bfloat16(), key_cache[..., :48].contiguous(),
                                            value_cache[..., :48].contiguous(), torch.tensor([1]), 4, 1.0)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (14, 2, 128), (4, 1, 256)])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.float32, torch.bfloat16), (torch.float32, torch.int8),
                                    (torch.bfloat16, torch.int8)])
@pytest.mark.parametrize("num_cached,q_len", [(0, 1), (0, 37), (23, 40), (150, 7), (5, 130)])
def test_prefill_kernel_matches_reference_and_sdpa(kernel, monkeypatch, num_heads, num_kv_heads, head_dim, dtypes,
                                                   num_cached, q_len):
    """The C++ prefill kernel (16 x 16 tiles, K/V through the block table)
    against fp64 math on the cached values and against the SDPA path, for every dtype pair
    (an int8 cache under either query dtype) and the head shapes of SmolLM2, Qwen2.5-0.5B and
    Gemma 3; chunks with and without a cached prefix, partial tiles, a single token."""
    if not kernel.prefill_attention_supported(head_dim):
        pytest.skip("this build has no exact prefill kernel (prefill_attention uses SDPA)")
    query_dtype, cache_dtype = dtypes
    key_cache, value_cache, g = random_caches(num_kv_heads, cache_dtype, seed=num_cached + q_len, head_dim=head_dim)
    context_len = num_cached + q_len
    table = torch.randperm(NUM_BLOCKS, generator=g)[:-(-context_len // BLOCK_SIZE)]
    query = torch.randn(q_len, num_heads, head_dim, generator=g).to(query_dtype)
    key = torch.randn(q_len, num_kv_heads, head_dim, generator=g).to(query_dtype)
    value = torch.randn(q_len, num_kv_heads, head_dim, generator=g).to(query_dtype)
    positions = list(range(num_cached, context_len))
    slots = torch.tensor([int(table[p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in positions])
    write_kv_cache(key, value, key_cache, value_cache, slots)
    seq = PrefillSequence(0, q_len, context_len, table)
    scale = head_dim ** -0.5
    out = kernel.paged_prefill_attention(query, key_cache, value_cache, table, context_len, scale)
    assert out.dtype == query_dtype and out.shape == query.shape
    monkeypatch.setenv("PAGEDLLM_BATCH_INVARIANT", "1")  # bf16 otherwise takes the AVX512_BF16 kernel
    torch.testing.assert_close(prefill_attention(query, key, value, key_cache, value_cache, seq, scale), out,
                               rtol=0, atol=0)
    expected = dense_reference(query, key_cache, value_cache, table.tolist(), context_len, positions, scale)
    tolerance = dict(rtol=1e-5, atol=1e-5) if query_dtype == torch.float32 else dict(rtol=2 ** -8, atol=1e-3)
    torch.testing.assert_close(out.double(), expected, **tolerance)
    sdpa = prefill_attention_sdpa(query, key, value, key_cache, value_cache, seq, scale)
    torch.testing.assert_close(out.float(), sdpa.float(), **(dict(rtol=1e-5, atol=1e-5) if query_dtype == torch.float32
                                                             else dict(rtol=2 ** -6, atol=2e-2)))


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 8, 128), (9, 3, 64), (14, 2, 64)])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.float32, torch.bfloat16), (torch.float32, torch.int8),
                                    (torch.bfloat16, torch.int8)])
def test_decode_kernel_grouped_long_context_split_by_threads_bitwise(kernel, num_heads, num_kv_heads, head_dim,
                                                                      dtypes):
    """Grouped query heads (groups of 4, 3 and 7: Qwen2.5's two passes of 4 + 3) are split by
    context from 4,096 tokens on (kMinGroupedSplitTokens):
    sequences of 4,095-5,000 tokens (the block table maps them onto the pool's 64 blocks, some
    more than once) give bitwise the same output at 1, 2 and 3 threads, alone or batched, and
    the reference's."""
    query_dtype, cache_dtype = dtypes
    key_cache, value_cache, g = random_caches(num_kv_heads, cache_dtype, seed=head_dim + num_heads, head_dim=head_dim)
    context_lens = torch.tensor([4096, 5000, 4095])  # the last one alone stays an item per KV head
    max_blocks = -(-5000 // BLOCK_SIZE)
    block_tables = torch.randint(NUM_BLOCKS, (len(context_lens), max_blocks), generator=g)
    query = torch.randn(len(context_lens), num_heads, head_dim, generator=g).to(query_dtype)
    scale = head_dim ** -0.5
    outs = check_same_at_1_2_3_threads_and_alone(kernel, query, key_cache, value_cache, block_tables, context_lens,
                                                 scale, 0)
    if query_dtype == torch.float32 and cache_dtype == torch.float32:
        expected = decode_reference(query, key_cache, value_cache, block_tables, context_lens, scale)
        torch.testing.assert_close(outs[0].double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (14, 2, 128), (4, 1, 256), (4, 4, 128)])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.float32, torch.bfloat16), (torch.float32, torch.int8),
                                    (torch.bfloat16, torch.int8)])
@pytest.mark.parametrize("num_cached,q_len", [(0, 37), (23, 40), (5, 130), (400, 150)])
def test_prefill_kernel_rows_equal_decode(kernel, num_heads, num_kv_heads, head_dim, dtypes, num_cached, q_len):
    """Each row of a prefill chunk is bitwise what the decode kernel gives that token as the last
    of its sequence: the same score order, softmax and weighted-sum order. This is what keeps
    recompute after preemption (prefill) equal to the decode steps it replays (case B18)."""
    if not kernel.prefill_attention_supported(head_dim):
        pytest.skip("this build has no exact prefill kernel (prefill_attention uses SDPA)")
    query_dtype, cache_dtype = dtypes
    key_cache, value_cache, g = random_caches(num_kv_heads, cache_dtype, seed=7 + q_len, head_dim=head_dim)
    context_len = num_cached + q_len
    table = torch.randperm(NUM_BLOCKS, generator=g)[:-(-context_len // BLOCK_SIZE)]
    query = torch.randn(q_len, num_heads, head_dim, generator=g).to(query_dtype)
    key = torch.randn(q_len, num_kv_heads, head_dim, generator=g).to(query_dtype)
    value = torch.randn(q_len, num_kv_heads, head_dim, generator=g).to(query_dtype)
    slots = torch.tensor([int(table[p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                          for p in range(num_cached, context_len)])
    write_kv_cache(key, value, key_cache, value_cache, slots)
    scale = head_dim ** -0.5
    out = kernel.paged_prefill_attention(query, key_cache, value_cache, table, context_len, scale)
    # Every row as its own decode sequence; every work split of the decode kernel (by KV head
    # or by context for a few sequences, by sequence for many) is bitwise the same.
    # Three rows of 401+ tokens on 2 threads without grouped queries are split by context (runs
    # of whole 128-token chunks).
    lens = torch.arange(num_cached + 1, context_len + 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for rows in (slice(0, 3), slice(0, q_len)):
            decoded = kernel.paged_decode_attention(query[rows], key_cache, value_cache,
                                                    table.repeat(q_len, 1)[rows], lens[rows], scale, 0)
            assert torch.equal(out[rows], decoded)
    finally:
        torch.set_num_threads(threads)


def test_prefill_kernel_rejects_bad_tables_and_lengths(kernel):
    if not kernel.prefill_attention_supported(HEAD_DIM):
        pytest.skip("this build has no exact prefill kernel")
    key_cache, value_cache, g = random_caches(2, torch.float32, seed=3)
    query = torch.randn(20, 4, HEAD_DIM, generator=g)
    table = torch.tensor([5, 64])
    with pytest.raises(ValueError, match=r"block_table\[1\] = 64 is outside \[0, 64\)"):
        kernel.paged_prefill_attention(query, key_cache, value_cache, table, 20, 1.0)
    with pytest.raises(ValueError, match=r"context_len 40 must be in \[q_len = 20, 32\]"):
        kernel.paged_prefill_attention(query, key_cache, value_cache, torch.tensor([1, 2]), 40, 1.0)
    with pytest.raises(ValueError, match="head_dim 48 is not supported"):
        kernel.paged_prefill_attention(torch.randn(4, 4, 48), key_cache[..., :48].contiguous(),
                                       value_cache[..., :48].contiguous(), torch.tensor([1]), 4, 1.0)
