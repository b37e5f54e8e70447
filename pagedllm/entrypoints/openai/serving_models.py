"""The models a server answers for: the base model's names and the LoRA adapters loaded on it
(vLLM ``vllm/entrypoints/openai/serving_models.py``).

A request picks an adapter by putting its name in ``model``; ``/v1/models`` lists the adapters
with ``parent`` set to the base model; ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (vLLM's names and bodies, served with
``--allow-runtime-lora-updating``) change the set while the server runs. An API key with
``lora_adapters`` sees and uses only those adapters (and the base model): any other adapter
is unknown to it (404, as an unknown model), so a key cannot learn which others exist.
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.openai.api_keys import APIKey
from pagedllm.entrypoints.openai.errors import OpenAIError, to_openai_error
from pagedllm.lora.request import LoRARequest


class OpenAIServingModels:
    """The base model's served names and the loaded adapters, owned by the event loop thread.

    Args:
        engine: the engine client (adapters are loaded through it, on the engine thread).
        served_model_names: the base model's names; the first is every adapter's ``parent``.
        model_root: the base model's ``root`` in ``/v1/models``.
        lora_requests: adapters loaded already (``--lora-modules``, loaded when the engine was
            built).

    Attributes:
        lora_requests: name -> ``LoRARequest``; ids are handed out from 1 and never reused, so
            the prefix cache never gives an adapter loaded again under a name the KV of the
            one unloaded before.
    """

    def __init__(self, engine: EngineClient, served_model_names: Sequence[str], model_root: str,
                 lora_requests: Sequence[LoRARequest] = ()) -> None:
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self.model_root = model_root
        self.lora_requests = {request.lora_name: request for request in lora_requests}
        self._ids = itertools.count(max((r.lora_int_id for r in lora_requests), default=0) + 1)

    @property
    def lora_enabled(self) -> bool:
        return self.engine.model_info.max_loras > 0

    def _visible(self, name: str, key: Optional[APIKey]) -> bool:
        return key is None or key.lora_adapters is None or name in key.lora_adapters

    def resolve(self, model: Optional[str], key: Optional[APIKey] = None) -> Optional[LoRARequest]:
        """The adapter a request's ``model`` names, or None for the base model (or no ``model``).

        Raises:
            OpenAIError 404: a name that is neither a base model name nor an adapter ``key``
                may use.
        """
        if model is None or model in self.served_model_names:
            return None
        lora_request = self.lora_requests.get(model)
        if lora_request is None or not self._visible(model, key):
            names = self.served_model_names + [n for n in self.lora_requests if self._visible(n, key)]
            raise OpenAIError(404, f"The model `{model}` does not exist; this server serves {names}",
                              "NotFoundError", "model")
        return lora_request

    def list_models(self, created: int, key: Optional[APIKey] = None) -> list[dict]:
        """``/v1/models`` entries: the base model's names, then the adapters ``key`` may use."""
        max_model_len = self.engine.model_info.max_model_len
        base = [{"id": name, "object": "model", "created": created, "owned_by": "pagedllm",
                 "root": self.model_root, "parent": None, "max_model_len": max_model_len}
                for name in self.served_model_names]
        return base + [{"id": name, "object": "model", "created": created, "owned_by": "pagedllm",
                        "root": request.lora_path, "parent": self.served_model_names[0],
                        "max_model_len": max_model_len}
                       for name, request in self.lora_requests.items() if self._visible(name, key)]

    async def load_lora_adapter(self, lora_name: str, lora_path: str, load_inplace: bool = False) -> str:
        """Load an adapter under ``lora_name`` (vLLM's ``/v1/load_lora_adapter``). With
        ``load_inplace`` an adapter already of that name is replaced: the new one gets a new id
        (so no prefix-cache block of the old one is hit), and requests running with the old
        one finish with it.

        Raises:
            OpenAIError 400: LoRA is off, the name is the base model's, or an adapter's without
                ``load_inplace``, or the engine refuses the adapter (its message: DoRA, rank,
                missing files, ...; a refused replacement leaves the old adapter in place).
        """
        if not self.lora_enabled:
            raise OpenAIError(400, "LoRA is off: start the server with --enable-lora", param="lora_name")
        if lora_name in self.served_model_names:
            raise OpenAIError(400, f"'{lora_name}' is the base model's name, not an adapter's.", param="lora_name")
        old = self.lora_requests.get(lora_name)
        if old is not None and not load_inplace:
            raise OpenAIError(400, f"The lora adapter '{lora_name}' has already been loaded "
                                   "(load_inplace: true replaces it).", param="lora_name")
        lora_request = LoRARequest(lora_name, next(self._ids), lora_path)
        try:
            await self.engine.add_lora(lora_request)
        except Exception as exc:  # noqa: BLE001 - ValueError -> 400, engine errors as elsewhere
            raise to_openai_error(exc) from exc
        self.lora_requests[lora_name] = lora_request
        if old is not None:
            await self.engine.remove_lora(old.lora_int_id)
            return f"Success: LoRA adapter '{lora_name}' replaced successfully."
        return f"Success: LoRA adapter '{lora_name}' added successfully."

    async def unload_lora_adapter(self, lora_name: str) -> str:
        """Unload an adapter (vLLM's ``/v1/unload_lora_adapter``); requests running with it
        finish with it.

        Raises:
            OpenAIError 404: no adapter of that name.
        """
        lora_request = self.lora_requests.pop(lora_name, None)
        if lora_request is None:
            raise OpenAIError(404, f"The lora adapter '{lora_name}' cannot be found.", "NotFoundError",
                              "lora_name")
        await self.engine.remove_lora(lora_request.lora_int_id)
        return f"Success: LoRA adapter '{lora_name}' removed successfully."
