"""PEFT adapters for the LoRA tests, and greedy decoding of HF transformers + PEFT (the reference).

Adapters get random nonzero A and B (PEFT initializes B to zero, which would make them no-ops).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch


def make_adapter(hf_model, path: Path, rank: int, seed: int, target_modules: list[str], lora_alpha: int = 16,
                 use_rslora: bool = False, scale: float = 0.1, **config_kwargs):
    """Put a LoRA with random A/B on ``hf_model`` (in place), save it under ``path`` and return the
    ``PeftModel`` (call ``.unload()`` on it to get the base model back)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=lora_alpha, target_modules=target_modules, use_rslora=use_rslora,
                        lora_dropout=0.0, **config_kwargs)
    peft_model = get_peft_model(hf_model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    peft_model.save_pretrained(str(path))
    return peft_model.eval()


@torch.inference_mode()
def hf_greedy(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding, EOS ignored, over HF's forward and KV cache (as tests/test_parity.py)."""
    out = hf_model(input_ids=torch.tensor([prompt]), use_cache=True)
    tokens = []
    for _ in range(max_tokens):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = hf_model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def adapters_and_references(hf_model, root: Path, specs: list[dict], prompts: list[list[int]],
                            max_tokens: int) -> tuple[list[Path], list[Optional[list[list[int]]]]]:
    """Save one adapter per spec (``make_adapter`` keyword arguments) under ``root`` and compute
    HF + PEFT greedy tokens of every prompt under each, then under the base model (last).

    Returns:
        ``(paths, references)``: ``references[i][j]`` for adapter ``i`` and prompt ``j``;
        ``references[-1]`` is the base model's.
    """
    paths, references = [], []
    for index, spec in enumerate(specs):
        path = root / f"adapter{index}"
        peft_model = make_adapter(hf_model, path, **spec)
        references.append([hf_greedy(peft_model, prompt, max_tokens) for prompt in prompts])
        hf_model = peft_model.unload()
        paths.append(path)
    references.append([hf_greedy(hf_model, prompt, max_tokens) for prompt in prompts])
    return paths, references
