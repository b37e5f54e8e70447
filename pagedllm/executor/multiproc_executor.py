"""``MultiprocExecutor``: tensor parallelism over processes (vLLM v1
``vllm/v1/executor/multiproc_executor.py``). Rank 0's worker runs in the engine's process and
broadcasts each step's inputs; ranks 1..N-1 are processes (``worker/tp_worker.py``) running the
same ``Worker``. A rank that fails is handled here: the executor turns it into one
``TensorParallelError``, and computes nothing after it."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from pagedllm.config import EngineArgs
from pagedllm.distributed.parallel_state import TensorParallelError
from pagedllm.executor.uniproc_executor import UniProcExecutor
from pagedllm.worker.model_runner import ModelRunnerOutput
from pagedllm.worker.tp_worker import TensorParallelWorkers
from pagedllm.worker.worker import Worker

logger = logging.getLogger(__name__)

__all__ = ["MultiprocExecutor"]


class MultiprocExecutor(UniProcExecutor):
    """Starts ranks 1..N-1, builds rank 0's shard here, and runs each step on all of them.

    Every failure of a step is fatal (``step_failures_are_fatal``): the ranks run the same
    collectives in the same order, and one that stopped midway cannot be brought back.

    Args:
        engine_args: the options (``tensor_parallel_size > 1``, ``tp_cores``).
        checkpoint: ``(config, state_dict)`` every rank takes its shard of, or None to load
            ``engine_args.model``.
        tokenizer: the tokenizer of ``checkpoint``.

    Raises:
        ValueError: a model that does not split over the ranks (before any process starts).
        TensorParallelError: a rank failed to start or to build its shard.
    """

    step_failures_are_fatal = True

    def __init__(self, engine_args: EngineArgs, checkpoint: Optional[tuple] = None, tokenizer: Any = None) -> None:
        self.tp_size = engine_args.tensor_parallel_size
        self._error: Optional[TensorParallelError] = None
        self._workers: Optional[TensorParallelWorkers] = None
        self.driver_worker = Worker(engine_args, 0, checkpoint, tokenizer=tokenizer)
        self.driver_worker.read_checkpoint()  # a bad configuration fails before any process starts
        self._workers = TensorParallelWorkers(engine_args, checkpoint)
        try:
            self.driver_worker.load_model()
        except BaseException:
            self.shutdown()
            raise

    def determine_num_blocks(self) -> int:
        """The budget counts every rank: the others' resident bytes and a block's every part."""
        assert self._workers is not None
        return self.driver_worker.determine_num_blocks(self._workers.wait_loaded())

    def bytes_per_block(self) -> int:
        return self.driver_worker.bytes_per_block() * self.tp_size

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        assert self._workers is not None
        self._workers.allocate_kv_caches(num_blocks)
        self.driver_worker.initialize_cache(num_blocks, max_model_len, broadcast_steps=True)

    def execute_model(self, *args: Any, **kwargs: Any) -> ModelRunnerOutput:
        """One step on every rank.

        Raises:
            TensorParallelError: a rank is gone, or this step failed on rank 0 (then the other
                ranks are ended: they wait inside a collective that would never complete).
        """
        self.check_health()
        try:
            return self.driver_worker.model_runner.execute_model(*args, **kwargs)
        except TensorParallelError as exc:
            self._error = self._workers.failure(exc) if exc is not self._error else exc
            raise self._error from exc
        except BaseException as exc:
            self._error = TensorParallelError(
                f"a step was interrupted on rank 0 ({type(exc).__name__}): the ranks are out of step")
            self._workers.abandon()
            if isinstance(exc, Exception):
                raise self._error from exc
            raise

    def check_health(self) -> None:
        """Raises ``TensorParallelError`` when a rank is gone (vLLM's ``check_health``)."""
        if self._error is not None:
            raise self._error
        try:
            self._workers.check_alive()
        except TensorParallelError as exc:
            self._error = exc
            raise

    def on_failure(self, callback: Callable[[], None]) -> None:
        """Have ``callback()`` called from a watchdog thread as soon as a rank exits
        unexpectedly (it must only hand the news over)."""
        self._workers.on_failure(callback)

    def shutdown(self) -> None:
        """Stop the other ranks. Idempotent; nothing is computed after it."""
        if self._workers is not None:
            self._workers.shutdown()
            self._error = self._error or TensorParallelError("the engine was shut down")
