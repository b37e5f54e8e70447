"""Drafts from a smaller model (vLLM v1 ``spec_decode/draft_model.py``; Leviathan et al. 2023 and
Chen et al. 2023 with a small model of the target's vocabulary as the approximation model;
llama.cpp's ``--model-draft``).

The draft model guesses the next ``k`` tokens of each candidate request greedily (argmax). It
has its own paged KV cache: a pool of as many blocks as the target's (``worker/
kv_cache_sizing.py: determine_num_blocks`` splits the budget between the two), its own
``KVCacheManager`` and in it a block table per request, grown as the request grows and freed
when it finishes, is aborted or is preempted. Between two target steps, every candidate
batched together:

- **catch-up**: one forward over the tokens the draft has not computed yet (the prompt the
  first time, then the drafts the target accepted and the token it sampled after them; chunks
  of at most ``max_num_batched_tokens`` tokens); the last row's argmax is the first draft;
- **drafting**: ``k - 1`` one-token forwards, each over the previous draft.

The draft then has K/V for the request's tokens and all drafts but the last. The next call
rolls its ``num_computed_tokens`` back to the longest prefix that the request's tokens still
match (the accepted drafts); the rejected drafts' K/V is overwritten as the sequence grows.

The drafts are argmax tokens, so they are deterministic, as prompt lookup's are: the rejection
sampler (``worker/rejection_sampler.py``) takes them as proposals of probability 1 (accepts
draft ``d`` with probability ``p(d)``, draws from ``p`` without ``d`` on a rejection), which
keeps every emitted token distributed as the target's ``p``. Not implemented from vLLM's:
sampled drafts (the draft's own probabilities in the acceptance ratio), a draft with tensor
parallelism, and running the draft in the same forward as the target's verification.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from pagedllm.config import EngineArgs, SpeculativeConfig, kv_row_width
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestId, RequestStatus
from pagedllm.huge_pages import huge_page_zeros
from pagedllm.layers.attention import AttentionMetadata, PrefillSequence
from pagedllm.sampling_params import SamplingParams
from pagedllm.utils import cdiv

if TYPE_CHECKING:
    from pagedllm.models.llama import LlamaConfig, LlamaForCausalLM

logger = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0.0)


class _DraftSequence:
    """A request as the draft sees it.

    ``shadow`` is the request in the draft's ``KVCacheManager``: its ``prompt_token_ids`` are
    the request's tokens at the latest ``propose_batch``, its ``output_token_ids`` the drafts
    made then, and its ``num_computed_tokens`` how many of those have K/V in the draft's cache.
    ``num_preemptions`` is the request's when the draft started it: a preemption since frees
    the draft's blocks too.
    """

    __slots__ = ("request", "shadow", "num_preemptions")

    def __init__(self, request: Request, shadow: Request) -> None:
        self.request = request
        self.shadow = shadow
        self.num_preemptions = request.num_preemptions


class DraftModelProposer:
    """``method="draft_model"``: greedy drafts of a smaller model over its own paged KV cache.

    Args:
        config: the checked speculative config (``num_speculative_tokens``).
        model: the draft model, built in the target's dtype (``LLMEngine`` loads it).
        target_config: the target model's config (its vocabulary and context length).
        num_blocks: blocks of the draft's pool: the target's number, so a request that fits
            the target's pool fits the draft's.
        engine_args: the engine's ``block_size``, ``max_num_batched_tokens`` (the most tokens of
            one draft forward) and ``enable_prefix_caching`` (the draft's pool caches full
            blocks as the target's does: the samples of ``n > 1`` share their prompt's).
        kv_cache_dtype: the draft cache's dtype.
        max_model_len: the engine's; the draft's context length must hold it.

    Raises:
        ValueError: a draft vocabulary of another size than the target's (both named), or a
            draft context length below ``max_model_len``.
    """

    def __init__(self, config: SpeculativeConfig, model: "LlamaForCausalLM", target_config: "LlamaConfig",
                 num_blocks: int, engine_args: EngineArgs, kv_cache_dtype: torch.dtype, max_model_len: int) -> None:
        draft_config = model.config
        if draft_config.vocab_size != target_config.vocab_size:
            raise ValueError(f"speculative_config: the draft model {config.model!r} has a vocabulary of "
                             f"{draft_config.vocab_size} tokens, the target model {target_config.vocab_size}: "
                             "a draft model must share the target's tokenizer")
        if draft_config.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative_config: the draft model {config.model!r} has a context of "
                             f"{draft_config.max_position_embeddings} tokens, fewer than max_model_len="
                             f"{max_model_len}: lower max_model_len")
        self.model = model
        self.num_speculative_tokens = config.num_speculative_tokens
        self.block_size = engine_args.block_size
        self.max_num_batched_tokens = engine_args.max_num_batched_tokens
        self.kv_cache_manager = KVCacheManager(num_blocks, self.block_size,
                                               enable_caching=bool(engine_args.enable_prefix_caching))
        shape = (num_blocks, self.block_size, model.num_kv_heads_per_rank,
                 kv_row_width(draft_config.head_dim, kv_cache_dtype))
        numel = shape[0] * shape[1] * shape[2] * shape[3]
        element_size = torch.empty((), dtype=kv_cache_dtype).element_size()
        # Zeros mapped on first touch, as the target's pool (padded slots are read: finite values).
        self.kv_caches = [tuple(huge_page_zeros(numel * element_size).view(kv_cache_dtype).view(shape)
                                for _ in range(2)) for _ in range(draft_config.num_hidden_layers)]
        self._sequences: dict[RequestId, _DraftSequence] = {}
        logger.info("draft model %s: %d layers; its KV cache: %d blocks, %.1f MiB", config.model,
                    draft_config.num_hidden_layers, num_blocks,
                    2 * len(self.kv_caches) * numel * element_size / 2**20)

    @torch.inference_mode()
    def propose_batch(self, candidates: Sequence[tuple[Request, int]]) -> list[list[int]]:
        """Drafts for each ``(request, max_num_tokens)`` (at most ``max_num_tokens`` each, in
        order), from batched forwards of the draft model. First frees the draft's blocks of the
        requests that stopped running or were preempted since the last call.

        A request gets no drafts when the draft's pool has no room for it (drafts never take
        blocks from anyone). A failed draft forward is logged and gives no drafts this step
        (the requests decode one token; their draft state starts over).
        """
        self._free_stale()
        drafts: list[list[int]] = [[] for _ in candidates]
        sequences = []
        for index, (request, max_num_tokens) in enumerate(candidates):
            sequence = self._prepare(request, max_num_tokens)
            if sequence is not None:
                sequences.append((index, sequence, max_num_tokens))
        if not sequences:
            return drafts
        try:
            self._catch_up([sequence for _, sequence, _ in sequences])
            for step in range(1, max(max_num_tokens for _, _, max_num_tokens in sequences)):
                self._draft_one([sequence for _, sequence, max_num_tokens in sequences if max_num_tokens > step])
        except Exception:
            logger.exception("the draft model's forward failed: no drafts for %d requests this step", len(sequences))
            for _, sequence, _ in sequences:
                self._free(sequence)
            return drafts
        for index, sequence, _ in sequences:
            drafts[index] = list(sequence.shadow.output_token_ids)
        return drafts

    def remove(self, request_id: RequestId) -> None:
        """Free a finished request's draft blocks (nothing if it had none)."""
        sequence = self._sequences.get(request_id)
        if sequence is not None:
            self._free(sequence)

    # ----------------------------------------------------------------------------- bookkeeping
    def _free(self, sequence: _DraftSequence) -> None:
        self.kv_cache_manager.free(sequence.shadow)
        del self._sequences[sequence.shadow.request_id]

    def _free_stale(self) -> None:
        """Free the draft state of requests no longer running (finished or waiting again) or
        preempted since the draft started them: a preempted request is recomputed, and its
        draft with it, so that both pools give way together."""
        for sequence in list(self._sequences.values()):
            request = sequence.request
            if request.status != RequestStatus.RUNNING or request.num_preemptions != sequence.num_preemptions:
                self._free(sequence)

    def _prepare(self, request: Request, max_num_tokens: int) -> Optional[_DraftSequence]:
        """Roll the request's draft state back to what the request's tokens still match, and
        make room for its catch-up and its ``max_num_tokens - 1`` drafted positions. None
        (state kept, nothing allocated) when the draft's pool has no room."""
        token_ids = request.all_token_ids
        num_new_drafts = max_num_tokens - 1  # the last draft is never written
        manager = self.kv_cache_manager
        sequence = self._sequences.get(request.request_id)
        if sequence is None:
            shadow = Request(request.request_id, token_ids, _GREEDY, 1, None, cache_salt=request.cache_salt)
            blocks, num_cached = manager.get_computed_blocks(shadow)
            if not manager.allocate_slots(shadow, len(token_ids) - num_cached + num_new_drafts, num_cached, blocks):
                return None
            shadow.num_computed_tokens = num_cached
            sequence = self._sequences[request.request_id] = _DraftSequence(request, shadow)
            return sequence
        shadow = sequence.shadow
        num_valid = min(shadow.num_computed_tokens, shadow.num_prompt_tokens)
        for draft_token_id, token_id in zip(shadow.output_token_ids[:shadow.num_computed_tokens - num_valid],
                                            token_ids[num_valid:]):
            if draft_token_id != token_id:
                break
            num_valid += 1
        shadow.prompt_token_ids, shadow.output_token_ids = token_ids, []
        # The last token's logits give the first draft: compute it again if a step passed
        # this request over (no new token since the last call).
        shadow.num_computed_tokens = min(num_valid, len(token_ids) - 1)
        # Offered to the prefix cache: full blocks of the request's own tokens that no forward
        # writes again (never a draft, never the last token's block that may be computed again).
        manager.cache_blocks(shadow)
        if not manager.allocate_slots(shadow, len(token_ids) - shadow.num_computed_tokens + num_new_drafts):
            return None
        return sequence

    # ----------------------------------------------------------------------------- forwards
    def _catch_up(self, sequences: list[_DraftSequence]) -> None:
        """Compute every sequence's uncomputed tokens, at most ``max_num_batched_tokens`` per
        forward, and append each one's first draft (the argmax after its last token)."""
        pending = list(sequences)
        while pending:
            batch, num_batched = [], 0
            for sequence in pending:
                shadow = sequence.shadow
                num_new = min(shadow.num_tokens - shadow.num_computed_tokens, self.max_num_batched_tokens - num_batched)
                if num_new == 0:
                    break
                batch.append((sequence, num_new))
                num_batched += num_new
            hidden = self._forward(batch)
            done = [row for row, (sequence, _) in enumerate(batch)
                    if sequence.shadow.num_computed_tokens == sequence.shadow.num_tokens]
            for row, token_id in zip(done, self._argmax(hidden[done])):
                batch[row][0].shadow.output_token_ids.append(token_id)
            pending = [sequence for sequence in pending
                       if sequence.shadow.num_computed_tokens < sequence.shadow.num_prompt_tokens]

    def _draft_one(self, sequences: list[_DraftSequence]) -> None:
        """One decode step over each sequence's latest draft: append the next draft."""
        hidden = self._forward([(sequence, 1) for sequence in sequences])
        for sequence, token_id in zip(sequences, self._argmax(hidden)):
            sequence.shadow.output_token_ids.append(token_id)

    def _argmax(self, hidden: torch.Tensor) -> list[int]:
        return self.model.compute_logits(hidden).argmax(dim=-1).tolist()

    def _forward(self, batch: list[tuple[_DraftSequence, int]]) -> torch.Tensor:
        """Compute ``num_new`` tokens of each ``(sequence, num_new)`` from its
        ``num_computed_tokens`` (advanced here); returns ``[len(batch), hidden_size]``: each
        one's last row.

        Catch-ups of at most ``1 + num_speculative_tokens`` tokens run as decode rows (row
        ``j`` with context length ``num_computed_tokens + j + 1``), as the target's
        verification computes the same tokens, so that a draft that is the target model
        computes what the target computes; longer ones (prompts) as prefill chunks. A step of
        decode rows only takes the fused C++ decoder layers.
        """
        block_size = self.block_size
        max_decode_rows = 1 + self.num_speculative_tokens
        order = sorted(range(len(batch)), key=lambda item: batch[item][1] > max_decode_rows)  # decode rows first
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_rows = [0] * len(batch)
        decode_tables: list[list[int]] = []
        decode_context_lens: list[int] = []
        prefills: list[PrefillSequence] = []
        for item in order:
            sequence, num_new = batch[item]
            shadow = sequence.shadow
            start, end = shadow.num_computed_tokens, shadow.num_computed_tokens + num_new
            table = self.kv_cache_manager.get_block_ids(shadow.request_id)
            row = len(input_ids)
            input_ids.extend(shadow.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
            if num_new <= max_decode_rows:
                decode_tables.extend([table] * num_new)
                decode_context_lens.extend(range(start + 1, end + 1))
            else:
                prefills.append(PrefillSequence(row, row + num_new, end, torch.tensor(table[:cdiv(end, block_size)])))
            last_rows[item] = row + num_new - 1
            shadow.num_computed_tokens = end
        metadata = AttentionMetadata(slot_mapping=torch.tensor(slots), prefills=prefills,
                                     num_decode_tokens=len(decode_context_lens))
        if decode_context_lens:
            max_blocks = cdiv(max(decode_context_lens), block_size)
            tables = [table[:max_blocks] for table in decode_tables]
            metadata.decode_block_tables = torch.tensor([table + [0] * (max_blocks - len(table)) for table in tables])
            metadata.decode_context_lens = torch.tensor(decode_context_lens)
        # Only blocks before num_computed_tokens are ever cached (_prepare), and only cached
        # blocks are shared, so a forward never writes into a shared block.
        assert not self.kv_cache_manager.take_pending_copies()
        hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), self.kv_caches, metadata)
        return hidden[last_rows]
