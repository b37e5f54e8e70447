"""A PEFT LoRA adapter read from disk and checked against the base model (vLLM
``vllm/lora/models.py: LoRAModel.from_local_checkpoint``).

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", section 4.1): a
target linear layer ``y = x W^T`` becomes ``y = x W^T + scaling * (x A^T) B^T`` with ``A``
``[r, in]``, ``B`` ``[out, r]``; ``scaling = lora_alpha / r``, or ``lora_alpha / sqrt(r)``
with rsLoRA (Kalajdzievski 2023, ``use_rslora``), as PEFT's ``LoraLayer.update_layer``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedllm.models.llama import LlamaConfig

# The projections of a Llama-family decoder layer that an adapter may target, under their HF names.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# PEFT's saved names: ``base_model.model.<HF module path>.lora_A.weight``.
_TENSOR_NAME = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                          r"(" + "|".join(TARGET_MODULES) + r")\.lora_([AB])\.weight$")

# adapter_config.json options (PEFT 0.21) that change what the adapted layer computes, or where
# its weights live, in ways the engine does not implement; refused when set.
_REFUSED_OPTIONS = ("alpha_pattern", "layer_replication", "target_parameters", "trainable_token_indices",
                    "fan_in_fan_out", "alora_invocation_tokens", "use_qalora", "use_bdlora", "velora_config",
                    "monteclora_config", "arrow_config", "kasa_config")

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


@dataclass
class LoRALayerWeights:
    """One target module of one decoder layer.

    Attributes:
        lora_a: ``[rank, in_features]`` (fp32, as read).
        lora_b: ``[out_features, rank]``.
        scaling: the factor of ``(x A^T) B^T``.
    """

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


def module_shapes(config: "LlamaConfig") -> dict[str, tuple[int, int]]:
    """``module -> (in_features, out_features)`` of each target module of ``config``'s layers."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def check_peft_config(peft_config: dict, max_lora_rank: int) -> None:
    """Refuse what an ``adapter_config.json`` asks for that the engine does not compute.

    Raises:
        ValueError: not a LoRA adapter; DoRA (``use_dora``); ``modules_to_save`` (whole layers
            saved beside the adapter); trained biases (``bias`` other than ``"none"``,
            ``lora_bias``); ``alpha_pattern``, ``layer_replication``, ``target_parameters``,
            ``trainable_token_indices``, ``fan_in_fan_out``; ``r`` above ``max_lora_rank``.
    """
    peft_type = peft_config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"peft_type {peft_type!r} is not supported: only LoRA adapters (peft_type 'LORA')")
    if peft_config.get("use_dora"):
        raise ValueError("DoRA adapters (use_dora=true) are not supported: only plain LoRA")
    if peft_config.get("modules_to_save"):
        raise ValueError(f"adapters with modules_to_save ({peft_config['modules_to_save']}) are not supported: "
                         "only LoRA weights of q/k/v/o and gate/up/down")
    if peft_config.get("bias", "none") != "none" or peft_config.get("lora_bias"):
        raise ValueError(f"adapters with trained biases (bias={peft_config.get('bias')!r}, "
                         f"lora_bias={peft_config.get('lora_bias')!r}) are not supported")
    for option in _REFUSED_OPTIONS:
        if peft_config.get(option):
            raise ValueError(f"adapters with {option}={peft_config[option]!r} are not supported")
    rank = peft_config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"adapter_config.json: r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise ValueError(f"the adapter's rank r={rank} exceeds max_lora_rank={max_lora_rank}: "
                         "raise max_lora_rank (--max-lora-rank)")


class LoRAModel:
    """An adapter's weights per ``(layer_index, module)``, checked against the base model.

    Attributes:
        lora_int_id: the id of the ``LoRARequest`` it was loaded for.
        loras: ``(layer_index, module name)`` -> ``LoRALayerWeights``; modules the adapter does
            not target are absent.
    """

    def __init__(self, lora_int_id: int, loras: dict[tuple[int, str], LoRALayerWeights]) -> None:
        self.lora_int_id = lora_int_id
        self.loras = loras

    @property
    def rank(self) -> int:
        """The largest rank of its modules."""
        return max(weights.rank for weights in self.loras.values())

    def num_bytes(self) -> int:
        return sum(w.lora_a.nbytes + w.lora_b.nbytes for w in self.loras.values())

    @classmethod
    def from_local_checkpoint(cls, path: str, lora_int_id: int, config: "LlamaConfig",
                              max_lora_rank: int) -> "LoRAModel":
        """Read ``adapter_config.json`` and ``adapter_model.safetensors`` from the folder ``path``.

        Each module's rank is its tensors' (so a ``rank_pattern`` is honoured), its scaling
        ``lora_alpha / r`` (``/ sqrt(r)`` under ``use_rslora``).

        Raises:
            ValueError: a missing folder or file; a weights file safetensors cannot read (truncated,
                not safetensors); what ``check_peft_config`` refuses (named with the adapter's
                path); a module whose tensors' rank is not ``r`` where no ``rank_pattern`` is set; a tensor
                that is not the ``lora_A``/``lora_B`` weight of a target module (embeddings, the
                LM head, other layers); a layer index or shape the base model does not have; a
                module with only one of its two tensors; a module rank above ``max_lora_rank``.
        """
        from safetensors.torch import load_file

        folder = Path(path)
        config_path, weights_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
        if not config_path.is_file():
            raise ValueError(f"LoRA adapter {path!r}: no {CONFIG_NAME} there")
        if not weights_path.is_file():
            raise ValueError(f"LoRA adapter {path!r}: no {WEIGHTS_NAME} there (only safetensors adapters are read)")
        try:
            peft_config = json.loads(config_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"LoRA adapter {path!r}: {CONFIG_NAME} is not readable JSON: {exc}") from None
        try:
            check_peft_config(peft_config, max_lora_rank)
        except ValueError as exc:
            raise ValueError(f"LoRA adapter {path!r}: {exc}") from None
        alpha = peft_config.get("lora_alpha", peft_config["r"])
        use_rslora = bool(peft_config.get("use_rslora"))
        shapes = module_shapes(config)
        tensors: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        try:
            state_dict = load_file(str(weights_path))
        except Exception as exc:  # safetensors raises its own SafetensorError (and OSError) on a bad file
            raise ValueError(f"LoRA adapter {path!r}: {WEIGHTS_NAME} is not a readable safetensors file: "
                             f"{exc}") from None
        for name, tensor in state_dict.items():
            match = _TENSOR_NAME.match(name)
            if match is None:
                raise ValueError(f"LoRA adapter {path!r}: tensor {name!r} is not the lora_A/lora_B weight of a "
                                 f"decoder layer's {', '.join(TARGET_MODULES)}: not supported")
            layer, module, which = int(match[1]), match[2], match[3]
            if layer >= config.num_hidden_layers:
                raise ValueError(f"LoRA adapter {path!r}: tensor {name!r} is for layer {layer}, the base model has "
                                 f"{config.num_hidden_layers} layers")
            tensors.setdefault((layer, module), {})[which] = tensor
        loras = {}
        for (layer, module), pair in sorted(tensors.items()):
            if set(pair) != {"A", "B"}:
                raise ValueError(f"LoRA adapter {path!r}: layer {layer} {module} has lora_{''.join(pair)} only")
            lora_a, lora_b = pair["A"].float(), pair["B"].float()
            in_features, out_features = shapes[module]
            rank = lora_a.shape[0]
            if (lora_a.dim() != 2 or lora_b.dim() != 2 or tuple(lora_a.shape) != (rank, in_features)
                    or tuple(lora_b.shape) != (out_features, rank)):
                raise ValueError(f"LoRA adapter {path!r}: layer {layer} {module} has lora_A {tuple(lora_a.shape)} "
                                 f"and lora_B {tuple(lora_b.shape)}; the base model needs ({rank}, {in_features}) "
                                 f"and ({out_features}, {rank})")
            if not peft_config.get("rank_pattern") and rank != peft_config["r"]:
                # PEFT would not load it (its modules are built with rank r), and the scaling
                # lora_alpha / r would not be the one it was trained with.
                raise ValueError(f"LoRA adapter {path!r}: layer {layer} {module} has rank {rank} but "
                                 f"{CONFIG_NAME} says r={peft_config['r']} (and no rank_pattern)")
            if rank > max_lora_rank:
                raise ValueError(f"LoRA adapter {path!r}: layer {layer} {module} has rank {rank}, above "
                                 f"max_lora_rank={max_lora_rank}")
            scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
            loras[(layer, module)] = LoRALayerWeights(lora_a.contiguous(), lora_b.contiguous(), scaling)
        if not loras:
            raise ValueError(f"LoRA adapter {path!r}: {WEIGHTS_NAME} holds no LoRA weights")
        return cls(lora_int_id, loras)
