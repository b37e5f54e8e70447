"""``OpenAIIngress``: the OpenAI HTTP API of ``pagedllm serve`` as a Ray Serve ingress deployment.

The routes are ``build_app``'s own (``entrypoints/openai/api_server.py``): the same request
checks, API keys and per-key limits (429), overload protection (503), errors, SSE and usage,
over a ``RayEngineClient`` instead of a local engine. Serve's HTTP proxy hands each request to
this deployment as ASGI; a client that disconnects makes the proxy cancel the ASGI call, which
closes the request's streams and so cancels the replica's generator (blocks freed).

Per-key limits are counted per ingress replica: run one ingress replica (the default) for
limits to hold exactly as on one server.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from ray import serve

from pagedllm.config import DEFAULT_MAX_REQUEST_BODY_BYTES
from pagedllm.entrypoints.openai.api_keys import APIKey
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.serve_ray.engine_client import RayEngineClient

logger = logging.getLogger(__name__)


@serve.ingress()
class OpenAIIngress:
    """Args:
        engine: handle of the ``EngineReplica`` deployment.
        served_model_names: names clients may put in ``model``.
        app_name, engine_deployment: where the replicas are (their reports).
        api_key, api_keys, max_queue_wait, model_root, max_request_body_bytes: as ``build_app``.
        request_timeout: the replicas' request timeout (overload protection reads it).
    """

    async def __init__(self, engine: Any, served_model_names: Sequence[str], app_name: str,
                       engine_deployment: str, api_key: Optional[str] = None,
                       api_keys: Sequence[APIKey] = (), max_queue_wait: Optional[float] = None,
                       request_timeout: Optional[float] = None, model_root: Optional[str] = None,
                       max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES) -> None:
        model_info = await engine.model_info.remote()
        self.client = RayEngineClient(engine, model_info, served_model_names[0], app_name, engine_deployment,
                                      request_timeout=request_timeout)
        self.client.start()
        self._app_kwargs = dict(served_model_names=list(served_model_names), api_key=api_key,
                                api_keys=list(api_keys), max_queue_wait=max_queue_wait,
                                model_root=model_root, enable_dashboard=False,
                                max_request_body_bytes=max_request_body_bytes)

    async def drain(self, timeout: float) -> int:
        """``RayEngineClient.drain``: called by ``pagedllm serve --replicas`` on SIGTERM/SIGINT
        before Serve shuts down. Returns the requests still open at the deadline."""
        return await self.client.drain(timeout)

    def __serve_build_asgi_app__(self):
        return build_app(self.client, **self._app_kwargs)

    def __del__(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.shutdown()
