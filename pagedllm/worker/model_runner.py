"""Turns a scheduled batch into flat tensors, runs the model over the paged KV cache, samples.

Mechanism only: the scheduler has decided who runs and how many tokens each computes.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import numpy as np
import torch

from pagedllm.core.request import Request
from pagedllm.layers.attention import AttentionMetadata, PrefillSequence
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.worker.sampler import SamplingBatch, sample

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model and the KV cache tensors.

    The cache is one pair of tensors per layer, each ``[num_blocks, block_size, num_kv_heads,
    head_dim]`` in the compute dtype, allocated once, zero-filled lazily.

    Args:
        model: the loaded model.
        num_blocks, block_size: the pool's shape.
        seed: seed of the global generator for unseeded sampling.
    """

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.model = model
        config = model.config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.vocab_size = config.vocab_size
        dtype = model.embed_tokens.weight.dtype
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.kv_caches = [(_lazy_zeros(shape, dtype), _lazy_zeros(shape, dtype))
                          for _ in range(config.num_hidden_layers)]
        self.generator = torch.Generator().manual_seed(seed)

    @torch.inference_mode()
    def execute_model(self, scheduled: Sequence[tuple[Request, int]],
                      block_tables: dict[str, list[int]]) -> dict[str, int]:
        """Compute the scheduled tokens of every request and sample where a chunk ends a sequence.

        Args:
            scheduled: ``(request, num_new_tokens)``; the request computes tokens
                ``[num_computed_tokens, num_computed_tokens + num_new_tokens)``.
            block_tables: request_id -> physical block ids covering those tokens.

        Returns:
            request_id -> sampled token id, for requests whose chunk reaches ``num_tokens``.
        """
        # Single-token sequences first: they share one batched decode-attention call.
        decodes = [(r, n) for r, n in scheduled if n == 1]
        prefills = [(r, n) for r, n in scheduled if n > 1]
        ordered = decodes + prefills

        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_requests: list[Request] = []
        prefill_seqs: list[PrefillSequence] = []
        block_size = self.block_size
        for request, num_new in ordered:
            start = request.num_computed_tokens
            end = start + num_new
            table = block_tables[request.request_id]
            row = len(input_ids)
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
            if num_new > 1:
                prefill_seqs.append(PrefillSequence(row, row + num_new, end,
                                                    torch.tensor(table[:-(-end // block_size)])))
            if end == request.num_tokens:
                sample_rows.append(row + num_new - 1)
                sample_requests.append(request)

        metadata = AttentionMetadata(slot_mapping=torch.tensor(slots), prefills=prefill_seqs,
                                     num_decode_tokens=len(decodes))
        if decodes:
            context_lens = [r.num_computed_tokens + 1 for r, _ in decodes]
            max_blocks = -(-max(context_lens) // block_size)
            tables = [block_tables[r.request_id][:max_blocks] for r, _ in decodes]
            metadata.decode_block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])
            metadata.decode_context_lens = torch.tensor(context_lens)

        hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), self.kv_caches, metadata)
        if not sample_requests:
            return {}
        logits = self.model.compute_logits(hidden[sample_rows])
        batch = SamplingBatch.build([r.sampling_params for r in sample_requests],
                                    [r.generator for r in sample_requests], logits.shape[-1])
        token_ids = sample(logits, batch, self.generator).tolist()
        return {r.request_id: t for r, t in zip(sample_requests, token_ids)}


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor whose pages the OS maps on first touch (calloc through numpy).

    ``torch.zeros`` writes every byte up front: for a multi-GiB KV pool that is tens of seconds
    of page faults at start and the whole budget resident at once. Zeros (not ``empty``) matter:
    padded slots of a block are read by the attention and must hold finite values.
    """
    numel = 1
    for dim in shape:
        numel *= dim
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
