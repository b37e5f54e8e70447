"""The tensor-parallel process groups of this process and the all-reduce the model layers call
(vLLM ``vllm/distributed/parallel_state.py``: ``init_distributed_environment``,
``tensor_model_parallel_all_reduce``).

Ranks are processes on one machine joined by gloo over loopback TCP. Two groups span the same
ranks: the ``data`` group carries a step's inputs and the all-reduces with a finite timeout
(``PAGEDLLM_TP_TIMEOUT_S``, default 120 s), so a rank that hangs inside a step ends the step
with an error; the ``control`` group carries only the per-step header that idle workers wait
on, with no practical timeout, so an engine may idle for hours. A rank that dies closes its
sockets and every peer's pending gloo call fails at once ("Connection closed by peer").
One tensor-parallel engine per process at a time: rank 0 is the engine's own process.

The all-reduce itself runs through shared memory (``shm_all_reduce.py``) when the ranks were
started with a shared file (the default on x86), else through gloo, the reference
(``disable_custom_all_reduce=True``, vLLM's option for the same choice).
"""

from __future__ import annotations

import contextlib
import datetime
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from pagedllm import envs
from pagedllm.distributed.shm_all_reduce import ShmAllReduce


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died, hung or failed: the engine cannot compute any more steps."""


@dataclass
class AllReduceStats:
    """Counters of ``tensor_model_parallel_all_reduce`` in this process since ``reset``.

    Attributes:
        calls: all-reduces run.
        bytes: bytes of the tensors reduced (each rank's contribution, not wire bytes).
        seconds: wall time inside them, waiting for slower ranks included.
    """

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def reset(self) -> None:
        self.calls, self.bytes, self.seconds = 0, 0, 0.0


@dataclass
class _State:
    rank: int
    world_size: int
    data_group: object
    control_group: object
    shm: Optional[ShmAllReduce]


_state: Optional[_State] = None
_collectives_enabled = True
all_reduce_stats = AllReduceStats()


def data_timeout_s() -> float:
    """Seconds a collective inside a step may wait for the other ranks (``PAGEDLLM_TP_TIMEOUT_S``)."""
    return envs.PAGEDLLM_TP_TIMEOUT_S


def init_distributed_environment(rank: int, world_size: int, port: int, shm_path: Optional[str] = None,
                                 peers_alive: Optional[Callable[[], bool]] = None) -> None:
    """Join the gloo groups of ``world_size`` ranks rendezvousing at ``127.0.0.1:port`` (rank 0
    hosts the store), and map ``shm_path`` (``shm_all_reduce.create_shm_file``) for the
    all-reduce when given (``peers_alive`` says whether the other ranks still exist). Blocks
    until every rank joined or ``data_timeout_s`` passed.

    Raises:
        RuntimeError: already initialized in this process, or the rendezvous timed out.
    """
    global _state
    if _state is not None:
        raise RuntimeError("a tensor-parallel group already exists in this process")
    timeout = datetime.timedelta(seconds=data_timeout_s())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))
    shm = None
    if shm_path is not None:
        shm = ShmAllReduce(shm_path, rank, world_size, peers_alive or (lambda: True), data_timeout_s())
    _state = _State(rank, world_size, dist.group.WORLD, control, shm)


def destroy_distributed_environment() -> None:
    """Leave the groups (a no-op when none)."""
    global _state
    if _state is not None:
        if _state.shm is not None:
            _state.shm.close()
        _state = None
        with contextlib.suppress(Exception):  # a peer already gone makes this fail; nothing to do then
            dist.destroy_process_group()


def is_initialized() -> bool:
    return _state is not None


def get_tp_rank() -> int:
    return _state.rank if _state is not None else 0


def get_tp_world_size() -> int:
    return _state.world_size if _state is not None else 1


def data_group():
    return _state.data_group


def control_group():
    return _state.control_group


@contextlib.contextmanager
def collectives_disabled() -> Iterator[None]:
    """Make ``tensor_model_parallel_all_reduce`` a no-op inside: rank 0 profiles its shard's
    activation peak alone (the shapes are those of a real step; the values do not matter)."""
    global _collectives_enabled
    _collectives_enabled = False
    try:
        yield
    finally:
        _collectives_enabled = True


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` (contiguous, any float dtype) over the ranks, in place; returns ``x``.

    Raises:
        TensorParallelError: a rank is gone or did not answer within ``data_timeout_s``.
    """
    if not _collectives_enabled:
        return x
    start = time.perf_counter()
    try:
        if _state.shm is not None:
            _state.shm.all_reduce_(x)
        else:
            dist.all_reduce(x, group=_state.data_group)
    except (RuntimeError, TimeoutError, ConnectionError) as exc:
        raise TensorParallelError(f"all-reduce failed, a tensor-parallel rank is gone or hung: {exc}") from exc
    all_reduce_stats.calls += 1
    all_reduce_stats.bytes += x.numel() * x.element_size()
    all_reduce_stats.seconds += time.perf_counter() - start
    return x
