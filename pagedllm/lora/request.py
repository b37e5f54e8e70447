"""``LoRARequest``: which adapter a request runs with (vLLM ``vllm/lora/request.py``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter, named and numbered by the caller.

    Attributes:
        lora_name: the adapter's name (the OpenAI ``model`` that selects it on the server).
        lora_int_id: its number, unique per adapter, >= 1 (0 means "no adapter", as in vLLM). The
            engine knows an adapter by this number: the prefix cache keys blocks by it, and the
            LRU of loaded adapters holds it.
        lora_path: a folder with ``adapter_config.json`` and ``adapter_model.safetensors``.

    Raises:
        ValueError: an empty name or path, or an id that is not an integer >= 1.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def int_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
