"""Attention that reads K/V through block tables (PagedAttention, Kwon et al. 2023, section 4.1).

The KV cache of one layer is two tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``,
in the compute dtype or, with ``kv_cache_dtype="bfloat16"`` under fp32 compute, in bfloat16
(K/V are rounded when written and widened to fp32 when read; all arithmetic stays fp32).
With ``kv_cache_dtype="int8"`` they are int8 ``[num_blocks, block_size, num_kv_heads, head_dim
+ 4]``: each KV head's row is quantized when written (``quantize_kv``: symmetric, one fp32 scale
per token and KV head, stored in the row's last 4 bytes) and read as ``code * scale``; the
kernels fold the scale into each score and softmax weight, and round each query head the same
way so that a score is an integer dot product (``as_cached_query``). A
token at position ``p`` of a sequence lives in slot ``p % block_size`` of physical block
``block_table[p // block_size]``; its flat slot index (``slot_mapping``) is
``block_id * block_size + p % block_size``.

Sliding-window (local) attention, as Gemma 3's local layers use it: with ``sliding_window = W``
the token at position ``p`` attends to positions ``p - W + 1 .. p`` only (HF
``masking_utils.sliding_window_overlay``: ``kv_idx > q_idx - W``). Every block stays allocated
(the blocks wholly before the window are only not read): freeing them, as vLLM's
``SlidingWindowManager`` does, is left out.

Attention logit soft-capping, as Gemma 2 uses it (``logit_softcap = c``): each scaled score
``s`` becomes ``c * tanh(s / c)`` before the mask and the softmax (HF ``modeling_gemma2.py``:
``eager_attention_forward``). The C++ kernels do not cap, so a capped attention always runs the
torch formulation here (``attention_softcapped``), decode and prefill alike; the model
chooses it once, when it is built, by passing ``logit_softcap``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import torch
import torch.nn.functional as F

from pagedllm import envs
from pagedllm.layers.custom_op import CustomOp
from pagedllm.layers.linear import amx_preferred
from pagedllm.layers.ops import dequantize_kv, quantize_kv, reshape_and_cache_


@dataclass
class PrefillSequence:
    """One sequence computing more than one token this step.

    Attributes:
        start, end: its rows in the flat token batch.
        context_len: tokens in the cache after this step (``num_computed_tokens + end - start``).
        block_table: ``[num_blocks_of_seq]`` int64 physical block ids.
        num_prompt_tokens: the sequence's prompt length, or None (every row a prompt token).
            Rows at later positions are output tokens that decode steps computed first and a
            recompute after preemption computes again: ``prefill_attention`` gives them the
            kernel whose rows are bitwise the decode kernel's.
    """

    start: int
    end: int
    context_len: int
    block_table: torch.Tensor
    num_prompt_tokens: Optional[int] = None


@dataclass
class AttentionMetadata:
    """Where each token of the flat batch writes and reads its K/V.

    The batch holds the decode tokens first (one token per sequence), then the prefill chunks.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64 flat slot for each token's new K/V.
        num_decode_tokens: how many leading rows are single-token sequences.
        decode_block_tables: ``[num_decode_tokens, max_blocks]`` int64, padded with 0.
        decode_context_lens: ``[num_decode_tokens]`` int64, tokens in cache including the new one.
        prefills: the multi-token sequences, in batch order.
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None
    prefills: list[PrefillSequence] = field(default_factory=list)


def read_kv_cache(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows ``[..., row_width]`` as ``[..., head_dim]`` values in ``dtype``."""
    return dequantize_kv(rows, dtype) if rows.dtype == torch.int8 else rows.to(dtype)


def as_cached(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` ``[..., head_dim]`` as a cache of ``cache_dtype`` gives it back: rounded to bfloat16
    or through int8 and back, in ``x``'s dtype."""
    if cache_dtype == torch.int8:
        return dequantize_kv(quantize_kv(x), x.dtype)
    return x.to(cache_dtype).to(x.dtype) if cache_dtype != x.dtype else x


def as_cached_query(query: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """The query and softmax scale that attention over a cache of ``cache_dtype`` uses.

    Over an int8 cache the kernels round each query head as a cache row (``quantize_kv`` of
    ``query * scale``) and score in integers; this returns that rounded query, in ``query``'s
    dtype, with scale 1. Other caches: ``(query, scale)`` unchanged.
    """
    if cache_dtype != torch.int8:
        return query, scale
    return dequantize_kv(quantize_kv(query.float() * scale), query.dtype), 1.0


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new K/V ``[num_tokens, num_kv_heads, head_dim]`` into their slots, in place."""
    num_tokens = key.shape[0]
    reshape_and_cache_(key.reshape(num_tokens, -1), value.reshape(num_tokens, -1), key_cache,
                       value_cache, slot_mapping)


def attention_softcapped(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                         scale: float, logit_softcap: float) -> torch.Tensor:
    """Soft-capped attention (Gemma 2) in the operations and order of HF ``eager_attention_forward``:
    ``softmax(c * tanh(q k^T * scale / c) + mask)`` in fp32, rounded to the query's dtype, times v.

    Args:
        query: ``[batch, num_heads, q_len, head_dim]``; key/value ``[batch, num_heads, kv_len,
            head_dim]`` (KV heads already repeated for each query head).
        mask: bool, broadcastable to ``[batch, num_heads, q_len, kv_len]``; True where a query
            may attend.

    Returns:
        ``[batch, num_heads, q_len, head_dim]``.
    """
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    scores = torch.tanh(scores / logit_softcap) * logit_softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value)


def paged_decode_attention_torch(query: torch.Tensor, key_cache: torch.Tensor,
                                 value_cache: torch.Tensor, block_tables: torch.Tensor,
                                 context_lens: torch.Tensor, scale: float,
                                 sliding_window: Optional[int] = None,
                                 logit_softcap: Optional[float] = None) -> torch.Tensor:
    """Decode attention by gathering K/V through the block tables with torch indexing.

    The reference the C++ kernel is tested against, and the fallback where it cannot be built.
    It copies every sequence's blocks, padded to the longest, before attending: memory traffic
    about three times the K/V size, which is why the kernel exists (see bench/README.md).

    Args:
        query: ``[num_seqs, num_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, the
            query's dtype or bfloat16; or int8 ``[..., head_dim + 4]`` (``quantize_kv``).
        block_tables: ``[num_seqs, max_blocks]`` int64; entries past a sequence's last block
            must still be valid block ids (0 is used as padding).
        context_lens: ``[num_seqs]`` int64 in ``[1, max_blocks * block_size]``.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        sliding_window: attend to the last ``sliding_window`` tokens of each context only
            (None: all of them).
        logit_softcap: cap the scores (``attention_softcapped``; None: no cap).

    Returns:
        ``[num_seqs, num_heads, head_dim]`` in the query's dtype.
    """
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, row_width = key_cache.shape
    query, scale = as_cached_query(query, scale, key_cache.dtype)
    max_len = block_tables.shape[1] * block_size
    keys = read_kv_cache(key_cache[block_tables].view(num_seqs, max_len, num_kv_heads, row_width), query.dtype)
    values = read_kv_cache(value_cache[block_tables].view(num_seqs, max_len, num_kv_heads, row_width), query.dtype)
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)
    positions = torch.arange(max_len)
    mask = positions[None, :] < context_lens[:, None]
    if sliding_window is not None:
        mask &= positions[None, :] >= context_lens[:, None] - sliding_window
    mask = mask.view(num_seqs, 1, 1, max_len)
    if logit_softcap is not None:
        group = num_heads // num_kv_heads
        return attention_softcapped(query.unsqueeze(2), keys.repeat_interleave(group, dim=1),
                                    values.repeat_interleave(group, dim=1), mask, scale, logit_softcap).squeeze(2)
    out = F.scaled_dot_product_attention(query.unsqueeze(2), keys, values, attn_mask=mask,
                                         scale=scale, enable_gqa=num_heads != num_kv_heads)
    return out.squeeze(2)


def _check_sliding_window(sliding_window: Optional[int]) -> None:
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 (or None), got {sliding_window}")


class PagedDecodeAttention(CustomOp):
    """``paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale,
    sliding_window=None)``: attention of one new token per sequence over its cached context,
    read in place.

    ``forward_cpu`` is the C++ kernel (``pagedllm/csrc/paged_attention.cpp``: one work item per
    sequence x KV head, fp32 accumulation; a sliding window skips the blocks before it),
    ``forward_native`` is ``paged_decode_attention_torch``. Arguments and result as
    ``paged_decode_attention_torch``.

    Raises:
        ValueError: ``sliding_window`` < 1.
    """

    def __init__(self) -> None:
        super().__init__("paged_decode_attention")

    def forward_native(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                       sliding_window: Optional[int] = None) -> torch.Tensor:
        _check_sliding_window(sliding_window)
        return paged_decode_attention_torch(query, key_cache, value_cache, block_tables, context_lens, scale,
                                            sliding_window)

    def forward_cpu(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                    sliding_window: Optional[int] = None) -> torch.Tensor:
        _check_sliding_window(sliding_window)
        return torch.ops.pagedllm.paged_decode_attention(query, key_cache, value_cache, block_tables,
                                                         context_lens, scale, sliding_window or 0)


paged_decode_attention = PagedDecodeAttention()


def _expand_kv_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[kv_len, num_kv_heads, head_dim]`` -> ``[1, num_kv_heads * group, kv_len, head_dim]``.

    Repeating the KV heads costs one copy of the chunk's K/V; torch's flash SDPA on the CPU
    with ``enable_gqa`` measured ~1.7x slower than on repeated heads.
    """
    x = x.transpose(0, 1)
    if group > 1:
        x = x.repeat_interleave(group, dim=0)
    return x.unsqueeze(0)


# Query x key pairs of a chunk from which torch's flash SDPA outruns the C++ kernel. Measured
# on an Intel Xeon with AMX (2 cores, 2026-12-04, `bench/prefill_attention.py`): in bf16 SDPA
# took 0.21-0.42x the kernel's time from 1,024 x 2,048 pairs up (torch's flash kernel runs AMX
# tiles), 0.6-0.9x below; in fp32 0.56-0.86x from there, 1.1-2.0x at 150-500 tokens.
SDPA_MIN_PAIRS = 1 << 21
# Most bytes of the additive mask ``prefill_attention_sdpa`` builds per SDPA call (under a
# sliding window; without one a chunk after a cached prefix needs no mask).
SDPA_MASK_BYTES = 32 << 20


def sdpa_is_faster(q_len: int, context_len: int, dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether ``prefill_attention`` runs a chunk of ``q_len`` queries over ``context_len``
    keys through SDPA rather than a C++ kernel: on CPUs with AMX-BF16 (``amx_preferred``, never
    under ``PAGEDLLM_BATCH_INVARIANT=1``), with a cache of the query's dtype, fp32 or bf16, from
    ``SDPA_MIN_PAIRS`` pairs."""
    if cache_dtype != dtype or dtype not in (torch.float32, torch.bfloat16):
        return False
    return amx_preferred() and q_len * context_len >= SDPA_MIN_PAIRS


def bf16_kernel_preferred(dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether a bf16 chunk over a bf16 cache goes to ``paged_prefill_attention_bf16`` (AVX512_BF16
    dot products, weights rounded to bf16) rather than the exact kernel, where the build has it:
    always but under ``PAGEDLLM_BATCH_INVARIANT=1``, which keeps rows bitwise the decode
    kernel's. Measured on an AMD EPYC Zen 4 (2 cores, 2026-12-06, ``bench/prefill_attention.py``):
    0.14-0.63x the exact kernel's time and 0.20-0.55x SDPA's, from 150 x 150 to 2,048 x 16,384."""
    return dtype == cache_dtype == torch.bfloat16 and not envs.PAGEDLLM_BATCH_INVARIANT


class PrefillAttention(CustomOp):
    """``prefill_attention(query, key, value, key_cache, value_cache, seq, scale,
    sliding_window=None)``: causal attention of a chunk of ``q_len`` tokens over its cached
    prefix and itself.

    ``forward_cpu`` runs the rows whose context a sliding window cuts through the C++ decode
    kernel (``windowed_rows_as_decode``); the others, where SDPA is not faster
    (``sdpa_is_faster``), a C++ kernel that reads K/V through ``seq.block_table``: for bf16 over
    a bf16 cache (``bf16_kernel_preferred``) ``csrc/prefill_attention_bf16.cpp`` (AVX512_BF16
    builds), else ``csrc/prefill_attention.cpp`` (AVX-512 and AVX2 builds; each row bitwise the decode
    kernel's); both take head_dim 64, 128 or 256. Otherwise ``prefill_attention_sdpa``
    (``forward_native``). Arguments and result as ``prefill_attention_sdpa``.
    """

    def __init__(self) -> None:
        super().__init__("paged_prefill_attention", prefill_attention_sdpa)
        self._supported: dict[tuple[str, int], bool] = {}  # fixed for the process's build

    def _kernel_supports(self, kernel: str, head_dim: int) -> bool:
        """Whether this build's ``torch.ops.pagedllm.paged_<kernel>`` takes ``head_dim``
        (its ``<kernel>_supported``)."""
        supported = self._supported.get((kernel, head_dim))
        if supported is None:
            check = getattr(torch.ops.pagedllm, f"{kernel}_supported")
            supported = self._supported[(kernel, head_dim)] = bool(check(head_dim))
        return supported

    def forward_cpu(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    key_cache: torch.Tensor, value_cache: torch.Tensor, seq: PrefillSequence, scale: float,
                    sliding_window: Optional[int] = None) -> torch.Tensor:
        head_dim = query.shape[2]
        if sliding_window is not None and sliding_window < seq.context_len:
            # Rows whose context the window does not cut yet attend as without one; the others
            # go through the decode kernel. Decided per row, so that a row takes the same path
            # in any chunk.
            first = seq.context_len - query.shape[0]
            uncut = min(query.shape[0], max(0, sliding_window - first))
            cut = windowed_rows_as_decode(query[uncut:], key_cache, value_cache, seq.block_table,
                                          seq.context_len, scale, sliding_window)
            if not uncut:
                return cut
            return torch.cat([self.forward_cpu(query[:uncut], key[:uncut], value[:uncut], key_cache, value_cache,
                                               replace(seq, context_len=first + uncut), scale), cut])
        if not sdpa_is_faster(query.shape[0], seq.context_len, query.dtype, key_cache.dtype):
            exact = self._kernel_supports("prefill_attention", head_dim)
            if (bf16_kernel_preferred(query.dtype, key_cache.dtype)
                    and self._kernel_supports("prefill_attention_bf16", head_dim)):
                # Prompt rows on bf16 dot products; rows of output tokens (a recompute after
                # preemption) in the exact kernel, as the decode steps that first computed them,
                # so that their K/V and every later token stay bitwise those of the run without
                # preemption (case B18).
                first = seq.context_len - query.shape[0]
                prompt_rows = query.shape[0] if seq.num_prompt_tokens is None or not exact else \
                    min(query.shape[0], max(0, seq.num_prompt_tokens - first))
                outputs = []
                if prompt_rows:
                    outputs.append(torch.ops.pagedllm.paged_prefill_attention_bf16(
                        query[:prompt_rows], key_cache, value_cache, seq.block_table, first + prompt_rows, scale))
                if prompt_rows < query.shape[0]:
                    outputs.append(torch.ops.pagedllm.paged_prefill_attention(
                        query[prompt_rows:], key_cache, value_cache, seq.block_table, seq.context_len, scale))
                return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
            if exact:
                return torch.ops.pagedllm.paged_prefill_attention(query, key_cache, value_cache, seq.block_table,
                                                                  seq.context_len, scale)
        return prefill_attention_sdpa(query, key, value, key_cache, value_cache, seq, scale, sliding_window)


def windowed_rows_as_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_table: torch.Tensor, context_len: int, scale: float,
                            sliding_window: int) -> torch.Tensor:
    """Prefill rows under a sliding window, each as a decode row of its own (the C++ decode
    kernel, context length its position + 1): bitwise what a decode step gives that token, so
    a prompt computed in any chunks, or after a prefix-cache hit, gets the same K/V and logits
    (Gemma 3's local layers; SDPA over a masked chunk rounds differently with the chunk: a bf16
    Gemma 3 270M's first-token logprob moved by up to 0.06 between a fresh prompt and the same
    prompt after a cache hit). Each row reads only its window's K/V rows, where SDPA computes
    every masked pair.

    Args:
        query: ``[q_len, num_heads, head_dim]`` at positions ``context_len - q_len ..
            context_len - 1``, their K/V already in the cache; block_table: ``[num_blocks]`` int64.

    Returns:
        ``[q_len, num_heads, head_dim]``.
    """
    q_len = query.shape[0]
    context_lens = torch.arange(context_len - q_len + 1, context_len + 1)
    block_tables = block_table.unsqueeze(0).expand(q_len, -1).contiguous()
    return torch.ops.pagedllm.paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens,
                                                     scale, sliding_window)


def prefill_attention_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           key_cache: torch.Tensor, value_cache: torch.Tensor,
                           seq: PrefillSequence, scale: float,
                           sliding_window: Optional[int] = None,
                           logit_softcap: Optional[float] = None) -> torch.Tensor:
    """Causal attention of a chunk of ``q_len`` tokens over its cached prefix and itself, by
    torch's SDPA (the fallback of ``prefill_attention`` and the reference its kernel is tested
    against).

    All tensors given to SDPA are 4-D: torch dispatches 3-D inputs to its unfused math path,
    measured ~10x slower on this CPU than the flash kernel 4-D inputs get. A chunk with a
    cached prefix (chunked prefill, prefix-cache hit) gathers that prefix through its block
    table, a copy of ``context_len`` K/V rows, small next to the ``q_len x context_len``
    attention itself.

    Every K/V row is used as the cache holds it (rounded to bfloat16 under a bfloat16 cache,
    through int8 under an int8 one, where the query is rounded too: ``as_cached_query``), so a
    prompt gets the same attention whether it is computed in one chunk or several.

    Args:
        query: ``[q_len, num_heads, head_dim]``; key/value: ``[q_len, num_kv_heads, head_dim]``
            (the chunk's own K/V, already written to the cache).
        seq: where the chunk sits; the first ``context_len - q_len`` tokens are read from the
            cache through ``seq.block_table`` (with a sliding window, only those some query of
            the chunk can see).
        sliding_window: each query sees the last ``sliding_window`` positions up to its own
            (None: all of them).
        logit_softcap: cap the scores (``attention_softcapped``, in place of SDPA; None: no cap).

    Returns:
        ``[q_len, num_heads, head_dim]``.
    """
    q_len, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    query, scale = as_cached_query(query, scale, key_cache.dtype)
    q = query.transpose(0, 1).unsqueeze(0)
    ctx = seq.context_len
    window = sliding_window if sliding_window is not None and sliding_window < ctx else None
    if ctx == q_len and window is None and logit_softcap is None:
        key, value = as_cached(key, key_cache.dtype), as_cached(value, value_cache.dtype)
        out = F.scaled_dot_product_attention(q, _expand_kv_heads(key, group),
                                             _expand_kv_heads(value, group), is_causal=True,
                                             scale=scale)
        return out[0].transpose(0, 1)
    # The chunk's first query (position ctx - q_len) sees keys from position ``first`` on.
    first = 0 if window is None else max(0, ctx - q_len - window + 1)
    row_width = key_cache.shape[-1]
    keys = read_kv_cache(key_cache[seq.block_table].view(-1, num_kv_heads, row_width)[first:ctx], query.dtype)
    values = read_kv_cache(value_cache[seq.block_table].view(-1, num_kv_heads, row_width)[first:ctx], query.dtype)
    key_pos = torch.arange(first, ctx)[None, :]

    def hidden_keys(start: int, end: int) -> torch.Tensor:
        """Bottom-right aligned causal mask of queries start..end-1: query i (position
        ctx - q_len + i) sees keys up to that position, within a window only the last
        ``window`` of them."""
        query_pos = torch.arange(ctx - q_len + start, ctx - q_len + end)[:, None]
        hidden = key_pos > query_pos
        if window is not None:
            hidden |= key_pos <= query_pos - window
        return hidden

    if window is None and logit_softcap is None:
        return _attention_over_prefix_and_chunk(query, keys, values, ctx - q_len, scale)
    keys, values = _expand_kv_heads(keys, group), _expand_kv_heads(values, group)
    if logit_softcap is not None:
        out = attention_softcapped(q, keys, values, ~hidden_keys(0, q_len), scale, logit_softcap)
        return out[0].transpose(0, 1)
    # The mask is [rows, context] per call: queries go in slices of at most SDPA_MASK_BYTES of
    # it, so a chunk over a long context does not hold a 256 MiB fp32 mask.
    rows = max(1, SDPA_MASK_BYTES // ((ctx - first) * query.element_size()))
    out = torch.empty_like(q)
    for start in range(0, q_len, rows):
        end = min(q_len, start + rows)
        mask = torch.zeros(end - start, ctx - first, dtype=query.dtype).masked_fill_(hidden_keys(start, end),
                                                                                      float("-inf"))
        out[:, :, start:end] = F.scaled_dot_product_attention(q[:, :, start:end], keys, values, attn_mask=mask,
                                                              scale=scale)
    return out[0].transpose(0, 1)


def _attention_over_prefix_and_chunk(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                     num_cached: int, scale: float) -> torch.Tensor:
    """Causal attention of a chunk after ``num_cached`` cached tokens, without a mask: the
    chunk's queries over the cached prefix (every pair visible) and over the chunk itself
    (causal), two flash SDPA calls merged by their log-sum-exps, as FlashAttention merges
    its key blocks (Dao et al. 2022, section 3.1; vLLM's ``merge_attn_states``).

    The masked single call this replaces computed and masked every pair and built a
    ``[q_len, context]`` mask: on the last 2,048-token chunk of a 32k prompt (Llama-3.2-3B
    shape, bf16, AMX) 2.5 s of SDPA and 0.1 s of mask per layer against 1.4 s for the prefix
    call here (bench/README.md). The prefix call folds each KV head's query heads into rows
    (``[1, num_kv_heads, group * q_len, head_dim]``) so that the cached K/V is read in place,
    not repeated per query head.

    Args:
        query: ``[q_len, num_heads, head_dim]``, already ``as_cached_query``.
        keys, values: ``[num_cached + q_len, num_kv_heads, head_dim]`` as the cache holds them,
            any strides.
    Returns:
        ``[q_len, num_heads, head_dim]`` in ``query``'s dtype.
    """
    q_len, num_heads, head_dim = query.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    folded = query.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(
        1, num_kv_heads, group * q_len, head_dim)
    prefix_out, prefix_lse = flash(folded, keys[:num_cached].transpose(0, 1).unsqueeze(0),
                                   values[:num_cached].transpose(0, 1).unsqueeze(0), 0.0, False, scale=scale)
    own_out, own_lse = flash(query.transpose(0, 1).unsqueeze(0),
                             _expand_kv_heads(keys[num_cached:], group),
                             _expand_kv_heads(values[num_cached:], group), 0.0, True, scale=scale)
    prefix_out = prefix_out.reshape(num_heads, q_len, head_dim)
    prefix_lse = prefix_lse.reshape(num_heads, q_len, 1)
    own_out, own_lse = own_out[0], own_lse.reshape(num_heads, q_len, 1)
    lse = torch.logaddexp(prefix_lse, own_lse)
    out = prefix_out * (prefix_lse - lse).exp_() + own_out * (own_lse - lse).exp_()
    return out.to(query.dtype).transpose(0, 1)


prefill_attention = PrefillAttention()


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    key_cache: torch.Tensor, value_cache: torch.Tensor,
                    metadata: AttentionMetadata, scale: float,
                    sliding_window: Optional[int] = None,
                    logit_softcap: Optional[float] = None) -> torch.Tensor:
    """Write this step's K/V to the cache, then attend for every token of the flat batch.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``; key/value ``[num_tokens, num_kv_heads, head_dim]``.
        sliding_window: each token attends to the last ``sliding_window`` positions up to its
            own (None: all; see the module docstring).
        logit_softcap: soft-cap the scores (Gemma 2): the torch formulation, decode and
            prefill (see the module docstring). None: no cap.

    Returns:
        ``[num_tokens, num_heads, head_dim]``.
    """
    write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
    if logit_softcap is not None:
        return _paged_attention_softcapped(query, key, value, key_cache, value_cache, metadata, scale,
                                           sliding_window, logit_softcap)
    num_decode = metadata.num_decode_tokens
    if num_decode == query.shape[0] and not metadata.prefills:
        return paged_decode_attention(query, key_cache, value_cache, metadata.decode_block_tables,
                                      metadata.decode_context_lens, scale, sliding_window)
    out = torch.empty_like(query)
    if num_decode:
        out[:num_decode] = paged_decode_attention(query[:num_decode], key_cache, value_cache,
                                                  metadata.decode_block_tables,
                                                  metadata.decode_context_lens, scale, sliding_window)
    for seq in metadata.prefills:
        out[seq.start:seq.end] = prefill_attention(query[seq.start:seq.end], key[seq.start:seq.end],
                                                   value[seq.start:seq.end], key_cache, value_cache,
                                                   seq, scale, sliding_window)
    return out


def _paged_attention_softcapped(query, key, value, key_cache, value_cache, metadata: AttentionMetadata,
                                scale: float, sliding_window: Optional[int], logit_softcap: float) -> torch.Tensor:
    out = torch.empty_like(query)
    num_decode = metadata.num_decode_tokens
    if num_decode:
        out[:num_decode] = paged_decode_attention_torch(query[:num_decode], key_cache, value_cache,
                                                        metadata.decode_block_tables, metadata.decode_context_lens,
                                                        scale, sliding_window, logit_softcap)
    for seq in metadata.prefills:
        out[seq.start:seq.end] = prefill_attention_sdpa(query[seq.start:seq.end], key[seq.start:seq.end],
                                                        value[seq.start:seq.end], key_cache, value_cache, seq,
                                                        scale, sliding_window, logit_softcap)
    return out
