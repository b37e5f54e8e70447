"""``EngineClient``: what the OpenAI server's routes need from an engine (vLLM's
``vllm/engine/protocol.py``).

Two implementations: ``AsyncLLMEngine`` (the engine thread in this process) and
``pagedllm.serve_ray.engine_client.RayEngineClient`` (engine replicas behind Ray Serve). The
routes in ``entrypoints/openai/`` are written against this protocol only, so one copy of them
serves both: same request checks, same errors, same SSE.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Optional, Protocol

from pagedllm.engine.input_processor import PromptType
from pagedllm.engine.stats import LoadStats, ModelInfo, SchedulerStats
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


class OutputStream(Protocol):
    """The outputs of one submitted request (``async_engine.RequestStream`` is the model):
    cumulative ``RequestOutput``s, the last one ``finished``; iteration raises the error that
    ended the request instead of yielding it."""

    request_id: str
    last_output: Optional[RequestOutput]
    # Set by a reader that shows its client nothing but the final output (the non-streaming
    # routes): a remote stream may then restart a request whose replica was lost even after
    # partial outputs, since nobody has seen them.
    final_only: bool

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def __anext__(self) -> RequestOutput: ...

    @property
    def finished(self) -> bool: ...

    def close(self) -> None:
        """Stop reading; abort the request unless it ended (idempotent)."""

    def abort(self, error: Optional[BaseException] = None) -> None:
        """End the request: the reader gets its final output (finish reason ``"abort"``), or
        ``error``."""


class EngineClient(Protocol):
    """The engine as the HTTP routes see it. Attributes are snapshots, readable from the event
    loop without waiting: ``stats`` and ``load`` describe where a new request would run."""

    model_info: ModelInfo
    stats: SchedulerStats
    load: LoadStats
    metrics: Any  # has ``registry``, ``model_name`` and ``render() -> bytes``; or None
    request_timeout: Optional[float]
    dead_error: Optional[BaseException]
    draining: bool

    @property
    def is_healthy(self) -> bool: ...

    @property
    def num_open_requests(self) -> int: ...

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          cache_salt: Optional[str] = None, priority: int = 0,
                          lora_request: Optional[LoRARequest] = None) -> OutputStream: ...

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter (``LLMEngine.add_lora``). Raises: ValueError for a refused one."""

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter (``LLMEngine.remove_lora``)."""
