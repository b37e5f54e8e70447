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

import dataclasses
import logging
from typing import Any, Optional, Sequence

from ray import serve

from pagedllm.entrypoints.openai.api_keys import APIKey
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.cli_args import ServerArgs
from pagedllm.serve_ray.engine_client import RayEngineClient

logger = logging.getLogger(__name__)


@serve.ingress()
class OpenAIIngress:
    """Args:
        engine: handle of the ``EngineReplica`` deployment.
        server_args: the server's options (``build_app``'s; the dashboard is off: the
            replicas' block pools are not at hand; ``request_timeout`` is the replicas', which
            overload protection reads).
        api_keys: every key, loaded where the application was built.
        app_name, engine_deployment: where the replicas are (their reports).
        model_root: as ``build_app``.
    """

    async def __init__(self, engine: Any, server_args: ServerArgs, api_keys: Sequence[APIKey], app_name: str,
                       engine_deployment: str, model_root: Optional[str] = None) -> None:
        model_info = await engine.model_info.remote()
        self.server_args = dataclasses.replace(server_args, disable_dashboard=True)
        self.api_keys = list(api_keys)
        self.model_root = model_root
        self.client = RayEngineClient(engine, model_info, self.server_args.served_model_names(model_info.model)[0],
                                      app_name, engine_deployment, request_timeout=server_args.request_timeout)
        self.client.start()

    async def drain(self, timeout: float) -> int:
        """``RayEngineClient.drain``: called by ``pagedllm serve --replicas`` on SIGTERM/SIGINT
        before Serve shuts down. Returns the requests still open at the deadline."""
        return await self.client.drain(timeout)

    def __serve_build_asgi_app__(self):
        return build_app(self.client, self.server_args, self.api_keys, model_root=self.model_root)

    def __del__(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.shutdown()
