"""``EngineReplica``: one ``AsyncLLMEngine`` as a Ray Serve deployment replica.

Each replica is a Ray actor process with its own engine thread, KV cache and prefix cache.
The ingress calls ``generate`` as a streaming handle call; Serve's router chooses the replica
(``router.py``). What a request's life looks like from here:

    generate() ── engine.add_request ─ refused? raise (QueueFullError, ValueError, ...)
        │ yield ACCEPTED            the ingress returns the stream: the request is admitted
        │ yield RequestOutput ...   cumulative outputs, as RequestStream delivers them
        └ finally: stream.close()   a cancelled call (client gone) aborts: blocks freed at once

Serve's controller calls ``record_routing_stats`` every ``request_routing_stats_period_s`` and
hands the result to every router; ``check_health`` failing (the engine loop died) makes Serve
replace the replica.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import Any, AsyncIterator, Callable, Optional

import torch

from pagedllm.config import EngineArgs
from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedllm.engine.input_processor import PromptType
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.stats import ModelInfo
from pagedllm.metrics import EngineMetrics
from pagedllm.sampling_params import SamplingParams
from pagedllm.serve_ray.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)

ACCEPTED = "accepted"  # the first item of every generate() stream: the engine took the request
MAX_REPORTED_KEYS = 4096  # bounds a routing report at 4096 ints (~40 KB pickled) per period


class EngineReplica:
    """A Serve replica serving one engine.

    Args:
        engine_args: the engine's options.
        served_model_name: the ``model_name`` label of its metrics.
        num_threads: torch threads of this replica (``cores // replicas`` so that replicas on
            one machine do not oversubscribe it).
        engine_factory: builds the engine from ``engine_args`` (default ``LLMEngine``; tests
            serve tiny random models through it).
        max_waiting_requests: as ``AsyncLLMEngine`` (429 beyond it).
        request_timeout: as ``AsyncLLMEngine`` (504 beyond it).

    Raises:
        ValueError: ``num_threads`` < 1, or bad engine options.
    """

    def __init__(self, engine_args: EngineArgs, served_model_name: str, num_threads: int,
                 engine_factory: Optional[Callable[[EngineArgs], LLMEngine]] = None,
                 max_waiting_requests: Optional[int] = None, request_timeout: Optional[float] = None) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        torch.set_num_threads(num_threads)
        build_engine = engine_factory or LLMEngine
        # Built on the engine thread, the one that steps it (AsyncLLMEngine: one OpenMP team).
        self.engine = AsyncLLMEngine(lambda: build_engine(engine_args), None, max_waiting_requests,
                                     request_timeout)
        self.engine.metrics = EngineMetrics(served_model_name, self.engine.model_info.max_model_len,
                                            engine_args.max_num_seqs, engine_args.max_num_batched_tokens,
                                            log_interval=None, model_info=self.engine.model_info)
        self.prefixes = PrefixIndex(min(self.engine.model_info.num_blocks, MAX_REPORTED_KEYS))
        self.pid = os.getpid()
        self.num_threads = num_threads
        self.engine.start()
        logger.info("engine replica (pid %d, %d threads) ready: %d KV blocks", self.pid, num_threads,
                    self.engine.model_info.num_blocks)

    def model_info(self) -> ModelInfo:
        """The model's facts for the ingress (its tokenizer included; the grammar compiler
        stays here, where requests are compiled)."""
        return replace(self.engine.model_info, grammar_compiler=None)

    async def generate(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       cache_salt: Optional[str] = None, priority: int = 0,
                       prefix_hashes: tuple[int, ...] = ()) -> AsyncIterator[Any]:
        """``ACCEPTED``, then the request's cumulative ``RequestOutput``s.

        ``prefix_hashes`` (``prefix_index.prefix_block_hashes`` of the prompt) is what the
        router matched; it is recorded here as held once the engine took the request.

        Raises:
            what ``AsyncLLMEngine.add_request`` and its stream raise (ValueError,
            QueueFullError, EngineDrainingError, EngineDeadError, RequestFailedError,
            RequestTimeoutError); Ray hands them to the ingress.
        """
        stream = await self.engine.add_request(request_id, prompt, params, cache_salt, priority)
        try:
            self.prefixes.add(prefix_hashes)
            yield ACCEPTED
            async for output in stream:
                yield output
        finally:
            stream.close()  # aborts unless finished: the ingress cancelled the call

    def report(self) -> dict:
        """Load and prefix keys, as plain data (what ``record_routing_stats`` returns);
        ``time`` is when it was taken (``time.time()``, seconds)."""
        stats, load = self.engine.stats, self.engine.load
        info = self.engine.model_info
        return {"time": time.time(), "pid": self.pid, "healthy": self.engine.is_healthy,
                "num_threads": self.num_threads,
                "running": stats.num_running_reqs, "waiting": stats.num_waiting_reqs,
                "kv_cache_usage": stats.kv_cache_usage, "num_blocks": stats.num_blocks,
                "num_used_blocks": stats.num_used_blocks, "max_num_seqs": info.max_num_seqs,
                "prefix_cache_queries": stats.prefix_cache_queries, "prefix_cache_hits": stats.prefix_cache_hits,
                "open_requests": self.engine.num_open_requests, "step_time_s": load.step_time,
                "finish_rate": load.finish_rate, "estimated_wait_s": load.estimated_wait(stats, info.max_num_seqs),
                "prefix_hashes": self.prefixes.keys()}

    def record_routing_stats(self) -> dict:
        """Serve's hook: called by the controller every ``request_routing_stats_period_s``, and
        by the ingress (``RayEngineClient.fetch_reports``). ``report()`` and, under ``metrics``,
        the engine's Prometheus families as collected now (``prometheus_client`` ``Metric``
        objects, ~17 KB pickled: request counters, latency histograms, gauges), which the
        ingress's ``/metrics`` serves with a ``replica`` label; Serve gives the whole dict to
        the router too, which reads only the load and the prefix keys."""
        return {**self.report(), "metrics": list(self.engine.metrics.registry.collect())}

    def check_health(self) -> None:
        """Serve's hook: raising makes the controller replace this replica.

        Raises:
            EngineDeadError: the engine loop died.
        """
        if not self.engine.is_healthy:
            raise EngineDeadError(f"the engine loop is dead: {self.engine.dead_error!r}")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
