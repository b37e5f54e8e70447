"""Phi-3 decoder (Phi-3-mini, Phi-3.5-mini, Phi-4-mini): the Llama architecture whose checkpoint
stores Q/K/V as one ``qkv_proj`` and gate/up as one ``gate_up_proj``, with LongRoPE scaling and,
in Phi-4-mini, partial rotary.

Hugging Face ``modeling_phi3.py`` differs from ``modeling_llama.py`` in those (and in dropout,
which inference does not run): the fused weights are what the engine's layers hold anyway, so
they are split into Llama's names on loading and fused again by ``LlamaForCausalLM``; RoPE
(``longrope``, LongRoPE, Ding et al. 2024) divides each frequency by a per-frequency factor,
``short_factor`` or ``long_factor``, and multiplies cos and sin by ``attention_factor``
(``models/llama.py: rope_inverse_frequencies``); ``partial_rotary_factor`` rotates only the
first part of each head (``LlamaConfig.rotary_dim``, ``layers/ops.py``).

Short or long factors: transformers picks per forward call (long once the call's longest
position passes ``original_max_position_embeddings``), so a sequence's cached keys were
rotated with the short factors and its later queries with the long ones; and it changes with
how a prompt is cut into chunks. Here the choice is made once, when the engine knows its
``max_model_len``: long factors when it exceeds ``original_max_position_embeddings``, as vLLM
(``Phi3LongRoPEScaledRotaryEmbedding``: ``use_long_rope``) and llama.cpp (``n_ctx >
n_ctx_orig``) do, so every token of every sequence is rotated alike, which recompute after
preemption and prefix caching need. It equals transformers' output for a prompt longer than
the original context (long factors there throughout), and for any sequence when the engine's
``max_model_len`` is at most the original context (short throughout).

Decode runs the fused C++ decode op unless partial rotary (the op rotates whole heads) or a
sliding window (Phi-3-mini-4k's 2047) says otherwise. Tensor parallelism: refused
(``models/sharding.py`` lists the families it splits).
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from pagedllm.layers.quantization import Int4Weight, get_quant_method
from pagedllm.models.llama import LlamaConfig, LlamaForCausalLM
from pagedllm.models.sharding import TensorParallelShard


class Phi3ForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` for Phi-3 checkpoints (HF names, with
    ``model.layers.N.self_attn.qkv_proj.weight`` and ``model.layers.N.mlp.gate_up_proj.weight``).

    Raises:
        ValueError: a checkpoint quantized by AWQ/GPTQ/llm-compressor (its fused layers'
            integer weights are not split), or what ``LlamaForCausalLM`` refuses.
    """

    # GGUF tensor names (after ``blk.N.``) that differ from Llama's (llama.cpp's
    # ``LLM_ARCH_PHI3``): the fused projections, under the names HF's checkpoint uses. The
    # rows are stored as HF's: llama.cpp rotates Phi-3 with NEOX RoPE, HF's "rotate half".
    gguf_layer_names = {
        "attn_qkv.weight": "self_attn.qkv_proj.weight",
        "ffn_up.weight": "mlp.gate_up_proj.weight",
    }

    def __init__(self, config: LlamaConfig, dtype: torch.dtype = torch.float32,
                 quantization: Optional[str] = None, tp: TensorParallelShard = TensorParallelShard()) -> None:
        if quantization is not None and get_quant_method(quantization).from_checkpoint:
            raise ValueError(f"quantization={quantization!r} is not supported for Phi-3 (its fused qkv_proj "
                             "and gate_up_proj would need splitting); use int8, int4 or w8a8 on the float model")
        super().__init__(config, dtype, quantization, tp)

    def set_max_model_len(self, max_model_len: int) -> None:
        """Choose longrope's factors for an engine whose sequences reach ``max_model_len``
        tokens: the long ones when that exceeds ``original_max_position_embeddings`` (see the
        module docstring). Without longrope scaling, nothing to choose.

        Raises:
            ValueError: ``max_model_len`` < 1.
        """
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        scaling = self.config.rope_scaling
        if scaling is None or scaling["rope_type"] != "longrope":
            return
        self.rotary.use_long_factors(max_model_len > scaling["original_max_position_embeddings"])

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor],
                           on_layer_loaded: Optional[Callable[[int], None]] = None) -> None:
        """As ``LlamaForCausalLM.load_hf_state_dict``, from Phi-3's fused names (or Llama's).

        Raises:
            ValueError: a tensor is missing or has the wrong shape.
        """
        c = self.config
        super().load_hf_state_dict(split_fused_weights(state_dict, c.num_attention_heads * c.head_dim,
                                                       c.num_key_value_heads * c.head_dim, c.intermediate_size),
                                    on_layer_loaded)

    @staticmethod
    def gguf_int4_to_hf(weights: dict[str, Int4Weight], raw: dict) -> dict[str, Int4Weight]:
        """A GGUF's 4-bit weights (``loader.load_prequantized_int4``) under the split names
        ``quantize_model`` looks up (``raw``: the converted ``config.json`` dict)."""
        head_dim = raw["head_dim"]
        return split_fused_weights(weights, raw["num_attention_heads"] * head_dim,
                                   raw["num_key_value_heads"] * head_dim, raw["intermediate_size"])

    @staticmethod
    def complete_hf_config(raw: dict, field) -> None:
        """Turn the loader's Llama-style ``config.json`` dict for a GGUF file into a Phi-3 one,
        in place (``field(key, default)`` reads ``phi3.<key>``): llama.cpp's
        ``rope.dimension_count`` is the rotated width, ``rope.scaling.original_context_length``
        the original context, ``rope.scaling.attn_factor`` the attention factor, and
        ``attention.sliding_window`` 0 for none (convert_hf_to_gguf.py ``Phi3MiniModel``). The
        ``rope_factors_long``/``_short`` tensors are added by the loader as
        ``rope_long_factor``/``rope_short_factor``; ``finish_hf_config`` turns them into
        ``rope_parameters``.
        """
        raw["partial_rotary_factor"] = int(field("rope.dimension_count", raw["head_dim"])) / raw["head_dim"]
        raw["original_max_position_embeddings"] = int(field("rope.scaling.original_context_length",
                                                            raw["max_position_embeddings"]))
        raw["sliding_window"] = int(field("attention.sliding_window", 0)) or None
        attn_factor = field("rope.scaling.attn_factor", None)
        if attn_factor is not None:
            raw["rope_attention_factor"] = float(attn_factor)

    @staticmethod
    def finish_hf_config(raw: dict) -> None:
        """After the GGUF's tensors are read: its longrope factors (``rope_long_factor`` and
        ``rope_short_factor``, set by the loader) as HF ``rope_parameters``."""
        long_factor, short_factor = raw.pop("rope_long_factor", None), raw.pop("rope_short_factor", None)
        attention_factor = raw.pop("rope_attention_factor", None)
        if long_factor is None and short_factor is None:
            return
        if long_factor is None or short_factor is None:
            raise ValueError("GGUF phi3 has only one of rope_factors_long / rope_factors_short")
        raw["rope_parameters"] = {"rope_type": "longrope", "rope_theta": raw.pop("rope_theta"),
                                  "long_factor": long_factor, "short_factor": short_factor,
                                  "original_max_position_embeddings": raw["original_max_position_embeddings"],
                                  "partial_rotary_factor": raw["partial_rotary_factor"]}
        if attention_factor is not None:
            raw["rope_parameters"]["attention_factor"] = attention_factor


def split_fused_weights(weights: dict[str, Union[torch.Tensor, Int4Weight]], q_size: int, kv_size: int,
                        intermediate_size: int) -> dict[str, Union[torch.Tensor, Int4Weight]]:
    """``weights`` with every ``qkv_proj.weight`` split by rows into ``{q,k,v}_proj.weight``
    (``q_size``, ``kv_size``, ``kv_size`` rows) and every ``gate_up_proj.weight`` into
    ``{gate,up}_proj.weight`` (``intermediate_size`` rows each); a new dict of views. Works on
    fp32 tensors and on ``Int4Weight`` codes alike (a GGUF's 4-bit tensors).

    Raises:
        ValueError: a fused weight whose rows are not those sizes' sum.
    """
    out = {}
    for name, weight in weights.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            prefix, sizes = name[:-len("qkv_proj.weight")], {"q": q_size, "k": kv_size, "v": kv_size}
        elif name.endswith("mlp.gate_up_proj.weight"):
            prefix, sizes = name[:-len("gate_up_proj.weight")], {"gate": intermediate_size, "up": intermediate_size}
        else:
            out[name] = weight
            continue
        num_rows = (weight if isinstance(weight, torch.Tensor) else weight.codes).shape[0]
        if num_rows != sum(sizes.values()):
            raise ValueError(f"weight {name!r}: expected {sum(sizes.values())} rows, got {num_rows}")
        start = 0
        for part, rows in sizes.items():
            out[f"{prefix}{part}_proj.weight"] = _rows(weight, slice(start, start + rows))
            start += rows
    return out


def _rows(weight: Union[torch.Tensor, Int4Weight], rows: slice) -> Union[torch.Tensor, Int4Weight]:
    if isinstance(weight, torch.Tensor):
        return weight[rows]
    return Int4Weight(weight.codes[rows], weight.scales[rows], weight.mins[rows], weight.input_order)
