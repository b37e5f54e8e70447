"""``AsyncLLMEngine``: the synchronous engine driven from its own thread, for asyncio servers.

The role of vLLM's ``AsyncLLM`` (``vllm/v1/engine/async_llm.py``), without a second process:

    event loop thread                              engine thread
    -----------------                              -------------
    add_request() --- _Add command ------------->  engine.add_request()  (ValueError, queue full)
          <------------ acknowledgement ----------
    RequestStream  <-- call_soon_threadsafe -----  engine.step() -> RequestOutputs, stats, metrics
    close()/abort() -- _Abort command ----------->  engine.abort_request() (blocks freed at once)

Only the engine thread touches the ``LLMEngine`` (servers have it build the engine too, so that
one thread runs every OpenMP region: see the constructor), so it needs no lock; the event loop only ever
waits on asyncio primitives and stays free to accept connections, stream and answer /health
while the model computes. Other threads read immutable snapshots instead (``stats.py``):
``model_info``, taken once at construction, and ``stats``, the engine's newest
``SchedulerStats``, which the engine thread replaces after every step and command. The block
pool's picture (``kv_snapshot.py``) costs more, so it is taken only on demand: once per
``get_kv_snapshot()`` (a command, answered between steps; the newest one again if nothing
changed since), and, while a live view is subscribed (``subscribe_kv()``), after a step at
most every ``kv_snapshot_interval`` seconds and once more when the engine goes idle. A stream
keeps only the newest output (outputs are cumulative), so a slow reader costs no memory.

Each submission gets its own engine id (``{request_id}@{serial}``): the user's id may be reused
as soon as its stream is closed, while the old instance's abort and final output are still on
their way, and they must reach only that old instance. Outputs carry the user's id again before
they reach the stream.

Failure modes:
- a bad request (``ValueError`` from the engine, or any other exception while adding it) fails
  only that request;
- an exception from the model forward ends the requests of that step (``LLMEngine.step``
  gives them finish reason ``"error"``; their blocks are freed): their streams raise
  ``RequestFailedError``, and every other request and the engine go on;
- any other exception from ``engine.step()`` kills the loop: every open stream gets
  ``EngineDeadError``, later requests fail at once with it, and ``is_healthy`` turns False;
- ``request_timeout`` aborts a request that has run that long (``RequestTimeoutError``);
- ``drain()`` waits for open requests, then aborts the rest (``EngineDrainingError``); the
  ``subscribe_kv()`` streams end at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable, Optional, Union

from pagedllm.engine.kv_snapshot import KVCacheSnapshot
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.engine.request_log import RequestLog
from pagedllm.engine.stats import LoadStats, LoadTracker, ModelInfo, SchedulerStats
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics import EngineMetrics
from pagedllm.outputs import RequestOutput
from pagedllm.platform import machine_memory
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
KV_WARM_BYTES = 4 << 20  # per idle slice of warm_kv_cache: 17-35 ms of page faults on the slowest VM measured

_Item = Union[RequestOutput, BaseException]  # what a stream delivers: an output, or the error that ends it


class EngineDeadError(RuntimeError):
    """The engine loop died; no request can run until the server restarts."""


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_waiting_requests`` sequences already (load shedding)."""


class RequestFailedError(RuntimeError):
    """The model forward of a step the request was in raised; the request was ended and the
    engine keeps serving the others."""


class RequestTimeoutError(RuntimeError):
    """The request ran longer than ``request_timeout`` and was aborted."""


class EngineDrainingError(RuntimeError):
    """The server is shutting down: the request was refused, or aborted when the drain ended."""


class RequestStream:
    """The outputs of one request, consumed with ``async for`` on the event loop.

    Each item is the request's cumulative ``RequestOutput``; items the reader did not take in
    time are replaced by newer ones, never reordered, and the final output (``finished``) or
    an error always arrives. Iteration raises the error (``EngineDeadError``,
    ``RequestFailedError``, ``RequestTimeoutError``, ``EngineDrainingError``) instead of
    yielding it.
    """

    final_only = False  # engine/protocol.py; nothing to restart in this process

    def __init__(self, request_id: str, engine: "AsyncLLMEngine", engine_request_id: str) -> None:
        self.request_id = request_id
        self.engine_request_id = engine_request_id  # this submission's id inside the LLMEngine
        self._engine = engine
        self._event = asyncio.Event()
        self._item: Optional[_Item] = None
        self._terminal = False  # the last item has been put (or the reader gave up)
        self._done = False  # the reader has taken the last item
        self.last_output: Optional[RequestOutput] = None  # the newest output the reader took

    def put(self, item: _Item) -> None:
        """Deliver an item (event loop thread only). Items after the last one are dropped."""
        if self._terminal:
            return
        self._item = item
        self._terminal = isinstance(item, BaseException) or item.finished
        if self._terminal:
            self._engine._forget(self)
        self._event.set()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        await self._event.wait()
        self._event.clear()
        item, self._item = self._item, None
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        self.last_output = item
        return item

    @property
    def finished(self) -> bool:
        return self._done

    def close(self) -> None:
        """Stop reading: abort the request unless it already ended. Idempotent; call it in a
        ``finally`` so that a client disconnect frees the request's blocks at once."""
        if not self._terminal:
            self._terminal = True
            self._engine._forget(self)
            self._engine._commands.put(_Abort(self.engine_request_id, None))

    def abort(self, error: Optional[BaseException] = None) -> None:
        """Abort this submission unless it already ended: the reader gets the final output
        (finish reason ``"abort"``), or ``error``. A later request that reuses the same
        ``request_id`` is never touched."""
        if not self._terminal:
            self._engine._commands.put(_Abort(self.engine_request_id, error))


@dataclass
class _Add:
    engine_request_id: str
    prompt: PromptType
    params: SamplingParams
    arrival_time: float
    cache_salt: Optional[str]
    priority: int
    stream: RequestStream
    ack: asyncio.Future
    loop: asyncio.AbstractEventLoop
    lora_request: Optional[LoRARequest] = None


@dataclass
class _UpdateLoRA:
    """Load (``lora_request``) or unload (``lora_int_id``) an adapter on the engine thread."""

    lora_request: Optional[LoRARequest]
    lora_int_id: int
    result: asyncio.Future
    loop: asyncio.AbstractEventLoop


@dataclass
class _Abort:
    engine_request_id: str
    error: Optional[BaseException]


@dataclass
class _TakeKVSnapshot:
    result: asyncio.Future
    loop: asyncio.AbstractEventLoop


@dataclass
class _Entry:
    """The engine thread's view of an open request."""

    stream: RequestStream
    loop: asyncio.AbstractEventLoop
    deadline: Optional[float]


_STOP = object()
# Queued by the engine's worker watchdog (another thread): the engine thread runs check_health,
# whose error ends the loop as a failed step would.
_CHECK_HEALTH = object()


class AsyncLLMEngine:
    """Runs an ``LLMEngine`` in a background thread and serves its requests to asyncio code.

    Attributes:
        model_info: the model's fixed facts (``max_model_len``, vocabulary, tokenizer, ...),
            for the server; taken before the engine thread serves.
        stats: the engine's newest ``SchedulerStats`` snapshot, readable from any thread.
            Replaced (never mutated) by the engine thread after every step and every command
            it takes, so a burst of requests is counted exactly by load shedding. The
            metrics gauges are set from each one as it is published.
        load: the newest ``LoadStats`` (recent step times and finish rate), replaced by the
            engine thread after every step.
        kv_snapshot: the newest ``KVCacheSnapshot`` the engine thread took (None before the
            first); readable from any thread, replaced only while someone asks for them.
        kv_snapshot_interval: seconds between two snapshots taken for subscribers while the
            engine steps (0.2: a live view updates about five times a second).

    Args:
        engine: the engine, or (what servers pass) a function without arguments that builds
            it, which then runs on the engine thread before the constructor returns; from
            ``start()`` on, only the engine thread may touch the engine. Build it there: the
            thread that loads a model must be the one that steps it. torch's OpenMP (libgomp)
            keeps a team of worker threads for every thread that ever ran a parallel region,
            and once it manages more threads than there are cores it cuts its spin-waits to
            ~100 spins, so each of a step's ~400 parallel regions sleeps and wakes through
            the kernel. A w8a8 SmolLM2 decode step stepped on another thread than the one
            that built it took 1.9x (batch 1) and 1.6x (batch 8) as long (bench/README.md,
            "Serving: one OpenMP team").
        metrics: Prometheus metrics to update after every step (None: no metrics); may be
            set as the attribute until ``start()``, e.g. from ``model_info``.
        max_waiting_requests: refuse a request (``QueueFullError``) when its sequences would
            take the ones waiting beyond the free seats of ``max_num_seqs``
            (``Scheduler.num_queued_seqs``) past this many (None: no limit): a burst on an
            idle server of ``max_num_seqs`` + this many sequences is all accepted. Counted
            when the engine thread adds the request, so a burst is counted exactly; a
            request is always accepted when no sequence waits beyond the free seats, so that
            an ``n`` above the limit is not refused forever.
        request_timeout: seconds after arrival at which a request is aborted with
            ``RequestTimeoutError`` (None: never).
        request_log: where finished requests are logged for ``pagedllm plan`` (None: nowhere);
            written by the engine thread, closed by ``shutdown``.
        warm_kv_cache: while no request runs, fault the KV pool in ahead of use
            (``LLMEngine.warm_kv_cache``, ``KV_WARM_BYTES`` between two looks at the queue),
            so that steps do not take those page faults; the whole pool ends up resident, as
            vLLM's zeroed one is from start-up, unless the machine runs short of memory first
            (``_memory_to_spare``). A 2,048-token prefill on fresh blocks took
            1.4-1.6 s against 0.9 s on warm ones (bench/README.md, "Serving: one OpenMP team").

    Raises:
        ValueError: ``max_waiting_requests`` < 1 or ``request_timeout`` <= 0.
        Exception: whatever the engine function raised (the engine thread has ended then).
    """

    def __init__(self, engine: Union[LLMEngine, Callable[[], LLMEngine]], metrics: Optional[EngineMetrics] = None,
                 max_waiting_requests: Optional[int] = None,
                 request_timeout: Optional[float] = None, request_log: Optional[RequestLog] = None,
                 warm_kv_cache: bool = True) -> None:
        if max_waiting_requests is not None and (isinstance(max_waiting_requests, bool) or
                                                 not isinstance(max_waiting_requests, int) or
                                                 max_waiting_requests < 1):
            raise ValueError(f"max_waiting_requests must be an integer >= 1, got {max_waiting_requests!r}")
        if request_timeout is not None and not request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {request_timeout!r}")
        self.load = LoadStats()
        self._load_tracker = LoadTracker()
        self.metrics = metrics
        self.max_waiting_requests = max_waiting_requests
        self.request_timeout = request_timeout
        self.request_log = request_log
        self.dead_error: Optional[BaseException] = None
        self.draining = False
        self.kv_snapshot: Optional[KVCacheSnapshot] = None
        self.kv_snapshot_interval = 0.2
        self.warm_kv_cache = warm_kv_cache
        self._kv_subscribers = 0  # written on the event loop, read by the engine thread
        self._kv_changed = True  # engine thread: a step or command since the last snapshot
        self._kv_taken_at = float("-inf")  # engine thread, time.monotonic()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._entries: dict[str, _Entry] = {}  # engine thread only, by engine request id
        self._active: dict[str, RequestStream] = {}  # event loop thread only, by user request id
        self._serials = itertools.count()
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        if isinstance(engine, LLMEngine):
            self._build: Optional[Callable[[], LLMEngine]] = None
            self._adopt(engine)
        else:
            self._build, self._build_error = engine, None
            self._built, self._started = threading.Event(), threading.Event()
            self._thread.start()
            interrupted = False
            while not self._built.is_set():
                try:
                    self._built.wait()
                except KeyboardInterrupt:  # Ctrl-C while it loads: that thread cannot be
                    interrupted = True  # interrupted; exiting under it aborts the process
            if self._build_error is not None:
                self._thread.join()
                raise self._build_error
            if interrupted:
                self.shutdown()
                raise KeyboardInterrupt

    def _adopt(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.model_info: ModelInfo = engine.get_model_info()
        self.stats: SchedulerStats = engine.make_stats()
        engine.on_worker_failure(lambda: self._commands.put(_CHECK_HEALTH))

    # ----------------------------------------------------------------------------- event loop side
    def start(self) -> None:
        """Start the engine thread (it runs already when the engine was built on it)."""
        if self._build is None:
            self._thread.start()
        else:
            self._started.set()

    @property
    def is_healthy(self) -> bool:
        """True while the engine loop runs (False once it died or was shut down)."""
        return self.dead_error is None and self._thread.is_alive()

    @property
    def num_open_requests(self) -> int:
        return len(self._active)

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          cache_salt: Optional[str] = None, priority: int = 0,
                          lora_request: Optional[LoRARequest] = None) -> RequestStream:
        """Queue a request and return its stream once the engine accepted it (``priority``,
        ``lora_request``: as ``LLMEngine.add_request``).

        Raises:
            ValueError: a duplicate in-flight ``request_id`` or anything ``LLMEngine.add_request``
                refuses (nothing is queued then).
            QueueFullError: too many sequences waiting.
            EngineDrainingError: the server is shutting down.
            EngineDeadError: the engine loop died.
        """
        loop = asyncio.get_running_loop()
        compiler = self.model_info.grammar_compiler
        if params.structured_outputs is not None and compiler is not None:
            # In a worker thread: this request waits for its grammar, the event loop and the
            # engine thread do not; the engine thread then finds it in the compiler's cache.
            await loop.run_in_executor(None, compiler.compile, params.structured_outputs)
        if self.dead_error is not None or not self._thread.is_alive():
            raise EngineDeadError(f"the engine loop is not running ({self.dead_error!r})")
        if self.draining:
            raise EngineDrainingError("the server is shutting down and takes no new requests")
        if request_id in self._active:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        stream = RequestStream(request_id, self, f"{request_id}@{next(self._serials)}")
        ack = loop.create_future()
        self._active[request_id] = stream
        self._commands.put(_Add(stream.engine_request_id, prompt, params, time.monotonic(), cache_salt,
                                priority, stream, ack, loop, lora_request))
        try:
            await ack
        except asyncio.CancelledError:
            stream.close()  # the add may already have happened: abort it
            raise
        except BaseException:
            self._forget(stream)
            raise
        return stream

    def abort(self, request_id: str, error: Optional[BaseException] = None) -> None:
        """Abort the open request ``request_id`` (event loop thread; unknown ids are ignored).
        Its blocks are freed when the engine thread takes the command, within one step. With
        ``error``, its stream ends with that error."""
        stream = self._active.get(request_id)
        if stream is not None:
            stream.abort(error)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """``LLMEngine.add_lora`` on the engine thread (between two steps).

        Raises:
            ValueError: as ``LLMEngine.add_lora``.
            EngineDeadError: the engine loop is not running.
        """
        return await self._update_lora(lora_request, lora_request.lora_int_id)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """``LLMEngine.remove_lora`` on the engine thread.

        Raises:
            EngineDeadError: the engine loop is not running.
        """
        return await self._update_lora(None, lora_int_id)

    async def _update_lora(self, lora_request: Optional[LoRARequest], lora_int_id: int) -> bool:
        if self.dead_error is not None or not self._thread.is_alive():
            raise EngineDeadError(f"the engine loop is not running ({self.dead_error!r})")
        loop = asyncio.get_running_loop()
        result = loop.create_future()
        self._commands.put(_UpdateLoRA(lora_request, lora_int_id, result, loop))
        return await result

    async def get_kv_snapshot(self) -> KVCacheSnapshot:
        """The block pool as it is now: taken by the engine thread between two steps (so this
        waits for at most one step), or its newest snapshot if nothing changed since; it is
        published as ``kv_snapshot`` too.

        Raises:
            EngineDeadError: the engine loop is not running.
        """
        if self.dead_error is not None or not self._thread.is_alive():
            raise EngineDeadError(f"the engine loop is not running ({self.dead_error!r})")
        loop = asyncio.get_running_loop()
        result = loop.create_future()
        self._commands.put(_TakeKVSnapshot(result, loop))
        return await result

    async def subscribe_kv(self) -> AsyncIterator[KVCacheSnapshot]:
        """Block-pool snapshots for a live view: a fresh one at once, then each newer one the
        engine thread publishes (at most one per ``kv_snapshot_interval`` while it steps, and
        one when it goes idle; nothing while nothing changes). While any subscriber iterates,
        the engine thread takes them; when the last one stops, it stops. It ends when the
        engine drains: an endless stream would hold the server's shutdown up.

        Raises:
            EngineDeadError: the engine loop is not running.
        """
        self._kv_subscribers += 1
        try:
            snapshot = await self.get_kv_snapshot()
            while not self.draining:
                yield snapshot
                while not self.draining and (self.kv_snapshot is None or
                                             self.kv_snapshot.version <= snapshot.version):
                    if not self.is_healthy:
                        raise EngineDeadError(f"the engine loop is not running ({self.dead_error!r})")
                    await asyncio.sleep(self.kv_snapshot_interval / 2)
                snapshot = self.kv_snapshot
        finally:
            self._kv_subscribers -= 1

    def _forget(self, stream: RequestStream) -> None:
        """``stream`` is no longer the open request of its id (a newer one may be already)."""
        if self._active.get(stream.request_id) is stream:
            del self._active[stream.request_id]

    async def drain(self, timeout: float) -> int:
        """Refuse new requests, let open ones finish for up to ``timeout`` seconds, then abort
        the rest (their streams raise ``EngineDrainingError``); ``subscribe_kv`` streams end at
        once.

        Returns:
            How many requests were aborted.
        """
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._active and loop.time() < deadline and self.is_healthy:
            await asyncio.sleep(0.05)
        remaining = list(self._active.values())
        for stream in remaining:
            stream.abort(EngineDrainingError(
                f"the server shut down: request aborted after the {timeout:g} s drain timeout"))
        while self._active and self.is_healthy:
            await asyncio.sleep(0.01)
        return len(remaining)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (unfinished requests are aborted first); its last act is
        ``LLMEngine.shutdown`` (the tensor-parallel workers)."""
        if self._thread.is_alive():
            self._commands.put(_STOP)
            if self._build is not None:
                self._started.set()  # built but never started: it serves only the stop
            self._thread.join(timeout)
        if self.request_log is not None and not self._thread.is_alive():
            self.request_log.close()

    # ----------------------------------------------------------------------------- engine thread
    def _run(self) -> None:
        if self._build is not None:
            try:
                self._adopt(self._build())
            except BaseException as exc:  # raised again by the constructor, on its thread
                self._build_error = exc
                return
            finally:
                self._built.set()
            self._started.wait()
        try:
            self._serve()
        finally:
            self.engine.shutdown()

    def _serve(self) -> None:
        engine = self.engine
        try:
            while True:
                idle, warming = not engine.has_unfinished_requests(), False
                if idle:
                    self._publish_kv_snapshot(due=True)  # the last picture before waiting
                    # Idle time warms the KV pool, a slice between two looks at the queue.
                    warming = (self.warm_kv_cache and _memory_to_spare()
                               and engine.warm_kv_cache(KV_WARM_BYTES) > 0)
                if not self._handle_commands(block=idle and not warming):
                    break
                self._expire(time.monotonic())
                if engine.has_unfinished_requests():
                    start = time.monotonic()
                    outputs = engine.step()
                    now = time.monotonic()
                    self._load_tracker.record_step(now - start, sum(o.finished for o in outputs), now)
                    self.load = self._load_tracker.snapshot(now)
                    self._kv_changed = True
                    self._publish_kv_snapshot()
                    self.stats = engine.make_stats()
                    if self.metrics is not None:
                        self.metrics.record_step(self.stats, outputs, now)
                    self._dispatch(outputs)
                elif self.metrics is not None:
                    self.metrics.update_gauges(self.stats)
                if self.metrics is not None:
                    self.metrics.log_if_due(self.stats, time.monotonic())
        except BaseException as exc:  # noqa: BLE001 - anything here kills the loop; say so
            logger.exception("the engine loop died")
            self._die(exc)
            return
        engine.abort_request(list(self._entries))
        while engine.has_unfinished_requests():
            self._dispatch(engine.step())

    def _handle_commands(self, block: bool) -> bool:
        """Take every queued command (waiting for one when ``block``). False on stop."""
        try:
            timeout = self.metrics.log_interval if self.metrics is not None else None
            command = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is _STOP:
                return False
            if command is _CHECK_HEALTH:
                self.engine.check_health()
            elif isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _TakeKVSnapshot):
                self._publish_kv_snapshot(asked=True)
                _call_soon(command.loop, _set_result, command.result, self.kv_snapshot)
            elif isinstance(command, _UpdateLoRA):
                self._update_lora_now(command)
            else:
                self._abort(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _publish_kv_snapshot(self, asked: bool = False, due: bool = False) -> None:
        """Take a block-pool snapshot into ``kv_snapshot`` when the engine changed since the
        last one (a step or a command) and someone wants it: ``asked`` (``get_kv_snapshot``),
        or a subscriber when ``due`` or ``kv_snapshot_interval`` has passed. Otherwise the
        newest one still holds, so equal versions always mean equal pictures."""
        if not self._kv_changed and self.kv_snapshot is not None:
            return
        now = time.monotonic()
        if not (asked or (self._kv_subscribers and (due or now - self._kv_taken_at >= self.kv_snapshot_interval))):
            return
        self.kv_snapshot = self.engine.make_kv_snapshot()
        self._kv_changed = False
        self._kv_taken_at = now

    def _add(self, command: _Add) -> None:
        engine = self.engine
        error: Optional[BaseException] = None
        queued = engine.scheduler.num_queued_seqs if self.max_waiting_requests is not None else 0
        if queued and queued + command.params.n > self.max_waiting_requests:
            error = QueueFullError(f"{queued} sequences are waiting beyond the free seats of max_num_seqs and "
                                   f"max_waiting_requests is {self.max_waiting_requests}: retry later")
        else:
            try:
                engine.add_request(command.engine_request_id, command.prompt, command.params,
                                   arrival_time=command.arrival_time, cache_salt=command.cache_salt,
                                   priority=command.priority, lora_request=command.lora_request)
            except ValueError as exc:
                error = exc
            except Exception as exc:  # noqa: BLE001 - a request must never kill the loop
                logger.exception("adding request %s failed", command.stream.request_id)
                error = ValueError(f"the request could not be added: {exc or type(exc).__name__}")
        if error is None:
            deadline = None if self.request_timeout is None else command.arrival_time + self.request_timeout
            self._entries[command.engine_request_id] = _Entry(command.stream, command.loop, deadline)
            if self.metrics is not None:
                self.metrics.request_added(command.engine_request_id, command.arrival_time)
            if self.request_log is not None:
                self.request_log.added(command.engine_request_id, command.arrival_time)
            self._publish_stats()
            self._kv_changed = True
        _call_soon(command.loop, _resolve, command.ack, error)

    def _update_lora_now(self, command: _UpdateLoRA) -> None:
        try:
            if command.lora_request is not None:
                done = self.engine.add_lora(command.lora_request)
            else:
                done = self.engine.remove_lora(command.lora_int_id)
        except Exception as exc:  # noqa: BLE001 - a bad adapter file must never kill the loop
            if not isinstance(exc, ValueError):
                exc = ValueError(f"the LoRA adapter could not be loaded: {type(exc).__name__}: {exc}")
            _call_soon(command.loop, _resolve, command.result, exc)
            return
        _call_soon(command.loop, _set_result, command.result, done)

    def _abort(self, command: _Abort) -> None:
        self.engine.abort_request(command.engine_request_id)
        self._publish_stats()
        self._kv_changed = True
        if command.error is not None:
            entry = self._entries.pop(command.engine_request_id, None)
            if entry is not None:
                _call_soon(entry.loop, entry.stream.put, command.error)

    def _publish_stats(self) -> None:
        """A new snapshot between steps; the gauges follow it, so that ``/metrics`` and
        ``/load`` report the same counts."""
        self.stats = self.engine.make_stats()
        if self.metrics is not None:
            self.metrics.update_gauges(self.stats)

    def _expire(self, now: float) -> None:
        expired = [rid for rid, entry in self._entries.items()
                   if entry.deadline is not None and now >= entry.deadline]
        for request_id in expired:
            self._abort(_Abort(request_id, RequestTimeoutError(
                f"the request ran longer than the server's request timeout of {self.request_timeout:g} s "
                "and was aborted")))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        # One wake-up of each event loop per step, not one per request.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, _Item]]] = {}
        for output in outputs:
            if output.finished and self.request_log is not None:
                self.request_log.finished(output)
            entry = self._entries.get(output.request_id)
            if entry is None:
                continue
            if output.finished:
                del self._entries[output.request_id]
            item: _Item = replace(output, request_id=entry.stream.request_id)
            if output.error is not None:
                item = RequestFailedError(output.error)
            batches.setdefault(entry.loop, []).append((entry.stream, item))
        for loop, items in batches.items():
            _call_soon(loop, _put_all, items)

    def _die(self, exc: BaseException) -> None:
        self.dead_error = exc
        if self.metrics is not None:
            self.metrics.engine_died()
        error = EngineDeadError(f"the engine loop died: {exc!r}")
        for entry in self._entries.values():
            _call_soon(entry.loop, entry.stream.put, error)
        self._entries.clear()
        # Commands already queued (or racing with dead_error) are answered, never left hanging.
        while True:
            command = self._commands.get()
            if command is _STOP:
                return
            if isinstance(command, _Add):
                _call_soon(command.loop, _resolve, command.ack, error)
            elif isinstance(command, (_TakeKVSnapshot, _UpdateLoRA)):
                _call_soon(command.loop, _resolve, command.result, error)


def _put_all(items: list[tuple[RequestStream, _Item]]) -> None:
    for stream, output in items:
        stream.put(output)


def _set_result(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _resolve(future: asyncio.Future, error: Optional[BaseException]) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _memory_to_spare() -> bool:
    """Whether idle KV warming may take more memory: the machine has more than a tenth of its
    memory (and 1 GiB) available. Pools that only fit because most of them stays unused (two
    servers each told a fraction of the whole machine) then never push it into swap or the
    OOM killer."""
    try:
        total, available = machine_memory()
    except (OSError, KeyError, ValueError):  # no /proc/meminfo
        return False
    return available > max(total // 10, 1 << 30)


def _call_soon(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass
