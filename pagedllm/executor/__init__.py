"""Executors: how the engine's steps reach the workers (vLLM v1 ``vllm/v1/executor/``).

``UniProcExecutor`` runs the one ``Worker`` in the engine's process; ``MultiprocExecutor`` runs
rank 0's worker there too and one process per other tensor-parallel rank, and owns what
happens when a rank fails. The engine holds one of them and nothing of the model.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from pagedllm.config import EngineArgs
from pagedllm.executor.multiproc_executor import MultiprocExecutor
from pagedllm.executor.uniproc_executor import UniProcExecutor

Executor = Union[UniProcExecutor, MultiprocExecutor]

__all__ = ["Executor", "MultiprocExecutor", "UniProcExecutor", "make_executor"]


def make_executor(engine_args: EngineArgs, model: Any = None, tokenizer: Any = None,
                  checkpoint: Optional[tuple] = None) -> Executor:
    """The executor ``engine_args.tensor_parallel_size`` asks for, with the model loaded.

    Raises:
        ValueError: a built ``model`` with ``tensor_parallel_size > 1`` (every rank builds its
            own shard), or a model that cannot load or split over the ranks.
        TensorParallelError: a rank failed to start.
    """
    if engine_args.tensor_parallel_size > 1:
        if model is not None:
            raise ValueError(f"tensor_parallel_size={engine_args.tensor_parallel_size} builds every rank's "
                             "shard itself: give engine_args.model or checkpoint=(config, state_dict), not a "
                             "built model")
        return MultiprocExecutor(engine_args, checkpoint, tokenizer)
    return UniProcExecutor(engine_args, model, tokenizer, checkpoint)
