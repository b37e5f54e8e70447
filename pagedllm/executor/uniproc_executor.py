"""``UniProcExecutor``: one worker, in the engine's process (vLLM v1
``vllm/v1/executor/uniproc_executor.py``)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from pagedllm.config import EngineArgs
from pagedllm.lora.request import LoRARequest
from pagedllm.worker.model_runner import ModelRunnerOutput
from pagedllm.worker.worker import Worker

__all__ = ["UniProcExecutor"]


class UniProcExecutor:
    """Loads the model in this process and runs each step on it.

    A failed step raises what the forward raised: the engine ends that step's requests and
    goes on (``step_failures_are_fatal`` is False).

    Args:
        engine_args: the options.
        model, tokenizer: an already built model and its tokenizer (tests), or None to load
            ``engine_args.model``.
        checkpoint: ``(config, state_dict)`` to build the model from instead.
    """

    step_failures_are_fatal = False

    def __init__(self, engine_args: EngineArgs, model: Any = None, tokenizer: Any = None,
                 checkpoint: Optional[tuple] = None) -> None:
        self.driver_worker = Worker(engine_args, 0, checkpoint, model, tokenizer)
        self.driver_worker.load_model()

    @property
    def model_config(self):
        """The model's ``LlamaConfig`` (vocabulary, context length, EOS)."""
        return self.driver_worker.model.config

    @property
    def tokenizer(self) -> Any:
        return self.driver_worker.tokenizer

    @property
    def drafter(self) -> Any:
        """The ``draft_model`` proposer (``spec_decode/draft_model_proposer.py``), which runs
        the draft model beside this worker's; None for the other methods."""
        return self.driver_worker.drafter

    def determine_num_blocks(self) -> int:
        """KV blocks the budget holds (``Worker.determine_num_blocks``)."""
        return self.driver_worker.determine_num_blocks()

    def bytes_per_block(self) -> int:
        """Bytes of one KV block, all ranks together."""
        return self.driver_worker.bytes_per_block()

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        self.driver_worker.initialize_cache(num_blocks, max_model_len)

    def execute_model(self, *args: Any, **kwargs: Any) -> ModelRunnerOutput:
        """One step (``ModelRunner.execute_model``'s arguments)."""
        return self.driver_worker.model_runner.execute_model(*args, **kwargs)

    def warm_kv_cache(self, max_bytes: int) -> int:
        """``ModelRunner.warm_kv_cache`` of this process's cache."""
        return self.driver_worker.model_runner.warm_kv_cache(max_bytes)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.driver_worker.lora_manager.add_adapter(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.driver_worker.lora_manager.remove_adapter(lora_int_id)

    def list_loras(self) -> set[int]:
        return set(self.driver_worker.lora_manager.list_adapters())

    def check_health(self) -> None:
        """Nothing can fail outside a step in one process."""

    def on_failure(self, callback: Callable[[], None]) -> None:
        """No other process can fail."""

    def shutdown(self) -> None:
        """Nothing to stop."""
