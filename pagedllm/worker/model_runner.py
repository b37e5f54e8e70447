"""Turns a scheduled batch into flat tensors, runs the model over the paged KV cache, samples.

Mechanism only: the scheduler has decided who runs and how many tokens each computes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from pagedllm.config import kv_row_width
from pagedllm.core.request import RequestId
from pagedllm.core.scheduled_batch import SamplingInput, ScheduledBatch, ScheduledRequest
from pagedllm.huge_pages import huge_page_zeros, populate_for_write
from pagedllm.layers.attention import AttentionMetadata, PrefillSequence
from pagedllm.layers.ops import argmax_logsumexp, native_ops
from pagedllm.lora.manager import LoRAMapping, LoRAModelManager
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.outputs import TokenLogprobs
from pagedllm.platform import tune_allocator
from pagedllm.worker.rejection_sampler import rejection_sample
from pagedllm.worker.step_inputs import StepInputs, broadcast_step
from pagedllm.worker.sampler import LOGPROB_FLOOR, SamplingMetadata, compute_logprobs, gather_logprobs, sample

logger = logging.getLogger(__name__)

# Prompt rows whose ``[rows, vocab]`` logprobs are materialized at once (bounds the memory of
# ``prompt_logprobs`` on long prompts: 256 x 49152 fp32 is 48 MiB).
_PROMPT_LOGPROBS_CHUNK = 256


@dataclass
class ModelRunnerOutput:
    """What one step produced.

    Attributes:
        sampled_token_ids: request_id -> new token, for requests whose chunk reached their
            last token (and max_tokens > 0).
        logprobs: request_id -> the sampled token's raw logprob, rank and top-k alternatives
            (k = the request's ``logprobs``, 0 when it did not ask: then only the logprob).
        prompt_logprobs: request_id -> records for the prompt positions this chunk covered
            that the request had not collected yet (position 0 never has one).
        num_accepted_tokens: request_id -> how many of the drafts it verified were accepted
            (requests that verified drafts only); ``sampled_token_ids`` then holds the token
            drawn after them.
        draft_logprobs: request_id -> the records of its accepted drafts, in order (the
            record of the token after them is in ``logprobs``).
    """

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    num_accepted_tokens: dict[str, int] = field(default_factory=dict)
    draft_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


@dataclass
class _ForwardResult:
    """The forward of one step: ``hidden`` ``[num_tokens, hidden_size]`` of the flat batch,
    the rows to sample (``sample_rows[i]`` for ``samples[i]``), the ``(request, first_row)``
    of requests whose rows give prompt logprobs, and the ``(request, first_row)`` of requests
    verifying drafts (``len(drafts) + 1`` rows each)."""

    hidden: torch.Tensor
    sample_rows: list[int]
    samples: list[SamplingInput]
    prompt_logprob_rows: list[tuple[ScheduledRequest, int]]
    spec_rows: list[tuple[ScheduledRequest, int]] = field(default_factory=list)


class ModelRunner:
    """Owns the model and the KV cache tensors.

    The cache is one pair of tensors per layer, each ``[num_blocks, block_size, num_kv_heads,
    head_dim]`` in ``kv_cache_dtype`` (``head_dim + 4`` int8 in an int8 cache: codes and their
    scale, ``layers.ops.quantize_kv``), allocated once, zero-filled lazily.

    Args:
        model: the loaded model.
        num_blocks, block_size: the pool's shape.
        seed: seed of the global generator for unseeded sampling.
        kv_cache_dtype: the cache's dtype (None: the model's), see ``EngineArgs.kv_cache_dtype``.
        broadcast_steps: rank 0 of a tensor-parallel group: send every step's inputs to the
            other ranks (``worker/step_inputs.py``) before computing it. The cache then holds
            only this rank's KV heads (``model.num_kv_heads_per_rank``).
        lora_manager: the model's LoRA adapters (``lora/manager.py``), None without LoRA.
    """

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, seed: int = 0,
                 kv_cache_dtype: Optional[torch.dtype] = None, broadcast_steps: bool = False,
                 lora_manager: Optional[LoRAModelManager] = None) -> None:
        self.model = model
        self.lora_manager = lora_manager
        config = model.config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.vocab_size = config.vocab_size
        self.broadcast_steps = broadcast_steps
        dtype = kv_cache_dtype or model.dtype
        shape = (num_blocks, block_size, model.num_kv_heads_per_rank, kv_row_width(config.head_dim, dtype))
        self.kv_caches = [(_lazy_zeros(shape, dtype), _lazy_zeros(shape, dtype))
                          for _ in range(config.num_hidden_layers)]
        self.generator = torch.Generator().manual_seed(seed)
        # Seeded sequences' own random streams, by request id (vLLM keeps them in its InputBatch).
        self._generators: dict[RequestId, torch.Generator] = {}
        self._warmed = 0  # slices of KV_WARM_SLICE bytes done by warm_kv_cache, all regions in turn
        tune_allocator()
        # Build or load the C++ ops now, not inside the first request's step
        # (a first build takes tens of seconds; even loading a cached one takes a moment).
        native_ops()

    @torch.inference_mode()
    def execute_model(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        """Compute the scheduled tokens of every request and sample where a chunk ends a sequence.

        Args:
            batch: the step (``core/scheduled_batch.py``): each request's tokens, positions
                and block table, the sequences to sample, copy-on-write copies, adapters.

        Returns:
            The tokens sampled for each request's ``samples`` (each draws from the same
            logits row), with their logprobs, and the prompt logprobs of the chunks computed.
            A request with drafts gets the number it accepted (``worker/rejection_sampler.py``)
            and the token after them.
        """
        for request_id in batch.finished_req_ids:
            self._generators.pop(request_id, None)
        for parent_id, child_id in batch.forked_streams:
            if parent_id in self._generators:
                self._generators[child_id] = torch.Generator().set_state(self._generators[parent_id].get_state())
        forward = self._forward(batch)
        output = ModelRunnerOutput()
        for request, first_row in forward.prompt_logprob_rows:
            _, targets, num_top = request.prompt_logprobs
            output.prompt_logprobs[request.request_id] = self._prompt_logprobs(
                forward.hidden[first_row:first_row + len(targets)], targets, num_top)
        if forward.spec_rows:
            self._verify_drafts(forward, output)
        samples = forward.samples
        if not samples:
            return output
        logits = self.model.compute_logits(forward.hidden[forward.sample_rows])
        sampled = sample(logits, self._sampling_metadata(samples, logits.shape[-1]), self.generator)
        token_ids = sampled.sampled_token_ids.tolist()
        token_logprobs = sampled.sampled_logprobs.tolist()
        ranks = sampled.sampled_ranks.tolist() if sampled.sampled_ranks is not None else None
        top_ids = sampled.top_token_ids.tolist() if sampled.top_token_ids is not None else None
        top_logprobs = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
        for row, sample_input in enumerate(samples):
            request_id = sample_input.request_id
            output.sampled_token_ids[request_id] = token_ids[row]
            k = sample_input.sampling_params.logprobs
            if k is None:
                output.logprobs[request_id] = TokenLogprobs([token_ids[row]], [token_logprobs[row]], [])
            else:
                output.logprobs[request_id] = TokenLogprobs(
                    [token_ids[row]] + top_ids[row][:k], [token_logprobs[row]] + top_logprobs[row][:k],
                    [ranks[row]] + list(range(1, k + 1)))
        return output

    def _sampling_metadata(self, samples: Sequence[SamplingInput], vocab_size: int) -> SamplingMetadata:
        """``SamplingMetadata`` of ``samples``, each seeded one drawing from its own stream
        (made on first use, kept until the request finishes: a preempted request continues it)."""
        generators = {}
        for sample_input in samples:
            seed = sample_input.seed
            if seed is not None and not sample_input.sampling_params.greedy:
                if sample_input.request_id not in self._generators:
                    self._generators[sample_input.request_id] = torch.Generator().manual_seed(seed)
                generators[sample_input.request_id] = self._generators[sample_input.request_id]
        return SamplingMetadata.build(samples, vocab_size, generators)

    def _verify_drafts(self, forward: "_ForwardResult", output: ModelRunnerOutput) -> None:
        """Rejection-sample the drafts of ``forward.spec_rows`` into ``output`` (tokens, the
        number accepted, and the raw logprob records of every emitted token)."""
        rows, samples, drafts = [], [], []
        for request, first_row in forward.spec_rows:
            request_drafts = request.spec_token_ids
            rows.extend(range(first_row, first_row + len(request_drafts) + 1))
            samples.extend(request.samples * (len(request_drafts) + 1))
            drafts.append(request_drafts)
        logits = self.model.compute_logits(forward.hidden[rows]).float()
        emitted = rejection_sample(logits, self._sampling_metadata(samples, logits.shape[-1]), drafts,
                                   self.generator)
        if any(request.samples[0].sampling_params.logprobs is not None for request, _ in forward.spec_rows):
            logprobs, log_norm = compute_logprobs(logits), None
        else:
            # Only cumulative_logprob needs the emitted tokens' logprobs: one pass per row for
            # the log-normalizer, as sample() takes it, instead of a full log-softmax.
            logprobs, log_norm = None, argmax_logsumexp(logits)[1]
        first = 0
        for (request, _), tokens in zip(forward.spec_rows, emitted):
            request_drafts = request.spec_token_ids
            k = request.samples[0].sampling_params.logprobs
            if log_norm is not None:
                rows = torch.arange(first, first + len(tokens))
                values = logits[rows, torch.tensor(tokens)] - log_norm[rows]
                values = torch.nan_to_num(values, nan=LOGPROB_FLOOR).clamp_(min=LOGPROB_FLOOR)
                records = [TokenLogprobs([token], [value], []) for token, value in zip(tokens, values.tolist())]
            else:
                values, ranks, top_ids, top_values = gather_logprobs(
                    logprobs[first:first + len(tokens)], torch.tensor(tokens), k or 0)
                records = [TokenLogprobs([token], [value], []) if k is None else
                           TokenLogprobs([token] + ids, [value] + tops, [rank] + list(range(1, k + 1)))
                           for token, value, rank, ids, tops in zip(tokens, values.tolist(), ranks.tolist(),
                                                                    top_ids.tolist(), top_values.tolist())]
            request_id = request.request_id
            output.sampled_token_ids[request_id] = tokens[-1]
            output.num_accepted_tokens[request_id] = len(tokens) - 1
            output.logprobs[request_id] = records[-1]
            output.draft_logprobs[request_id] = records[:-1]
            first += len(request_drafts) + 1

    def warm_kv_cache(self, max_bytes: int) -> int:
        """Take the first-write page faults of the KV pool ahead of use, about ``max_bytes`` at a
        time (what an idle server does between looks at its queue); contents are unchanged.

        The pool is mapped lazily (``_lazy_zeros``), so a block's first K/V write faults its
        pages in, inside a step: on the 2-core Zen 4 VM of bench/README.md a 2,048-token prefill
        step took 0.9 s on blocks used before and 1.4-1.6 s on fresh ones. Slices of
        ``KV_WARM_SLICE`` bytes go in block order (every layer's K and V cache at the same
        blocks, then the next blocks), the order in which the block pool hands out blocks
        never used (its free queue starts in block-id order; freed blocks go behind them).

        Returns:
            Bytes made resident by this call; 0 once the whole pool is (or where the kernel
            lacks ``MADV_POPULATE_WRITE``, Linux < 5.14).
        """
        regions = [cache for layer in self.kv_caches for cache in layer]
        region_bytes = regions[0].numel() * regions[0].element_size() if regions else 0
        slices_per_region = -(-region_bytes // KV_WARM_SLICE)
        done = 0
        while done < max_bytes and self._warmed < slices_per_region * len(regions):
            slice_index, region = divmod(self._warmed, len(regions))
            start = slice_index * KV_WARM_SLICE
            end = min(start + KV_WARM_SLICE, region_bytes)
            if not populate_for_write(regions[region], start, end):
                self._warmed = slices_per_region * len(regions)
                return 0
            self._warmed += 1
            done += end - start
        return done

    def copy_blocks(self, blocks_to_copy: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: copy every layer's K and V of block ``src`` into block ``dst``."""
        src = torch.tensor([s for s, _ in blocks_to_copy])
        dst = torch.tensor([d for _, d in blocks_to_copy])
        # index_copy_, not ``cache[dst] = cache[src]``: that index_put_ path costs ~40 ms per
        # call on a 200 MiB layer cache (measured), index_copy_ ~10 us.
        for key_cache, value_cache in self.kv_caches:
            key_cache.index_copy_(0, dst, key_cache.index_select(0, src))
            value_cache.index_copy_(0, dst, value_cache.index_select(0, src))

    def execute_step(self, step: StepInputs) -> torch.Tensor:
        """Copy-on-write, then the forward of ``step``: ``[num_tokens, hidden_size]`` hidden
        states (what every tensor-parallel rank runs; rank 0 then samples). With a
        ``lora_mapping`` its adapters are made active and their rows get their LoRA terms."""
        if step.blocks_to_copy:
            self.copy_blocks(step.blocks_to_copy)
        if step.lora_mapping is None:
            return self.model(step.input_ids, step.positions, self.kv_caches, step.metadata)
        with self.lora_manager.activate(step.lora_mapping):
            return self.model(step.input_ids, step.positions, self.kv_caches, step.metadata)

    def _forward(self, batch: ScheduledBatch) -> "_ForwardResult":
        # Decode rows first: they share one batched decode-attention call (and, in a step
        # without prefill chunks, the fused C++ layers). A request verifying drafts is decode
        # rows too, one per token, row j seeing the context up to its own position: the KV of
        # every row is written before any row attends, so each row is computed exactly as
        # one-token decoding would compute it (greedy output stays the same token for token).
        decodes, prefills = [], []
        for r in batch.requests:
            (decodes if _is_decode_row(r) else prefills).append(r)
        decoding = {id(r) for r in decodes}
        lora_mapping = None
        if any(r.lora_request is not None for r in batch.requests):
            # Rows of one adapter side by side (the sort is stable): most groups are one range,
            # which the LoRA layers take as a view instead of a gather and scatter.
            decodes.sort(key=lambda r: r.lora_int_id)
            prefills.sort(key=lambda r: r.lora_int_id)
            lora_mapping = LoRAMapping(lora_ids_in_use=batch.lora_ids_in_use)
        ordered = decodes + prefills

        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        samples: list[SamplingInput] = []
        prompt_logprob_rows: list[tuple[ScheduledRequest, int]] = []
        prefill_seqs: list[PrefillSequence] = []
        spec_rows: list[tuple[ScheduledRequest, int]] = []
        decode_rows: list[tuple[ScheduledRequest, int]] = []  # (request, context length) per decode row
        block_size = self.block_size
        for request in ordered:
            num_new = request.num_new_tokens
            start = request.num_computed_tokens
            end = start + num_new
            table = request.block_table
            row = len(input_ids)
            if lora_mapping is not None and request.lora_request is not None:
                lora_mapping.add_rows(request.lora_request, row, row + num_new)
            positions.extend(range(start, end))
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
            input_ids.extend(request.token_ids)
            if request.spec_token_ids:
                spec_rows.append((request, row))
                decode_rows.extend((request, p + 1) for p in range(start, end))
                continue
            if id(request) in decoding:
                decode_rows.append((request, end))
            else:
                prefill_seqs.append(PrefillSequence(row, row + num_new, end,
                                                    torch.tensor(table[:-(-end // block_size)]),
                                                    request.num_prompt_tokens))
            for sample_input in request.samples:
                sample_rows.append(row + num_new - 1)
                samples.append(sample_input)
            if request.prompt_logprobs is not None:
                prompt_logprob_rows.append((request, row + request.prompt_logprobs[0]))

        metadata = AttentionMetadata(slot_mapping=torch.tensor(slots), prefills=prefill_seqs,
                                     num_decode_tokens=len(decode_rows))
        if decode_rows:
            context_lens = [context_len for _, context_len in decode_rows]
            max_blocks = -(-max(context_lens) // block_size)
            tables = [request.block_table[:max_blocks] for request, _ in decode_rows]
            metadata.decode_block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])
            metadata.decode_context_lens = torch.tensor(context_lens)

        step = StepInputs(torch.tensor(input_ids), torch.tensor(positions), metadata, batch.blocks_to_copy,
                          lora_mapping)
        if self.broadcast_steps:
            broadcast_step(step)
        hidden = self.execute_step(step)
        return _ForwardResult(hidden, sample_rows, samples, prompt_logprob_rows, spec_rows)

    def _prompt_logprobs(self, hidden: torch.Tensor, next_token_ids: list[int],
                         num_top: int) -> list[TokenLogprobs]:
        """Raw logprobs of prompt tokens given what precedes them.

        Args:
            hidden: ``[rows, hidden_size]`` final hidden states of positions ``i``.
            next_token_ids: the prompt tokens at positions ``i + 1`` (``rows`` of them).
            num_top: alternatives per position.
        """
        records = []
        for begin in range(0, len(next_token_ids), _PROMPT_LOGPROBS_CHUNK):
            stop = begin + _PROMPT_LOGPROBS_CHUNK
            logprobs = compute_logprobs(self.model.compute_logits(hidden[begin:stop]))
            targets = torch.tensor(next_token_ids[begin:stop])
            values, ranks, top_ids, top_values = gather_logprobs(logprobs, targets, num_top)
            for token, value, rank, ids, tops in zip(targets.tolist(), values.tolist(), ranks.tolist(),
                                                     top_ids.tolist(), top_values.tolist()):
                records.append(TokenLogprobs([token] + ids, [value] + tops, [rank] + list(range(1, num_top + 1))))
        return records


def _is_decode_row(request: ScheduledRequest) -> bool:
    """Whether ``request``'s rows this step run as decode rows (the batched decode attention,
    the fused decode layers): drafts being verified, or one new token that is not a prompt
    token. A prompt token computed alone (a 1-token chunk, a prefix-cache hit that leaves the
    last prompt token) is a 1-row prefill: on AVX512_BF16 CPUs bf16 prompt rows run the bf16
    prefill kernel, and its row must not depend on how the prompt was cut (a chat prompt of
    33 tokens in chunks of 16 gave its first token a logprob 0.011 away from the whole prompt's
    when its last token went through the decode kernel)."""
    if request.spec_token_ids:
        return True
    if request.num_new_tokens != 1:
        return False
    return request.num_prompt_tokens is None or request.num_computed_tokens >= request.num_prompt_tokens


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor in anonymous memory that the OS maps on first touch, in 2 MiB pages.

    ``torch.zeros`` writes every byte up front: for a multi-GiB KV pool that is tens of seconds
    of page faults at start and the whole budget resident at once. Zeros (not ``empty``) matter:
    padded slots of a block are read by the attention and must hold finite values.
    ``MADV_HUGEPAGE`` (where the kernel has it; transparent huge pages are often in "madvise"
    mode) makes each first touch map 2 MiB instead of 4 KiB: 512x fewer page faults while the
    pool fills, and the attention's block-table walks over scattered blocks miss the TLB far
    less (bench/README.md, "Huge pages for the KV pool").
    """
    numel = 1
    for dim in shape:
        numel *= dim
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return huge_page_zeros(nbytes).view(dtype).view(shape)


KV_WARM_SLICE = 2 << 20  # bytes per madvise of ModelRunner.warm_kv_cache: one huge page
