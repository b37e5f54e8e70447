"""How many KV blocks fit (vLLM's ``Worker.determine_available_memory``, nano-vllm's
``allocate_kv_cache``): the memory left after the weights and one step's activation peak.

Mechanism for the engine's constructor: it picks the number, the engine builds the pool.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from pagedllm.config import EngineArgs, kv_cache_bytes_per_block
from pagedllm.core.scheduled_batch import SamplingInput, ScheduledBatch, ScheduledRequest
from pagedllm.distributed.parallel_state import collectives_disabled
from pagedllm.platform import machine_memory, peak_rss_bytes, process_rss_bytes, reset_peak_rss
from pagedllm.sampling_params import SamplingParams
from pagedllm.utils import cdiv
from pagedllm.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from pagedllm.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def bytes_per_block(model: "LlamaForCausalLM", block_size: int, kv_cache_dtype: torch.dtype) -> int:
    """Bytes of one block's K and V over every layer, of the KV heads ``model`` holds (a
    tensor-parallel shard: this rank's; every rank holds as many)."""
    c = model.config
    return kv_cache_bytes_per_block(c.num_hidden_layers, model.num_kv_heads_per_rank, c.head_dim,
                                    block_size, kv_cache_dtype)


def determine_num_blocks(model: "LlamaForCausalLM", args: EngineArgs, kv_cache_dtype: torch.dtype,
                         other_ranks_memory: int = 0, draft_bytes_per_block: int = 0) -> int:
    """``num_gpu_blocks_override``, else ``kv_cache_memory_bytes`` in blocks, else what
    ``memory_utilization`` of the machine leaves after this process and one step's activation
    peak (profiled with a ``max_num_batched_tokens`` prefill).

    With a draft model (``speculative_config`` method ``draft_model``, loaded before this is
    called so that its weights count as used) each block of the target's pool has a twin in the
    draft's (``draft_bytes_per_block``): the budget is split so that both pools get the number
    returned. The draft's activation peak is not profiled: its forwards run between the
    target's, and a draft is smaller.

    Under tensor parallelism (``model`` is rank 0's shard of ``args.tensor_parallel_size``)
    the budget is the machine's, shared by the ranks: a block costs every rank's part of it,
    the other ranks' resident bytes (``other_ranks_memory``) count as used, and each rank is
    taken to peak as rank 0 does (profiled alone, the all-reduces skipped).

    Raises:
        ValueError: a budget that holds no block.
    """
    tp_size = args.tensor_parallel_size
    block_bytes = bytes_per_block(model, args.block_size, kv_cache_dtype) * tp_size + draft_bytes_per_block
    if args.num_gpu_blocks_override is not None:
        return args.num_gpu_blocks_override
    if args.kv_cache_memory_bytes is not None:
        budget = args.kv_cache_memory_bytes
    else:
        total, available = machine_memory()
        used = process_rss_bytes() + other_ranks_memory
        with collectives_disabled():
            peak = profile_activation_peak(model, args, kv_cache_dtype) * tp_size
        allowed = min(args.memory_utilization * total, used + available)
        budget = int(allowed - used - peak)
        logger.info("memory: %.0f MiB total, process %.0f MiB, warm-up activation peak %.0f MiB, "
                    "KV budget %.0f MiB", total / 2**20, used / 2**20, peak / 2**20, budget / 2**20)
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise ValueError(f"the KV cache budget ({budget} bytes) holds no block of {block_bytes} "
                         "bytes: raise kv_cache_memory_bytes or memory_utilization")
    return int(num_blocks)


def profile_activation_peak(model: "LlamaForCausalLM", args: EngineArgs, kv_cache_dtype: torch.dtype) -> int:
    """Peak extra resident memory (bytes) of one step at ``max_num_batched_tokens``."""
    num_tokens = min(args.max_num_batched_tokens, model.config.max_position_embeddings)
    runner = ModelRunner(model, cdiv(num_tokens, args.block_size), args.block_size,
                         kv_cache_dtype=kv_cache_dtype)
    request = ScheduledRequest("profile", [0] * num_tokens, 0, list(range(runner.num_blocks)),
                               (SamplingInput("profile", SamplingParams(max_tokens=1)),))
    before = process_rss_bytes()
    reset_peak_rss()
    runner.execute_model(ScheduledBatch([request]))
    peak = peak_rss_bytes()
    return max(0, (before if peak is None else peak) - before)
