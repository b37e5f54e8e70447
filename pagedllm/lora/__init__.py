"""Multi-LoRA serving: PEFT adapters over one base model, batched in one step (docs/lora.md)."""

from pagedllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
