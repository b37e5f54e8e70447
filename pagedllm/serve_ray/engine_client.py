"""``RayEngineClient``: the engine replicas behind Ray Serve, as the OpenAI routes' engine.

It implements ``engine/protocol.py``'s ``EngineClient``, so ``build_app`` serves it with the same
routes, checks and errors as a local ``AsyncLLMEngine``:

    route ── add_request ─┬─ tokenize here, prefix keys ─ handle.generate (streaming) ─▶ replica
                          │    first item ACCEPTED ◀─ or the replica's error (400/429/503...)
                          └─ RemoteRequestStream ◀─ RequestOutputs ... final
    close()  ─ cancels the Ray call: the replica's generator ends and aborts (blocks freed)
    abort()  ─ the same, and the reader gets the final output, finish reason "abort"

Replica loss (its process killed, its node gone): a request whose client has seen nothing yet
(no output delivered to the reader, or a non-streaming reader, ``final_only``) is sent again,
up to ``max_retries`` times (Serve routes it to a live replica); one that has streamed ends
with ``ReplicaLostError`` (503, the SSE error event), never a hang. The error names no Ray
internals (actor ids, pids); the log has them.

What the routes read as snapshots (``stats``, ``load``, ``is_healthy``, ``/metrics``) comes from
the replicas' reports (``EngineReplica.record_routing_stats``), fetched every ``report_interval`` seconds:
``stats``/``load`` are those of the replica with the shortest estimated wait, where a new
request could run soonest, so overload protection refuses (503) only when every replica is
overloaded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any, Awaitable, Callable, Optional

import ray
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from ray.exceptions import RayActorError, RayTaskError

from pagedllm.engine.async_engine import EngineDeadError, EngineDrainingError
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.stats import LoadStats, ModelInfo, SchedulerStats
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.serve_ray.prefix_index import prefix_block_hashes
from pagedllm.serve_ray.replica import ACCEPTED

logger = logging.getLogger(__name__)

_REPLICA_ACTOR_PREFIX = "SERVE_REPLICA::"  # Serve names replica actors SERVE_REPLICA::app#deployment#id
_SERVE_NAMESPACE = "serve"


class ReplicaLostError(EngineDeadError):
    """The replica running the request was lost after its client had been sent output (503)."""


def _cause(exc: BaseException) -> BaseException:
    """The replica's own exception inside Ray's wrapper (``RayTaskError``), else ``exc``."""
    if isinstance(exc, RayTaskError) and isinstance(exc.cause, BaseException):
        return exc.cause
    return exc


def _replica_lost(exc: BaseException) -> bool:
    return isinstance(exc, RayActorError) or isinstance(_cause(exc), RayActorError)


class RemoteRequestStream:
    """One request's outputs from a replica (``engine/protocol.py``'s ``OutputStream``).

    Args:
        request_id: the id the routes gave.
        generator: the Serve streaming response, past its ``ACCEPTED`` item.
        resubmit: sends the request again and returns the new generator past ``ACCEPTED``
            (used when the replica is lost before any output reached the reader).
        prompt_token_ids, num_samples: what a synthesized final output (abort before any
            output) reports.
        on_end: called once when the stream ends, however.
    """

    def __init__(self, request_id: str, generator: Any, resubmit: Callable[[], Awaitable[Any]],
                 prompt: Optional[str], prompt_token_ids: list[int], num_samples: int,
                 max_retries: int, on_end: Callable[[], None]) -> None:
        self.request_id = request_id
        self.last_output: Optional[RequestOutput] = None
        self._generator = generator
        self._resubmit = resubmit
        self._prompt = prompt
        self._prompt_token_ids = prompt_token_ids
        self._num_samples = num_samples
        self._retries_left = max_retries
        self._on_end = on_end
        self._done = False
        self._ended = False
        self._abort: Optional[BaseException | str] = None  # set by abort(): "abort" or the error
        self.final_only = False  # engine/protocol.py: set by non-streaming readers

    def __aiter__(self) -> "RemoteRequestStream":
        return self

    @property
    def finished(self) -> bool:
        return self._done

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        while True:
            if self._abort is not None:
                return self._end_aborted()
            try:
                item = await self._generator.__anext__()
            except StopAsyncIteration:
                self._end()
                raise EngineDeadError("the replica ended the request's stream without a final output") from None
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._abort is not None and not (task is not None and task.cancelling()):
                    return self._end_aborted()
                self._end()
                raise
            except Exception as exc:  # noqa: BLE001 - each is mapped to what the routes know
                if self._abort is not None:
                    return self._end_aborted()
                unseen = self.last_output is None or self.final_only
                if _replica_lost(exc) and unseen and self._retries_left > 0:
                    self._retries_left -= 1
                    logger.warning("request %s: its replica was lost before its client saw output (%s); sending "
                                   "it again", self.request_id, _cause(exc))
                    self.last_output = None
                    self._generator = await self._resubmit()
                    continue
                self._end()
                if _replica_lost(exc):
                    logger.warning("request %s: its replica was lost (%s)", self.request_id, _cause(exc))
                    sent = sum(len(c.token_ids) for c in self.last_output.outputs) if self.last_output else 0
                    what = (f"after {sent} generated token(s) had been sent" if not unseen
                            else "with no retries left")
                    raise ReplicaLostError(f"the engine replica serving this request was lost {what}; "
                                           "retry the request") from None
                raise _cause(exc) from None
            self.last_output = item
            if item.finished:
                self._end()
            return item

    def _end(self) -> None:
        self._done = True
        if not self._ended:
            self._ended = True
            self._on_end()

    def _end_aborted(self) -> RequestOutput:
        """The final output after ``abort()``: what was generated, unfinished samples ending
        with ``"abort"``; or the abort's error."""
        self._end()
        if isinstance(self._abort, BaseException):
            raise self._abort
        last = self.last_output
        outputs = last.outputs if last is not None else [
            CompletionOutput(index, "", []) for index in range(self._num_samples)]
        outputs = [c if c.finish_reason is not None else replace(c, finish_reason="abort") for c in outputs]
        final = RequestOutput(self.request_id, self._prompt, self._prompt_token_ids, outputs, finished=True,
                              num_cached_tokens=last.num_cached_tokens if last is not None else 0)
        self.last_output = final
        return final

    def close(self) -> None:
        """Stop reading: cancel the replica call unless it ended (the replica aborts the
        request and frees its blocks). Idempotent."""
        if not self._done:
            self._generator.cancel()
            self._end()

    def abort(self, error: Optional[BaseException] = None) -> None:
        """End the request on its replica; the reader gets its final output (finish reason
        ``"abort"``), or ``error``."""
        if not self._done and self._abort is None:
            self._abort = error if error is not None else "abort"
            self._generator.cancel()


class IngressMetrics:
    """The ingress's ``/metrics``: its own registry (the per-key series ``build_app`` adds), every
    series of each replica's engine metrics as of its last report (``EngineReplica.record_routing_stats``:
    request counters, latency histograms, waiting/running/KV-usage gauges under pagedllm's and
    vLLM's names), each with a ``replica`` label added, and ``pagedllm:num_replicas``. A family
    that several replicas export is one family holding every replica's samples, so
    ``sum by (model_name)`` over it is the deployment's total."""

    def __init__(self, model_name: str, client: "RayEngineClient") -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._client = client
        self.registry.register(self)

    def describe(self) -> list:
        return []  # prometheus_client: a collector without describe() would be collected at registration

    def collect(self):
        merged: dict[str, Metric] = {}
        for replica, families in sorted(self._client.replica_metrics.items()):
            for family in families:
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                into.samples.extend(sample._replace(labels={**sample.labels, "replica": replica})
                                    for sample in family.samples)
        replicas = GaugeMetricFamily("pagedllm:num_replicas", "Engine replicas that answered the last report.",
                                     labels=["model_name"])
        replicas.add_metric([self.model_name], len(self._client.reports))
        yield from merged.values()
        yield replicas

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RayEngineClient:
    """The engine replicas of a Serve deployment, as an ``EngineClient``.

    Args:
        handle: the ``DeploymentHandle`` of the ``EngineReplica`` deployment.
        model_info: a replica's ``model_info()`` (tokenizer included).
        served_model_name: the ``model_name`` label of ``/metrics``.
        app_name, deployment_name: where the replicas are, for their reports.
        request_timeout: the replicas' request timeout (overload protection reads it).
        max_retries: how many times a request lost with its replica before any output is
            sent again.
        report_interval: seconds between two rounds of replica reports.
    """

    def __init__(self, handle: Any, model_info: ModelInfo, served_model_name: str, app_name: str,
                 deployment_name: str, request_timeout: Optional[float] = None, max_retries: int = 2,
                 report_interval: float = 0.5) -> None:
        self.model_info = model_info
        self.stats = SchedulerStats(num_blocks=model_info.num_blocks)
        self.load = LoadStats()
        self.request_timeout = request_timeout
        self.dead_error: Optional[BaseException] = None
        self.draining = False
        self.reports: dict[str, dict] = {}  # replica id -> its last report
        self.replica_metrics: dict[str, list[Metric]] = {}  # replica id -> its engine metrics then
        self.metrics = IngressMetrics(served_model_name, self)
        self.max_retries = max_retries
        self.report_interval = report_interval
        self._handle = handle.options(stream=True)
        self._input_processor = InputProcessor(model_info)
        self._actor_prefix = f"{_REPLICA_ACTOR_PREFIX}{app_name}#{deployment_name}#"
        self._actors: dict[str, Any] = {}
        self._num_open = 0
        self._poller: Optional[asyncio.Task] = None

    @property
    def is_healthy(self) -> bool:
        """True unless the last reports came from replicas that are all unhealthy."""
        return self.dead_error is None and (not self.reports or any(r["healthy"] for r in self.reports.values()))

    @property
    def num_open_requests(self) -> int:
        return self._num_open

    async def drain(self, timeout: float, poll: float = 0.05) -> int:
        """Refuse new requests (503, ``EngineDrainingError``; ``/readyz`` false) and wait up to
        ``timeout`` seconds for the open ones to end.

        Returns:
            How many requests were still open at the deadline (Serve's shutdown then ends them).
        """
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._num_open and loop.time() < deadline:
            await asyncio.sleep(poll)
        return self._num_open

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Raises: ValueError: replicas serve no LoRA adapters."""
        raise ValueError("LoRA adapters are not served by Ray Serve replicas (pagedllm serve --replicas)")

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Nothing is loaded on replicas: False."""
        return False

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          cache_salt: Optional[str] = None, priority: int = 0,
                          lora_request: Optional[LoRARequest] = None) -> RemoteRequestStream:
        """Tokenize ``prompt``, send it to a replica chosen by the deployment's router, and
        return its stream once the replica's engine accepted it.

        Raises:
            ValueError: the prompt (tokenization, length) or anything the replica's engine
                refuses; a ``lora_request`` (replicas serve no adapters); QueueFullError,
                EngineDrainingError, EngineDeadError as the replica's engine raises them;
                ReplicaLostError when no replica could take it.
        """
        if lora_request is not None:
            raise ValueError("LoRA adapters are not served by Ray Serve replicas (pagedllm serve --replicas)")
        if self.draining:
            raise EngineDrainingError("the server is shutting down and takes no new requests")
        text, token_ids = self._input_processor.tokenize(prompt, self._input_processor.truncation(params))
        engine_prompt = {"prompt_token_ids": token_ids, "prompt": text}
        keys = tuple(prefix_block_hashes(token_ids, self.model_info.block_size, cache_salt))

        async def submit() -> Any:
            for attempt in range(self.max_retries + 1):
                generator = self._handle.generate.remote(request_id, engine_prompt, params, cache_salt,
                                                         priority, prefix_hashes=keys)
                try:
                    first = await generator.__anext__()
                except asyncio.CancelledError:
                    generator.cancel()
                    raise
                except Exception as exc:  # noqa: BLE001 - mapped below
                    if _replica_lost(exc) and attempt < self.max_retries:
                        logger.warning("request %s: replica lost while adding it (%s); sending it again",
                                       request_id, type(_cause(exc)).__name__)
                        continue
                    if _replica_lost(exc):
                        raise ReplicaLostError(f"no replica could take the request: {_cause(exc)}") from None
                    raise _cause(exc) from None
                if first != ACCEPTED:
                    generator.cancel()
                    raise RuntimeError(f"the replica answered {first!r} instead of accepting the request")
                return generator
            raise AssertionError("unreachable")

        generator = await submit()
        self._num_open += 1
        return RemoteRequestStream(request_id, generator, submit, text, token_ids, params.n, self.max_retries,
                                   self._stream_ended)

    def _stream_ended(self) -> None:
        self._num_open -= 1

    async def fetch_reports(self, timeout: float = 5.0) -> dict[str, dict]:
        """Every live replica's ``report()``, by replica id, asked directly of the replica
        actors (fresh: the routers' copies come through Serve's controller, a period late).
        A replica that does not answer within ``timeout`` seconds is left out."""
        # Two GCS lookups of a few milliseconds, on the event loop: an executor thread here kept
        # the ingress process from exiting at shutdown.
        named = ray.util.list_named_actors(all_namespaces=True)
        names = [entry["name"] for entry in named
                 if entry["namespace"] == _SERVE_NAMESPACE and entry["name"].startswith(self._actor_prefix)]
        for name in set(self._actors) - set(names):
            del self._actors[name]
        for name in names:
            if name not in self._actors:
                try:
                    self._actors[name] = ray.get_actor(name, namespace=_SERVE_NAMESPACE)
                except ValueError:  # gone since the listing
                    continue
        replicas = list(self._actors.items())
        refs = [actor.record_routing_stats.remote() for _, actor in replicas]
        results = await asyncio.wait_for(asyncio.gather(*refs, return_exceptions=True), timeout)
        return {name.rsplit("#", 1)[-1]: report for (name, _), report in zip(replicas, results)
                if isinstance(report, dict) and report}

    def update_reports(self, reports: dict[str, dict]) -> None:
        """Publish ``reports``: ``stats`` and ``load`` become those of the replica a new
        request would start soonest on (shortest estimated wait, then fewest waiting)."""
        self.replica_metrics = {replica: report.pop("metrics", []) for replica, report in reports.items()}
        self.reports = reports
        healthy = [r for r in reports.values() if r["healthy"]]
        if not healthy:
            return

        def wait(report: dict) -> tuple:
            estimate = report["estimated_wait_s"]
            return (estimate if estimate is not None else float("inf"), report["waiting"])
        best = min(healthy, key=wait)
        self.stats = SchedulerStats(num_running_reqs=best["running"], num_waiting_reqs=best["waiting"],
                                    num_blocks=best["num_blocks"], num_used_blocks=best["num_used_blocks"],
                                    prefix_cache_queries=best["prefix_cache_queries"],
                                    prefix_cache_hits=best["prefix_cache_hits"])
        self.load = LoadStats(step_time=best["step_time_s"], finish_rate=best["finish_rate"])

    async def _poll_reports(self) -> None:
        while True:
            started = time.monotonic()
            try:
                self.update_reports(await self.fetch_reports())
            except Exception:  # noqa: BLE001 - a failed round leaves the last reports; try again
                logger.warning("fetching the replicas' reports failed", exc_info=True)
            await asyncio.sleep(max(0.0, self.report_interval - (time.monotonic() - started)))

    def start(self) -> None:
        """Start fetching the replicas' reports (on the running event loop)."""
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll_reports())

    def shutdown(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
