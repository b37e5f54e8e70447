"""``Worker``: one tensor-parallel rank (vLLM v1 ``vllm/v1/worker/cpu_worker.py``; nano-vllm's
per-rank ``ModelRunner``).

Every rank runs the same three calls, in this order, whatever the executor::

    Worker(engine_args, rank).load_model()     its shard: read, quantize (calibrate), shard
    worker.initialize_cache(num_blocks, ...)   its part of every KV block, via a ModelRunner
    worker.execute_model(...) / execute_step   each step (rank 0 samples; the others only compute)

The engine never sees the model: it asks its executor (``executor/``) for the facts it needs
(``model_config``, bytes per block, the tokenizer) and hands it each step's schedule.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch

from pagedllm.config import EngineArgs
from pagedllm.layers.quantization import get_quant_method, weight_bytes
from pagedllm.lora.manager import LoRAModelManager
from pagedllm.models.dummy import dummy_config_file, load_dummy_checkpoint, load_dummy_tokenizer
from pagedllm.models.llama import LlamaConfig, LlamaForCausalLM
from pagedllm.models.loader import (build_model, load_checkpoint, load_prequantized, load_tokenizer,
                                    resolve_model_path)
from pagedllm.models.quantize import calibration_token_ids
from pagedllm.models.sharding import TensorParallelShard
from pagedllm.spec_decode.draft_model_proposer import DraftModelProposer
from pagedllm.worker.kv_cache_sizing import bytes_per_block, determine_num_blocks
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

__all__ = ["Worker"]


class Worker:
    """One rank's model, KV cache and steps.

    Args:
        engine_args: the options (model, dtype, quantization, KV cache, LoRA).
        rank: this rank, ``0 <= rank < tensor_parallel_size``; rank 0 also samples and holds
            the tokenizer and the LoRA adapters.
        checkpoint: ``(config, state_dict)`` with Hugging Face names to take this rank's shard
            of, instead of loading ``engine_args.model``.
        model, tokenizer: an already built model (tests build tiny random ones) and its
            tokenizer; only with ``tensor_parallel_size == 1``.
    """

    def __init__(self, engine_args: EngineArgs, rank: int = 0, checkpoint: Optional[tuple[LlamaConfig, dict]] = None,
                 model: Optional[LlamaForCausalLM] = None, tokenizer: Any = None) -> None:
        self.args = engine_args
        self.rank = rank
        self.shard = TensorParallelShard(rank, engine_args.tensor_parallel_size)
        self._checkpoint = checkpoint
        self.model: Optional[LlamaForCausalLM] = model
        self.tokenizer = tokenizer
        self.model_runner: Optional[ModelRunner] = None
        self.lora_manager: Optional[LoRAModelManager] = None
        self.draft_model: Optional[LlamaForCausalLM] = None  # speculative_config's draft_model
        self.drafter: Optional[DraftModelProposer] = None
        self._loaded: Optional[tuple] = None  # what read_checkpoint read, until load_model builds it

    def read_checkpoint(self) -> None:
        """Read the weights (and, on rank 0, the tokenizer) and check that the model splits
        over the ranks; ``load_model`` then builds it. Executors call it first where a bad
        configuration must fail before other ranks start. A no-op when done or given a model.

        Raises:
            ValueError: the model cannot be found or read, or does not split over the ranks.
        """
        if self.model is not None or self._loaded is not None:
            return
        args = self.args
        prequantized = None
        quantization = args.quantization
        path = tokenizer_path = None
        if self._checkpoint is not None:
            config, state_dict = self._checkpoint
            self._checkpoint = None
        elif args.load_format == "dummy":
            path = dummy_config_file(args.model)
            config, state_dict = load_dummy_checkpoint(args.model, args.torch_dtype, args.seed)
            if self.rank == 0:
                self.tokenizer = load_dummy_tokenizer(args.model)
        else:
            path = resolve_model_path(args.model)
            config, state_dict = load_checkpoint(path)
            quantization, prequantized = load_prequantized(path, args.quantization)
            tokenizer_path = path if self.rank == 0 else None
        self.shard.check(config, quantization)  # the quantization method checks its own limits
        if tokenizer_path is not None:  # after the check: a refused configuration reads no tokenizer
            self.tokenizer = load_tokenizer(tokenizer_path)
        self._loaded = (path, config, state_dict, quantization, prequantized)

    def load_model(self) -> None:
        """Build this rank's shard of the model (reading it first unless ``read_checkpoint``
        did), and ``speculative_config``'s draft model: the one loading path of every rank.
        A given model is kept as it is.

        Raises:
            ValueError: the model cannot be found or built, or does not split over the ranks.
        """
        if self.model is None:
            self._build_model()
        speculative = self.args.speculative
        if speculative is not None and speculative.method == "draft_model" and self.draft_model is None:
            self.draft_model = self._load_draft_model(speculative.model, speculative.quantization)

    def _build_model(self) -> None:
        start = time.perf_counter()
        self.read_checkpoint()
        assert self._loaded is not None
        path, config, state_dict, quantization, prequantized = self._loaded
        self._loaded = None
        calibration = None
        if quantization is not None and get_quant_method(quantization).needs_calibration:
            calibration = calibration_token_ids(self.tokenizer, config.vocab_size)
        model = build_model(config, state_dict, self.args.torch_dtype, quantization, prequantized, self.shard,
                            calibration)
        del state_dict, prequantized
        if self.rank > 0:
            model.lm_head = None  # only rank 0 computes logits (a tied head's table stays: the embedding)
        self.model = model
        logger.info("rank %d: loaded %s in %.1f s", self.rank, path or "the checkpoint", time.perf_counter() - start)

    def _load_draft_model(self, model: str, quantization: Optional[str]) -> LlamaForCausalLM:
        """``speculative_config``'s draft model, read as ``load_format`` says, in the target's dtype."""
        assert self.model is not None
        dtype = self.model.dtype
        if self.args.load_format == "dummy":
            config, state_dict = load_dummy_checkpoint(model, dtype, self.args.seed)
            prequantized = None
        else:
            path = resolve_model_path(model)
            config, state_dict = load_checkpoint(path)
            quantization, prequantized = load_prequantized(path, quantization)
        calibration = (calibration_token_ids(self.tokenizer, config.vocab_size)
                       if quantization is not None and get_quant_method(quantization).needs_calibration else None)
        return build_model(config, state_dict, dtype, quantization, prequantized, calibration_token_ids=calibration)

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The KV cache's dtype (``EngineArgs.kv_cache_dtype`` under this model's dtype)."""
        assert self.model is not None, "load_model first"
        return self.args.kv_cache_torch_dtype(self.model.dtype)

    def bytes_per_block(self) -> int:
        """Bytes of one block's K and V over every layer on this rank."""
        assert self.model is not None, "load_model first"
        return bytes_per_block(self.model, self.args.block_size, self.kv_cache_dtype)

    def determine_num_blocks(self, other_ranks_memory: int = 0) -> int:
        """How many KV blocks the budget holds (``worker/kv_cache_sizing.py``), counting
        ``other_ranks_memory`` resident bytes of the other ranks as used."""
        assert self.model is not None, "load_model first"
        draft_bytes = (bytes_per_block(self.draft_model, self.args.block_size, self.kv_cache_dtype)
                       if self.draft_model is not None else 0)
        return determine_num_blocks(self.model, self.args, self.kv_cache_dtype, other_ranks_memory, draft_bytes)

    def initialize_cache(self, num_blocks: int, max_model_len: Optional[int] = None,
                         broadcast_steps: bool = False) -> None:
        """Allocate this rank's ``num_blocks``-block KV cache (a ``ModelRunner``); on rank 0 set
        up the LoRA adapters (``enable_lora``). ``max_model_len`` fixes what depends on it
        (Phi-3's longrope factors). ``broadcast_steps``: rank 0 of several, which sends each
        step's inputs to the others."""
        model, args = self.model, self.args
        assert model is not None, "load_model first"
        if max_model_len is not None and hasattr(model, "set_max_model_len"):
            model.set_max_model_len(max_model_len)
        if args.enable_lora and self.rank == 0:
            self.lora_manager = LoRAModelManager(model, args.max_loras, args.max_lora_rank,
                                                 args.max_cpu_loras or args.max_loras)
        self.model_runner = ModelRunner(model, num_blocks, args.block_size, args.seed, self.kv_cache_dtype,
                                        broadcast_steps=broadcast_steps, lora_manager=self.lora_manager)
        if self.draft_model is not None:
            assert args.speculative is not None and max_model_len is not None
            self.drafter = DraftModelProposer(args.speculative, self.draft_model, model.config, num_blocks, args,
                                              self.kv_cache_dtype, max_model_len)
        if args.warm_kv_cache:
            start, warmed = time.perf_counter(), 0
            while (chunk := self.model_runner.warm_kv_cache(64 << 20)) > 0:
                warmed += chunk
            logger.info("rank %d: KV cache: %.0f MiB faulted in (warm_kv_cache) in %.1f s", self.rank,
                        warmed / 2**20, time.perf_counter() - start)

    @property
    def quantization(self) -> Optional[str]:
        """The quantization method the model was built with (None: not quantized)."""
        return getattr(self.model, "quantization", None)

    def weight_bytes(self) -> tuple[int, int]:
        """``(bytes, unquantized bytes)`` of this rank's weights (equal when not quantized)."""
        assert self.model is not None, "load_model first"
        held = weight_bytes(self.model)
        return held, self.model.unquantized_weight_bytes or held
