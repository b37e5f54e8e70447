"""``LLMEngine``: admission, the step loop and outputs (vLLM ``LLMEngine``).

One ``step()``: the scheduler picks the batch, the model runner computes it and samples, the
scheduler advances every request and frees the blocks of finished ones, and the engine turns
the changed requests into ``RequestOutput``s.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Union

import torch

from pagedllm.config import EngineArgs
from pagedllm.core.kv_cache_manager import KVCacheManager, KVCacheStats
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduled_batch import SamplingInput, ScheduledBatch, ScheduledRequest
from pagedllm.core.scheduler import Scheduler, SchedulerOutput
from pagedllm.lora.request import LoRARequest
from pagedllm.executor import make_executor
from pagedllm.engine.input_processor import InputProcessor, ProcessedRequest, PromptType
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.kv_snapshot import KVCacheSnapshot, make_kv_snapshot
from pagedllm.engine.stats import IterationStats, ModelInfo, SchedulerStats
from pagedllm.outputs import RequestOutput, TokenLogprobs
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode import Proposer, make_proposer
from pagedllm.structured_output import GrammarCompiler, allocate_bitmask, fill_bitmasks

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "ParentRequest", "PromptType"]


@dataclass
class ParentRequest:
    """A user request: one prompt and its ``n`` samples (one ``Request`` each)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    children: list[Request] = field(default_factory=list)


class LLMEngine:
    """The synchronous engine.

    Args:
        engine_args: the options.
        model: an already built model (tests build tiny random ones); None loads
            ``engine_args.model``. Only with ``tensor_parallel_size=1``.
        tokenizer: the tokenizer to use with ``model`` or ``checkpoint``; may be None when only
            token ids are given (then ``text`` is empty).
        checkpoint: ``(config, state_dict)`` with Hugging Face weight names to build the model
            from (every tensor-parallel rank takes its shard of it) instead of loading
            ``engine_args.model``.

    With ``tensor_parallel_size > 1`` the constructor starts the other ranks
    (``worker/tp_worker.py``) and pins this process to rank 0's CPUs; ``shutdown()`` ends them.

    Raises:
        ValueError: a configuration that cannot run (for instance a KV cache smaller than one
            ``max_model_len`` request, or heads that do not split over the ranks).
        TensorParallelError: a tensor-parallel rank failed to start (from ``step()``: one died;
            the engine then computes nothing more).
    """

    def __init__(self, engine_args: EngineArgs, model: Any = None, tokenizer: Any = None,
                 checkpoint: Optional[tuple[Any, dict]] = None) -> None:
        engine_args.verify()
        self.args = engine_args
        self._built_on_thread = threading.get_ident()  # step() warns once if stepped elsewhere
        torch.manual_seed(engine_args.seed)
        self.executor = make_executor(engine_args, model, tokenizer, checkpoint)
        try:
            self._init_after_model(engine_args)
        except BaseException:
            self.shutdown()
            raise

    def _init_after_model(self, engine_args: EngineArgs) -> None:
        executor = self.executor
        self.tokenizer = executor.tokenizer
        self.model_config = executor.model_config
        self.eos_token_id = self.model_config.eos_token_id
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_id = self.tokenizer.eos_token_id

        block_size = engine_args.block_size
        self.kv_cache_dtype = executor.driver_worker.kv_cache_dtype
        num_blocks = executor.determine_num_blocks()
        capacity = num_blocks * block_size
        model_len = self.model_config.max_position_embeddings
        if engine_args.max_model_len is None:
            self.max_model_len = min(model_len, capacity)
            if capacity < model_len:
                logger.warning("max_model_len capped at %d tokens (the KV cache capacity; the model "
                               "allows %d)", capacity, model_len)
        else:
            self.max_model_len = engine_args.max_model_len
            if self.max_model_len > model_len:
                raise ValueError(f"max_model_len={self.max_model_len} is larger than the model's "
                                 f"context length {model_len}")
            if self.max_model_len > capacity:
                raise ValueError(
                    f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {block_size}), fewer "
                    f"than one request of max_model_len={self.max_model_len}: lower max_model_len or "
                    "raise kv_cache_memory_bytes / memory_utilization")
        self.num_blocks = num_blocks
        speculative = engine_args.speculative
        self.kv_cache_manager = KVCacheManager(num_blocks, block_size,
                                               enable_caching=engine_args.enable_prefix_caching)
        executor.initialize_cache(num_blocks, self.max_model_len)
        # A draft model is the worker's (it computes); prompt lookup and the suffix trie only read tokens.
        self.proposer: Optional[Proposer] = (None if speculative is None else executor.drafter
                                             or make_proposer(speculative))
        self.scheduler = Scheduler(self.kv_cache_manager, engine_args.max_num_seqs,
                                   engine_args.max_num_batched_tokens, self.max_model_len,
                                   engine_args.scheduling_policy, engine_args.priority_aging_interval,
                                   max_loras=engine_args.max_loras if engine_args.enable_lora else None,
                                   num_speculative_tokens=speculative.num_speculative_tokens if speculative else 0,
                                   disable_spec_by_batch_size=speculative.disable_by_batch_size if speculative else None)
        # All ranks together: each holds its KV heads' share of every block.
        self.bytes_per_block = executor.bytes_per_block()
        logger.info("KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB of %s (%d tensor-parallel ranks); "
                    "%d requests of max_model_len=%d fit at once", num_blocks, block_size, capacity,
                    num_blocks * self.bytes_per_block / 2**20, str(self.kv_cache_dtype).replace("torch.", ""),
                    engine_args.tensor_parallel_size, capacity // self.max_model_len, self.max_model_len)
        self.weight_bytes, unquantized = executor.driver_worker.weight_bytes()
        if unquantized != self.weight_bytes:
            logger.info("weights: %.1f MiB (%s; %.1f MiB unquantized): the %.1f MiB saved are room for %d KV "
                        "blocks (%s)", self.weight_bytes / 2**20, executor.driver_worker.quantization, unquantized / 2**20,
                        (unquantized - self.weight_bytes) / 2**20,
                        (unquantized - self.weight_bytes) // self.bytes_per_block,
                        "in the pool above" if engine_args.kv_cache_memory_bytes is None and
                        engine_args.num_gpu_blocks_override is None else "not used: the pool's size is set")
        else:
            logger.info("weights: %.1f MiB (not quantized)%s", self.weight_bytes / 2**20,
                        " in rank 0's shard" if engine_args.tensor_parallel_size > 1 else "")
        self.grammar_compiler = (GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
                                 if self.tokenizer is not None else None)
        self.input_processor = InputProcessor(self.get_model_info())
        self.parents: dict[str, ParentRequest] = {}
        self.output_processor = OutputProcessor(self.tokenizer)
        self._child_to_parent: dict[str, str] = {}
        self._pending_outputs: list[RequestOutput] = []
        # Sequences (by request id) scheduled at least once, so that a queue time is counted
        # once per sequence, not again after a preemption.
        self._scheduled_once: set = set()
        self._iteration = IterationStats()
        self._kv_snapshot_version = 0
        self._finished_since_step: set = set()  # sequences whose random streams the runner can drop
        self._forked_streams: list[tuple] = []  # (parent, child) of fork_request since the last step

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLMEngine":
        return cls(engine_args)

    @property
    def model(self) -> Any:
        """Rank 0's model (for inspection; the engine itself never touches it)."""
        return self.executor.driver_worker.model

    @property
    def model_runner(self) -> Any:
        """Rank 0's ``ModelRunner`` (for inspection: its KV cache tensors)."""
        return self.executor.driver_worker.model_runner

    def check_health(self) -> None:
        """Raises ``TensorParallelError`` when a tensor-parallel rank is gone (vLLM's
        ``check_health``); a no-op for a single-process engine."""
        self.executor.check_health()

    def on_worker_failure(self, callback) -> None:
        """Have ``callback()`` called from a watchdog thread as soon as a tensor-parallel worker
        exits unexpectedly, so that an idle owner learns of it before its next ``step()``. The
        callback runs outside the engine's thread: it must only hand the news over (for
        instance queue a call of ``check_health``). A no-op without workers."""
        self.executor.on_failure(callback)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (a no-op without them). Idempotent; the engine
        computes no step after it."""
        if hasattr(self, "executor"):
            self.executor.shutdown()

    # ----------------------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: PromptType, params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None, cache_salt: Optional[str] = None,
                    priority: int = 0, lora_request: Optional[LoRARequest] = None) -> None:
        """Queue a request.

        The ``n`` samples of a request are prefilled once: the first one is scheduled, the
        others fork off its prompt blocks when its prompt is computed (copy-on-write).

        Args:
            request_id: unique among unfinished requests.
            prompt: text, ``{"prompt_token_ids": [...]}`` (or ``{"prompt": text}``), or a list
                of token ids. A dict may carry ``"cache_salt"`` (as in vLLM).
            params: sampling parameters (default ``SamplingParams()``).
            cache_salt: prefix-cache isolation key: requests with different salts (or one
                with and one without) never share KV blocks.
            priority: under ``scheduling_policy="priority"``, lower runs first (vLLM's
                ``priority``); must be 0 under ``fcfs`` (as vLLM).
            lora_request: the LoRA adapter to run with (``enable_lora``); read from its
                ``lora_path`` now unless loaded (``add_lora``).

        Raises:
            ValueError: empty prompt, token ids out of the vocabulary, a prompt that cannot fit
                ``max_model_len`` (or ``prompt + max_tokens`` beyond it), ``n`` above
                ``max_num_seqs`` or needing more blocks than the pool, a non-string
                ``cache_salt``, a duplicate ``request_id``, a non-integer ``priority`` or a
                non-zero one under ``fcfs``; a ``lora_request`` without ``enable_lora``, or an
                adapter that ``add_lora`` refuses. Nothing is queued then.
        """
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.scheduler.policy != "priority":
            raise ValueError(f"priority={priority} needs scheduling_policy='priority' (this engine "
                             f"schedules {self.scheduler.policy!r})")
        processed = self.input_processor.process(request_id, prompt, params, arrival_time, cache_salt,
                                                 in_flight=self.parents, lora_request=lora_request)
        if lora_request is not None:
            self.add_lora(lora_request)
        self._queue(processed, priority)

    def _queue(self, processed: ProcessedRequest, priority: int = 0) -> None:
        """Make the ``Request`` of each sample of an admitted request and schedule the first."""
        request_id, params, max_tokens = processed.request_id, processed.sampling_params, processed.max_tokens
        prompt_token_ids, arrival_time, cache_salt = (processed.prompt_token_ids, processed.arrival_time,
                                                      processed.cache_salt)
        parent = ParentRequest(request_id, processed.prompt, prompt_token_ids)
        for index in range(params.n):
            # A sample's id is a tuple, so no user id (a string) can ever equal it.
            child_id = request_id if params.n == 1 else (request_id, index)
            parent.children.append(Request(child_id, prompt_token_ids, params, max_tokens,
                                           self.eos_token_id, arrival_time, seed_offset=index,
                                           cache_salt=cache_salt, priority=priority,
                                           lora_request=processed.lora_request))
            if processed.grammar is not None:  # one state per sample
                parent.children[-1].grammar = processed.grammar.new_state()
        self.parents[request_id] = parent
        for child in parent.children:
            self._child_to_parent[child.request_id] = request_id
        if max_tokens == 0:
            # Nothing to generate: only prompt logprobs (echo) need the prompt computed.
            for child in parent.children[1:] if params.prompt_logprobs is not None else parent.children:
                child.status = RequestStatus.FINISHED_LENGTH
        if not parent.children[0].is_finished():
            first = parent.children[0]
            if max_tokens > 0:
                first.pending_forks = parent.children[1:]
            self.scheduler.add_request(first)
        else:
            self._emit(parent)

    def fork_request(self, parent_id: str, child_id: str, token_id: int) -> None:
        """Start request ``child_id`` as a copy of the running request ``parent_id`` whose
        last sampled token is replaced by ``token_id`` (the primitive under beam search).

        The child shares the parent's KV blocks (ref count + 1; copy-on-write when either
        writes into a shared one), takes its sampling parameters and limits, and is scheduled
        with the running requests from the next ``step()``, like a sample of ``n > 1``. Its
        outputs report ``token_id`` and what follows; the tokens before are the parent's. It
        ends like any request (EOS, stop, length), possibly on ``token_id`` itself: then its
        final output comes out of the next ``step()``.

        ``token_id`` must be the parent's last sampled token or one of the alternatives its
        ``logprobs`` recorded with it: the child's logprob records and ``cumulative_logprob``
        take the token's value from there.

        Raises:
            ValueError: an unknown or finished parent, one of ``n > 1`` samples, one whose last
                sampled token is already computed (or that has none), one without ``logprobs``,
                a token it did not record, or a non-string or in-flight ``child_id``. With
                ``structured_outputs``, a token the constraint forbids ends the child with
                finish reason ``"error"``.
        """
        if not isinstance(child_id, str):
            raise ValueError(f"request_id must be a string, got {type(child_id).__name__} {child_id!r}")
        if child_id in self.parents:
            raise ValueError(f"request_id {child_id!r} is already in flight")
        entry = self.parents.get(parent_id)
        if entry is None or len(entry.children) != 1:
            raise ValueError(f"fork_request needs an unfinished request of one sequence (n=1), got {parent_id!r}")
        parent = entry.children[0]
        if (parent.status != RequestStatus.RUNNING or not parent.output_token_ids
                or parent.num_computed_tokens != parent.num_tokens - 1):
            raise ValueError(f"request {parent_id!r} has no sampled token to replace: fork it right after "
                             "the step that sampled one")
        if parent.sampling_params.logprobs is None:
            raise ValueError(f"request {parent_id!r} has no logprobs: fork_request takes the token's logprob "
                             "from the parent's last record")
        last = parent.logprobs[-1]
        if token_id not in last.token_ids:
            raise ValueError(f"token {token_id!r} is neither the token request {parent_id!r} sampled last nor "
                             f"one of its top-{parent.sampling_params.logprobs} alternatives")
        index = last.token_ids.index(token_id)
        record = TokenLogprobs([token_id] + last.token_ids[1:], [last.logprobs[index]] + last.logprobs[1:],
                               [last.ranks[index]] + last.ranks[1:])
        child = Request(child_id, parent.prompt_token_ids, parent.sampling_params, parent.max_tokens,
                        parent.eos_token_id, parent.arrival_time, cache_salt=parent.cache_salt,
                        priority=parent.priority, lora_request=parent.lora_request)
        child.output_token_ids = parent.output_token_ids[:-1]
        child.logprobs = parent.logprobs[:-1] + [record]
        for kept in child.logprobs:  # summed in the order step() sums them
            child.cumulative_logprob += kept.logprobs[0]
        child.prompt_logprobs = list(parent.prompt_logprobs)
        self._forked_streams.append((parent.request_id, child_id))
        if parent.grammar is not None:
            # The parent's state has accepted the token the child replaces.
            child.grammar = parent.grammar.fork(num_rollback=1)
        self.parents[child_id] = ParentRequest(child_id, entry.prompt, entry.prompt_token_ids, [child])
        self._child_to_parent[child_id] = child_id
        self._scheduled_once.add(child_id)  # it never waited
        self.output_processor.fork(child)
        self.scheduler.fork_request(parent, child, token_id)
        self._process_tokens(child, [token_id])
        if child.is_finished():
            self._emit(self.parents[child_id])

    def abort_request(self, request_id: Union[str, list[str]]) -> None:
        """End requests now, waiting or running: every block is freed at once. The final
        ``RequestOutput`` (finish_reason ``"abort"``) comes out of the next ``step()``.
        Unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            parent = self.parents.get(rid)
            if parent is None:
                continue
            self.scheduler.finish_requests([c.request_id for c in parent.children],
                                           RequestStatus.FINISHED_ABORTED)
            for child in parent.children:
                if not child.is_finished():
                    child.status = RequestStatus.FINISHED_ABORTED
            self._emit(parent)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter ahead of its requests (vLLM ``add_lora``); it may later be
        dropped by the LRUs and is then read again from ``lora_path`` when a request needs it.
        Returns whether it was read now (False: already loaded).

        Raises:
            ValueError: LoRA is off, or the adapter is refused (``LoRAModel.from_local_checkpoint``:
                a missing file, DoRA, ``modules_to_save``, a rank above ``max_lora_rank``, a
                shape the base model does not have, ...).
        """
        if not self.args.enable_lora:
            raise ValueError("LoRA adapters need enable_lora=True (--enable-lora)")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        return self.executor.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget a loaded adapter (vLLM ``remove_lora``); requests still running with it read
        it again. Returns whether it was loaded."""
        return self.args.enable_lora and self.executor.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        """Ids of the adapters held in memory (vLLM ``list_loras``)."""
        return self.executor.list_loras() if self.args.enable_lora else set()

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache. Never refuses: blocks of running requests keep their KV
        and owners but are no longer offered to new requests. Returns True."""
        self.kv_cache_manager.reset_prefix_cache()
        return True

    def get_kv_cache_stats(self) -> KVCacheStats:
        """Blocks total / in use / cached-free / free, shared blocks, stored tokens, empty
        slots and prefix-cache queries and hits (tokens); see ``KVCacheStats``."""
        return self.kv_cache_manager.get_stats()

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents) or bool(self._pending_outputs)

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    # ----------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one scheduling + model step.

        An exception from the model forward ends only the requests scheduled in this step
        (every sample of them) with finish reason ``"error"``; the others keep running.

        Returns:
            A ``RequestOutput`` for every request that got a token, finished or was aborted
            since the last step, shaped by its ``output_kind`` (``FINAL_ONLY`` requests appear
            once, when finished; ``DELTA`` ones carry only what is new).
        """
        outputs, self._pending_outputs = self._pending_outputs, []
        step_start = time.monotonic()
        scheduler_output = self.scheduler.schedule()
        self._iteration = self._iteration_stats(scheduler_output, step_start)
        if scheduler_output.preempted:
            self._log_preemptions(scheduler_output.preempted)
        if scheduler_output.is_empty:
            return outputs
        if self._built_on_thread is not None and threading.get_ident() != self._built_on_thread:
            self._built_on_thread = None
            logger.warning("this LLMEngine steps on another thread than the one that built it: torch's "
                           "OpenMP then keeps two thread teams and steps run up to ~2x slower; build it "
                           "on the thread that steps it (AsyncLLMEngine takes a function that builds it)")
        # The samples of an n > 1 request fork (and get their first token) in this step.
        requests = {}
        for request, _ in scheduler_output.scheduled:
            requests[request.request_id] = request
            for fork in request.pending_forks:
                requests[fork.request_id] = fork
        try:
            runner_output = self.executor.execute_model(self._make_batch(scheduler_output))
        except Exception as exc:
            if self.executor.step_failures_are_fatal:
                raise
            # One failed forward must not take the others down.
            logger.exception("the model forward failed: ending the %d sequences of this step", len(requests))
            return outputs + self._fail_requests(requests.values(), exc)
        for request_id, records in runner_output.prompt_logprobs.items():
            requests[request_id].prompt_logprobs.extend(records)
        sampled = runner_output.sampled_token_ids
        num_outputs = {request_id: len(requests[request_id].output_token_ids) for request_id in sampled}
        finished = self.scheduler.update_from_output(scheduler_output, sampled,
                                                     runner_output.num_accepted_tokens)
        for request_id, num_before in num_outputs.items():
            # One token, or with speculative decoding up to the accepted drafts plus one (fewer
            # when one of them ended the request).
            request = requests[request_id]
            if len(request.output_token_ids) == num_before:
                continue
            records = runner_output.draft_logprobs.get(request_id, []) + [runner_output.logprobs[request_id]]
            num_kept = self._process_tokens(request, request.output_token_ids[num_before:])
            for record in records[:num_kept]:
                request.cumulative_logprob += record.logprobs[0]
                if request.sampling_params.logprobs is not None:
                    request.logprobs.append(record)
        if self.proposer is not None:
            candidates = self.scheduler.spec_decode_candidates()
            for (request, _), drafts in zip(candidates, self.proposer.propose_batch(candidates)):
                request.spec_token_ids = drafts
        changed = {self._child_to_parent[request_id] for request_id in sampled}
        changed.update(self._child_to_parent[request.request_id] for request in finished)
        for parent_id in [pid for pid in self.parents if pid in changed]:
            parent = self.parents[parent_id]
            output = self._make_output(parent)
            if output is not None:
                outputs.append(output)
            if all(child.is_finished() for child in parent.children):
                self._forget(parent_id)
        return outputs

    def _make_batch(self, scheduler_output: SchedulerOutput) -> ScheduledBatch:
        """The step as plain data for the model runner (``core/scheduled_batch.py``): each
        scheduled request's tokens, block table and the sequences to sample, the grammar
        masks of the constrained ones, and the sequences that ended since the last step."""
        scheduled = []
        constrained: list[tuple[Request, int, int]] = []  # (sequence, request index, sample index)
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        for request, num_new in scheduler_output.scheduled:
            start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
            drafts = spec_tokens.get(request.request_id, [])
            if drafts:
                token_ids = [request.token_id_at(start)] + drafts
            else:
                token_ids = request.token_ids_between(start, end)
            sampled: list[Request] = []
            if drafts or (end == request.num_tokens and request.max_tokens > 0):
                # A max_tokens=0 request runs only for its prompt logprobs (echo).
                sampled = [request, *request.pending_forks]
            prompt_logprobs = None
            num_top = request.sampling_params.prompt_logprobs
            if num_top is not None and not drafts:
                # Row i predicts token i + 1; skip prompt positions already collected before
                # a preemption made the request compute its prompt again.
                first = max(start + 1, len(request.prompt_logprobs))
                last = min(end, request.num_prompt_tokens - 1)
                if first <= last:
                    prompt_logprobs = (first - 1 - start, request.prompt_token_ids[first:last + 1], num_top)
            for index, sequence in enumerate(sampled):
                if sequence.grammar is not None:
                    constrained.append((sequence, len(scheduled), index))
            scheduled.append(ScheduledRequest(
                request.request_id, token_ids, start, self.kv_cache_manager.get_block_ids(request.request_id),
                tuple(self._sampling_input(sequence) for sequence in sampled), drafts, prompt_logprobs,
                request.lora_request, request.num_prompt_tokens))
        if constrained:
            bitmask = allocate_bitmask(len(constrained), self.model_config.vocab_size)
            fill_bitmasks([sequence.grammar for sequence, _, _ in constrained], bitmask)
            for row, (_, request_index, sample_index) in enumerate(constrained):
                samples = list(scheduled[request_index].samples)
                samples[sample_index] = dataclasses.replace(samples[sample_index], grammar_bitmask=bitmask[row])
                scheduled[request_index] = dataclasses.replace(scheduled[request_index], samples=tuple(samples))
        finished, self._finished_since_step = frozenset(self._finished_since_step), set()
        forked, self._forked_streams = self._forked_streams, []
        return ScheduledBatch(scheduled, scheduler_output.blocks_to_copy, scheduler_output.lora_ids_in_use,
                              finished, forked)

    @staticmethod
    def _sampling_input(sequence: Request) -> SamplingInput:
        params = sequence.sampling_params
        return SamplingInput(sequence.request_id, params,
                             None if params.seed is None else params.seed + sequence.seed_offset,
                             sequence.prompt_token_ids, sequence.output_token_ids, sequence.eos_token_id)

    def _process_tokens(self, request: Request, token_ids: list[int]) -> int:
        """Decode the tokens the request just got (already appended); a stop string in the
        text ends it, and the tokens after the one that completed it are dropped (several
        tokens come at once only from speculative decoding, whose output must equal one
        token at a time).

        Returns:
            How many of ``token_ids`` the request keeps.
        """
        stop, num_kept = self.output_processor.process_tokens(request, token_ids)
        if num_kept < len(token_ids):
            del request.output_token_ids[num_kept - len(token_ids):]
        if stop is not None:
            request.stop_reason = stop
            if request.is_finished():
                # The length limit and the stop string came with the same token.
                request.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
        return num_kept

    def _log_preemptions(self, preempted: list[Request]) -> None:
        """A warning at the first preemption and at every 50th after it (vLLM's cadence,
        ``v1/core/sched/scheduler.py``): preemption by recompute costs throughput silently."""
        total = self.scheduler.num_preemptions
        if total - len(preempted) == 0 or total // 50 > (total - len(preempted)) // 50:
            logger.warning("preempted %s (recompute): not enough free KV cache blocks for the running "
                           "requests; %d preemptions so far. More KV cache (kv_cache_memory_bytes) or a "
                           "smaller max_num_seqs avoids it.", ", ".join(str(r.request_id) for r in preempted), total)

    def _iteration_stats(self, scheduler_output: SchedulerOutput, step_start: float) -> IterationStats:
        """What ``scheduler_output`` schedules; before the step advances ``num_computed_tokens``."""
        num_prompt_tokens = num_output_tokens = 0
        queue_times = []
        for request, num_new_tokens in scheduler_output.scheduled:
            prompt_part = max(0, min(num_new_tokens, request.num_prompt_tokens - request.num_computed_tokens))
            num_prompt_tokens += prompt_part
            num_output_tokens += num_new_tokens - prompt_part
            if request.request_id not in self._scheduled_once:
                self._scheduled_once.add(request.request_id)
                queue_times.append(max(0.0, step_start - request.arrival_time))
        return IterationStats(step=self._iteration.step + 1,
                              num_scheduled_tokens=num_prompt_tokens + num_output_tokens,
                              num_prompt_tokens=num_prompt_tokens, num_output_tokens=num_output_tokens,
                              num_preempted=len(scheduler_output.preempted), queue_times=tuple(queue_times))

    def make_stats(self) -> SchedulerStats:
        """A snapshot of the queues, the KV cache and the latest step (vLLM ``make_stats``);
        O(1) under fcfs, O(waiting) under priority. Observers (metrics, the async engine's load shedding, other threads) read this,
        never the scheduler or the KV cache manager."""
        manager = self.kv_cache_manager
        return SchedulerStats(num_running_reqs=self.scheduler.num_running,
                              num_waiting_reqs=self.scheduler.num_waiting,
                              num_blocks=manager.num_blocks,
                              num_used_blocks=manager.block_pool.num_used_blocks,
                              num_preemptions=self.scheduler.num_preemptions,
                              prefix_cache_queries=manager.prefix_cache_queries,
                              prefix_cache_hits=manager.prefix_cache_hits,
                              iteration=self._iteration,
                              num_waiting_by_priority=self._waiting_by_priority(),
                              running_lora_adapters=_count_adapters(self.scheduler.running),
                              waiting_lora_adapters=_count_adapters(self.scheduler.waiting),
                              spec_decode_num_drafts=self.scheduler.spec_decode_num_drafts,
                              spec_decode_num_draft_tokens=self.scheduler.spec_decode_num_draft_tokens,
                              spec_decode_num_accepted_tokens=self.scheduler.spec_decode_num_accepted_tokens)

    def _waiting_by_priority(self) -> tuple[tuple[int, int], ...]:
        """O(waiting) under the priority policy, nothing under fcfs (where priority is 0)."""
        if self.scheduler.policy != "priority":
            return ()
        return tuple(sorted(Counter(request.priority for request in self.scheduler.waiting).items()))

    def warm_kv_cache(self, max_bytes: int) -> int:
        """Fault in up to about ``max_bytes`` more of the KV pool ahead of use (``ModelRunner.
        warm_kv_cache``: contents unchanged, block order); for idle time, as ``AsyncLLMEngine``
        does. Under tensor parallelism only rank 0's share is warmed here (with ``warm_kv_cache``
        set, every rank warms its own at start).

        Returns:
            Bytes made resident; 0 once the whole pool is (or the OS cannot).
        """
        return self.executor.warm_kv_cache(max_bytes)

    def make_kv_snapshot(self) -> KVCacheSnapshot:
        """A picture of the block pool: every block's state and owner, every queued
        sequence's block table, counters and the latest forks / copy-on-writes (see
        ``KVCacheSnapshot``). O(num_blocks + block-table entries): take it when someone looks,
        not after every step. Each call gets the next ``version``."""
        self._kv_snapshot_version += 1
        return make_kv_snapshot(self._kv_snapshot_version, self._iteration.step, self.scheduler,
                                self.kv_cache_manager, self.max_model_len)

    def get_model_info(self) -> ModelInfo:
        """The facts about the model and engine that do not change while it runs."""
        return ModelInfo(model=self.args.model, max_model_len=self.max_model_len,
                         vocab_size=self.model_config.vocab_size, eos_token_id=self.eos_token_id,
                         tokenizer=self.tokenizer, block_size=self.args.block_size,
                         num_blocks=self.num_blocks, max_num_seqs=self.args.max_num_seqs,
                         max_num_batched_tokens=self.args.max_num_batched_tokens,
                         grammar_compiler=self.grammar_compiler, scheduling_policy=self.scheduler.policy,
                         kv_cache_dtype=str(self.kv_cache_dtype).removeprefix("torch."),
                         bytes_per_block=self.bytes_per_block,
                         max_loras=self.args.max_loras if self.args.enable_lora else 0)

    def _fail_requests(self, requests: Iterable[Request], exc: Exception) -> list[RequestOutput]:
        """End the user requests of ``requests``, every sample, with finish reason ``"error"``
        and return their final outputs. Their blocks are freed; the K/V the failed forward
        may have half written was never cached (``cache_blocks`` runs only after a forward),
        so no other request can read it."""
        error = f"the model forward failed: {type(exc).__name__}: {exc}"
        outputs = []
        for parent_id in dict.fromkeys(self._child_to_parent[request.request_id] for request in requests):
            parent = self.parents[parent_id]
            self.scheduler.finish_requests([child.request_id for child in parent.children],
                                           RequestStatus.FINISHED_ERROR)
            for child in parent.children:
                if not child.is_finished():  # a fork that was still pending
                    child.status = RequestStatus.FINISHED_ERROR
            output = self._make_output(parent)
            if output is not None:
                output.error = error
                outputs.append(output)
            self._forget(parent_id)
        return outputs

    def _emit(self, parent: ParentRequest) -> None:
        """Queue the final output of a request that ended outside ``step`` and forget it."""
        output = self._make_output(parent)
        if output is not None:
            self._pending_outputs.append(output)
        self._forget(parent.request_id)

    def _forget(self, parent_id: str) -> None:
        children = self.parents.pop(parent_id).children
        for child in children:
            self._finished_since_step.add(child.request_id)
            del self._child_to_parent[child.request_id]
            self._scheduled_once.discard(child.request_id)
            if self.proposer is not None:
                self.proposer.remove(child.request_id)
        self.output_processor.free([child.request_id for child in children])

    def _make_output(self, parent: ParentRequest) -> Optional[RequestOutput]:
        return self.output_processor.make_output(
            parent.request_id, parent.prompt, parent.prompt_token_ids, parent.children,
            num_cached_tokens=max(0, parent.children[0].num_cached_tokens))


def _count_adapters(requests: Iterable[Request]) -> tuple[tuple[str, int], ...]:
    """``(lora_name, sequences)`` of the adapters among ``requests``, by name (empty without)."""
    return tuple(sorted(Counter(r.lora_request.lora_name for r in requests if r.lora_request is not None).items()))
