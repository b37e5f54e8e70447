"""Tensor-parallel ranks 1..N-1: processes the engine spawns, each running its shard of the
model over its part of the KV cache, step after step, as rank 0 (the engine's own process)
broadcasts the inputs (vLLM's CPU backend: ``vllm/v1/worker/cpu_worker.py`` with its
``VLLM_CPU_OMP_THREADS_BIND`` core groups; here the launcher, the worker loop and the thread
placement).

Start-up, rank 0 (``TensorParallelWorkers``) and each worker (``_worker_main``)::

    spawn workers ─ init gloo groups (all ranks) ─ each builds its shard ─ barrier "loaded"
    ─ rank 0 sizes the pool (counting the workers' memory) ─ broadcast num_blocks ─ each
    allocates its KV cache ─ barrier "ready" ─ loop: receive_step() -> execute_step()

Rank 0 alone schedules, keeps the block tables and samples; a worker computes exactly the
forwards rank 0 computes, in the same order, so their all-reduces pair up.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import platform
import signal
import socket
import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from pagedllm.config import EngineArgs, parse_tp_cores
from pagedllm.distributed import parallel_state
from pagedllm.distributed.parallel_state import TensorParallelError, data_timeout_s
from pagedllm.distributed.shm_all_reduce import create_shm_file
from pagedllm.worker.step_inputs import broadcast_shutdown, receive_step
from pagedllm.platform import numa_nodes, pin_threads, process_rss_bytes

logger = logging.getLogger(__name__)

_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
# Seconds ``shutdown`` waits for a worker to leave its loop before killing it.
_JOIN_TIMEOUT_S = 5.0


def rank_cpus(tp_size: int, tp_cores: Optional[str] = None) -> list[list[int]]:
    """The CPUs of each rank: ``tp_cores`` when given, else whole NUMA nodes
    (/sys/devices/system/node) when the nodes holding this process's CPUs split evenly over
    the ranks, else those CPUs in ``tp_size`` equal contiguous groups (core groups of one
    socket; the remainder is left unused).

    Raises:
        ValueError: fewer allowed CPUs than ranks, or a bad ``tp_cores``.
    """
    if tp_cores is not None:
        return parse_tp_cores(tp_cores, tp_size)
    allowed = sorted(os.sched_getaffinity(0))
    nodes = numa_nodes(set(allowed))
    if len(nodes) >= tp_size and len(nodes) % tp_size == 0:
        per_rank = len(nodes) // tp_size
        return [sum(nodes[r * per_rank:(r + 1) * per_rank], []) for r in range(tp_size)]
    if len(allowed) < tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} needs a CPU per rank; this process may use "
                         f"{len(allowed)} ({allowed})")
    per_rank = len(allowed) // tp_size
    return [allowed[r * per_rank:(r + 1) * per_rank] for r in range(tp_size)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _broadcast_int(value: int) -> int:
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.broadcast(tensor, 0, group=parallel_state.control_group())
    return int(tensor.item())


class TensorParallelWorkers:
    """Rank 0's handle on ranks 1..N-1: starts them, joins the gloo groups (pinning this
    process to rank 0's CPUs), and ends them.

    Args:
        args: the engine options (``tensor_parallel_size``, ``tp_cores``, the model and dtypes
            each worker builds its shard with).
        checkpoint: ``(config, state_dict)`` to shard instead of loading ``args.model`` (sent
            to each worker once, at start).

    Raises:
        TensorParallelError: a worker did not join within ``data_timeout_s``.
        ValueError: bad ``tp_cores``, too few CPUs, or another tensor-parallel engine alive in
            this process (the groups are per process, as in vLLM).
    """

    def __init__(self, args: EngineArgs, checkpoint: Optional[tuple] = None) -> None:
        self.tp_size = args.tensor_parallel_size
        if parallel_state.is_initialized():
            raise ValueError("one tensor-parallel engine per process: shut the other one down first "
                             "(LLMEngine.shutdown)")
        cpus = rank_cpus(self.tp_size, args.tp_cores)
        port = _free_port()
        # The shared-memory all-reduce relies on x86's store order (shm_all_reduce.py).
        self.shm_path = None
        if not args.disable_custom_all_reduce and platform.machine() in ("x86_64", "AMD64"):
            self.shm_path = f"{_SHM_DIR}/pagedllm-tp-{os.getpid()}-{port}"
            create_shm_file(self.shm_path, self.tp_size)
        context = multiprocessing.get_context("spawn")
        started = [context.Pipe(duplex=False) for _ in range(1, self.tp_size)]
        self.processes = [context.Process(target=_worker_main, name=f"pagedllm-tp-rank{rank}", daemon=True,
                                          args=(rank, port, args, checkpoint, cpus[rank], self.shm_path,
                                                os.getpid(), started[rank - 1][1]))
                          for rank in range(1, self.tp_size)]
        for process in self.processes:
            process.start()
        self._closing = False
        self._failure_callbacks: list[Callable[[], None]] = []
        threading.Thread(target=self._watchdog, name="pagedllm-tp-watchdog", daemon=True).start()
        # Before multiprocessing's own exit handler kills the daemon workers: leave the gloo
        # groups cleanly (a group still open at exit aborts the interpreter).
        atexit.register(self.shutdown)
        self._saved_placement = (os.sched_getaffinity(0), torch.get_num_threads())
        pin_threads(cpus[0])
        logger.info("tensor parallel: %d ranks on CPUs %s (rank 0 is this process, pid %d; workers %s)",
                    self.tp_size, cpus, os.getpid(), [p.pid for p in self.processes])
        self._wait_started([reader for reader, _ in started])
        sentinels = [process.sentinel for process in self.processes]
        try:
            parallel_state.init_distributed_environment(
                0, self.tp_size, port, self.shm_path,
                lambda: not multiprocessing.connection.wait(sentinels, timeout=0))
        except Exception as exc:
            error = self.failure(exc)
            self.shutdown()
            raise error from exc

    def _wait_started(self, readers: list) -> None:
        """Wait until every worker runs ``_worker_main``; a worker that exits first (most often:
        a script without ``if __name__ == "__main__":``, which spawn re-imports) is an error at
        once, not after the rendezvous timeout."""
        for rank, (reader, process) in enumerate(zip(readers, self.processes), start=1):
            multiprocessing.connection.wait([reader, process.sentinel], timeout=data_timeout_s())
            try:
                started = reader.poll() and reader.recv()
            except EOFError:  # it died: its end of the pipe closed without a word
                started = False
            if not started:
                # The watchdog thread may be reaping it at the same moment: wait for the code.
                deadline = time.monotonic() + 10.0
                while process.exitcode is None and process.is_alive() and time.monotonic() < deadline:
                    process.join(0.1)
                how = (f"exited {_describe_exit(process.exitcode)}" if process.exitcode is not None
                       else "did not start in time")
                self.abandon()
                raise TensorParallelError(
                    f"tensor-parallel rank {rank} (pid {process.pid}) {how} before joining: its stderr "
                    "has the reason (a script that starts tensor parallelism must guard its code with "
                    "`if __name__ == \"__main__\":`, as multiprocessing's spawn re-imports it)")
            reader.close()

    def abandon(self) -> None:
        """End the workers at once (``SIGKILL``) and leave the groups: for when rank 0 left them
        inside a collective (an exception or ``KeyboardInterrupt`` mid-step) and a graceful
        shutdown broadcast would never be received."""
        self._closing = True
        for process in self.processes:
            process.kill()
        for process in self.processes:
            process.join()
        self.shutdown()

    def _watchdog(self) -> None:
        """Wait for any worker to exit; unless shutting down, log it and run the callbacks."""
        processes = list(self.processes)
        ended = multiprocessing.connection.wait([process.sentinel for process in processes])
        if self._closing:
            return
        for process in processes:
            if process.sentinel in ended:
                # Its pipe closes a moment before it can be reaped: wait for the exit code.
                process.join(5.0)
        for rank, process in enumerate(self.processes, start=1):
            if process.exitcode is not None:
                logger.error("tensor-parallel rank %d (pid %d) exited %s: the engine cannot compute",
                             rank, process.pid, _describe_exit(process.exitcode))
        for callback in self._failure_callbacks:
            callback()

    def on_failure(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` from the watchdog thread as soon as a worker exits unexpectedly
        (it must only hand the news over, e.g. put a command on a queue)."""
        self._failure_callbacks.append(callback)

    def wait_loaded(self) -> int:
        """Wait until every worker built its shard; returns their resident bytes together.

        Raises:
            TensorParallelError: a worker failed (its traceback is in its stderr).
        """
        self._collective(lambda: dist.barrier(group=parallel_state.control_group()))
        self._unlink_shm_file()  # every rank has mapped it: it goes when the last mapping does
        return sum(process_rss_bytes(process.pid) for process in self.processes)

    def allocate_kv_caches(self, num_blocks: int) -> None:
        """Have every worker allocate its ``num_blocks``-block KV cache and wait until it did."""
        self._collective(lambda: (_broadcast_int(num_blocks), dist.barrier(group=parallel_state.control_group())))

    def _collective(self, call) -> None:
        try:
            call()
        except RuntimeError as exc:
            raise self.failure(exc) from exc

    def _unlink_shm_file(self) -> None:
        if self.shm_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.shm_path)

    def check_alive(self) -> None:
        """Raises ``TensorParallelError`` naming the first worker that exited."""
        for rank, process in enumerate(self.processes, start=1):
            if process.exitcode is not None:
                raise TensorParallelError(f"tensor-parallel rank {rank} (pid {process.pid}) exited "
                                          f"{_describe_exit(process.exitcode)}: the engine cannot compute")

    def failure(self, exc: BaseException) -> TensorParallelError:
        """The error to raise after a collective failed with ``exc``: names the worker that
        exited (waiting up to a second for one to), else passes ``exc`` on."""
        for process in self.processes:
            process.join(1.0 / len(self.processes))
        try:
            self.check_alive()
        except TensorParallelError as dead:
            return dead if str(dead) in str(exc) else TensorParallelError(f"{dead} ({exc})")
        return exc if isinstance(exc, TensorParallelError) else TensorParallelError(str(exc))

    def shutdown(self) -> None:
        """Tell the workers to stop, join them (killing any still there after 5 s), leave the
        groups and give this process its CPUs back. Idempotent."""
        if not self.processes:
            return
        self._closing = True
        if parallel_state.is_initialized() and all(p.exitcode is None for p in self.processes):
            try:
                broadcast_shutdown()
            except TensorParallelError:
                pass
        for process in self.processes:
            process.join(_JOIN_TIMEOUT_S)
            if process.exitcode is None:
                process.kill()
                process.join()
        self.processes = []
        atexit.unregister(self.shutdown)
        parallel_state.destroy_distributed_environment()
        self._unlink_shm_file()
        affinity, num_threads = self._saved_placement
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(num_threads)


def _describe_exit(exitcode: int) -> str:
    if exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"with code {exitcode}"


def _worker_main(rank: int, port: int, args: EngineArgs, checkpoint: Optional[tuple], cpus: list[int],
                 shm_path: Optional[str], parent_pid: int, started) -> None:
    """A worker's life: say it started (``started``, a pipe's sending end), pin, join, build the
    shard, allocate the KV cache, then compute every step rank 0 broadcasts until it says shut
    down. Exits with an error when rank 0 is gone."""
    from pagedllm.worker.worker import Worker  # spawn imports this module first: keep the child light until it started

    started.send(True)
    started.close()

    logging.basicConfig(level=logging.WARNING)
    pin_threads(cpus)
    parallel_state.init_distributed_environment(rank, args.tensor_parallel_size, port, shm_path,
                                                lambda: os.getppid() == parent_pid)
    try:
        worker = Worker(args, rank, checkpoint)
        del checkpoint
        worker.load_model()
        dist.barrier(group=parallel_state.control_group())
        worker.initialize_cache(_broadcast_int(0))
        dist.barrier(group=parallel_state.control_group())
        with torch.inference_mode():
            while (step := receive_step()) is not None:
                worker.model_runner.execute_step(step)
    finally:
        parallel_state.destroy_distributed_environment()
