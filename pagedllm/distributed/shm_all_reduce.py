"""All-reduce through a shared-memory file, for ranks on one machine (the idea of vLLM's CPU
``SHMManager`` / ``shm_allreduce``; this is a small Python version of it).

Why: gloo's all-reduce wakes a process blocked in ``recv``; on this project's loaded 2-core VM
that took 2-3.5 ms per call whatever the size (3.5 KiB or 4.6 MiB), 48 calls per step of
Qwen2.5-0.5B: 65-78% of a TP=2 step. Spinning on a shared flag kept the waiting rank on its
core: 7.5 us for 3.5 KiB under the same load (``bench/tensor_parallel.py --allreduce-micro``).

Protocol, per chunk of at most ``CHUNK_BYTES``: rank ``r`` copies its chunk into its slot of
buffer ``seq % 2``, then stores ``seq`` into its flag; it waits until every flag is ``>= seq``,
then sums the slots in rank order (fp32 accumulation, one rounding), so every rank gets the
same bits. Two buffers make reuse safe without a second barrier: a rank writes buffer
``seq % 2`` only after every rank posted ``seq - 1``, that is after each finished reading that
buffer at ``seq - 2``. x86 keeps stores in order (and glibc's non-temporal ``memcpy`` path ends
with ``sfence``), so a flag is never seen before the data it covers.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np
import torch

CHUNK_BYTES = 4 * 2**20
_FLAG_STRIDE = 8  # int64s: one 64-byte cache line per rank's flag
# Spins between checks of the clock (and a sched_yield, to be fair to a loaded machine).
_SPINS_PER_CHECK = 1024


def shm_file_bytes(world_size: int) -> int:
    """Size of the file: the flags, then 2 buffers x ``world_size`` slots of ``CHUNK_BYTES``."""
    return world_size * _FLAG_STRIDE * 8 + 2 * world_size * CHUNK_BYTES


def create_shm_file(path: str, world_size: int) -> None:
    """Create the zero-filled file the ranks map (rank 0, before starting the others)."""
    with open(path, "wb") as f:
        f.truncate(shm_file_bytes(world_size))


class ShmAllReduce:
    """One rank's end of the shared-memory all-reduce.

    Args:
        path: the file made by ``create_shm_file`` (under /dev/shm: memory, not disk).
        rank, world_size: this rank and the number of ranks.
        peers_alive: returns False once another rank is known to be gone (checked while waiting).
        timeout_s: the longest wait for the other ranks at one chunk.
    """

    def __init__(self, path: str, rank: int, world_size: int, peers_alive: Callable[[], bool],
                 timeout_s: float) -> None:
        self.rank, self.world_size = rank, world_size
        self.peers_alive, self.timeout_s = peers_alive, timeout_s
        self._map = np.memmap(path, dtype=np.uint8, mode="r+", shape=(shm_file_bytes(world_size),))
        flag_bytes = world_size * _FLAG_STRIDE * 8
        self._flags = self._map[:flag_bytes].view(np.int64)
        self._data = torch.from_numpy(self._map[flag_bytes:]).view(2, world_size, CHUNK_BYTES)
        self._seq = 0

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum contiguous ``x`` over the ranks in place; returns ``x``.

        Raises:
            TimeoutError: a rank did not arrive within ``timeout_s``.
            ConnectionError: a rank is gone (``peers_alive``).
        """
        flat = x.view(-1)
        chunk = CHUNK_BYTES // x.element_size()
        for start in range(0, flat.numel(), chunk):
            part = flat[start:start + chunk]
            count = part.numel()
            self._seq += 1
            slots = self._data[self._seq % 2].view(x.dtype)[:, :count]
            slots[self.rank].copy_(part)
            self._flags[self.rank * _FLAG_STRIDE] = self._seq
            self._wait(self._seq)
            total = slots[0].to(torch.float32, copy=True)
            for rank in range(1, self.world_size):
                total += slots[rank]
            part.copy_(total)
        return x

    def _wait(self, seq: int) -> None:
        flags, spins, started = self._flags, 0, None
        for rank in range(self.world_size):
            while flags[rank * _FLAG_STRIDE] < seq:
                spins += 1
                if spins % _SPINS_PER_CHECK:
                    continue
                os.sched_yield()
                now = time.monotonic()
                if started is None:
                    started = now
                elif not self.peers_alive():
                    raise ConnectionError(f"rank {rank} is gone (shared-memory all-reduce)")
                elif now - started > self.timeout_s:
                    raise TimeoutError(f"rank {rank} did not reach the all-reduce within {self.timeout_s:g} s")

    def close(self) -> None:
        del self._data, self._flags
        self._map._mmap.close()
