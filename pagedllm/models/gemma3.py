"""Gemma 3 decoder, text only (Gemma 3 270M/1B; the text tower of the larger ones).

Computes what Hugging Face ``transformers`` ``models/gemma3/modeling_gemma3.py``
(``Gemma3ForCausalLM``) computes, in the same fp32 arithmetic; the layout follows vLLM's
``model_executor/models/gemma3.py`` (fused QKV and gate/up projections). Against Llama:

- the embedding is multiplied by ``sqrt(hidden_size)``, rounded to the compute dtype first;
- RMSNorm scales by ``1 + weight`` and rounds after the scaling (``GemmaRMSNorm``);
- q and k are RMS-normed per head before RoPE, and the softmax scale is
  ``query_pre_attn_scalar ** -0.5`` rather than ``head_dim ** -0.5``;
- each sub-layer's output is RMS-normed again before it joins the residual stream (four norms
  per layer: input, post-attention, pre-feedforward, post-feedforward);
- the MLP is GELU (tanh approximation) gated, not SiLU gated;
- layers alternate between sliding-window ("local", RoPE base ``rope_local_base_freq``) and full
  ("global", RoPE base ``rope_theta``) attention, five local to one global by default
  (``layer_types``); local layers attend to the last ``sliding_window`` positions only
  (``layers/attention.py``);
- the LM head is tied to the embedding (262k tokens).

Decode runs the Python layers: the fused C++ decode op (``layers/fused_decode.py``,
``csrc/decoder_layer.cpp``) implements the Llama layer op for op, and Gemma's extra norms,
GELU and windowed attention would need a second op list there. For the 270M model the matrix
products dominate a single-stream step anyway (92 % of its CPU time in ``_linear_pointwise``,
bf16, measured under load): the tied 262k-row LM head alone is 335 MB of bf16 weights read per
step, against 200 MB for all 18 layers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.attention import AttentionMetadata, paged_attention
from pagedllm.layers.linear import Linear
from pagedllm.layers.ops import rotary_embedding_
from pagedllm.models.llama import LlamaConfig, LlamaForCausalLM, RotaryEmbedding
from pagedllm.models.sharding import TensorParallelShard

logger = logging.getLogger(__name__)

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass
class Gemma3Config(LlamaConfig):
    """``LlamaConfig`` plus Gemma 3's hyper-parameters (Hugging Face ``Gemma3TextConfig`` names).

    ``rope_theta`` is the global layers' RoPE base; ``layer_types[i]`` is ``"sliding_attention"``
    or ``"full_attention"``; ``sliding_window`` counts tokens, the current one included.
    ``qk_norm`` (Gemma 3: True) norms q and k per head; ``attn_logit_softcapping`` and
    ``final_logit_softcapping`` (Gemma 2; None: no cap) soft-cap the attention scores and the
    logits, ``c * tanh(x / c)``.
    """

    query_pre_attn_scalar: float = 256.0
    sliding_window: int = 4096
    layer_types: tuple[str, ...] = ()
    rope_local_base_freq: float = 10000.0
    attn_logit_softcapping: Optional[float] = None
    final_logit_softcapping: Optional[float] = None


def default_layer_types(num_layers: int, pattern: int = 6) -> list[str]:
    """Every ``pattern``-th layer global, the others local (HF ``Gemma3TextConfig``'s default)."""
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]


class GemmaRMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * (1 + weight)`` in fp32, then rounded to ``x``'s dtype (HF
    ``Gemma3RMSNorm``: the scaling happens before the rounding, unlike Llama's).

    ``forward(x)``: ``[..., dim]`` -> same shape and dtype.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(nn.Module):
    def __init__(self, config: Gemma3Config, layer_type: str) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = config.query_pre_attn_scalar ** -0.5
        self.sliding_window = config.sliding_window if layer_type == SLIDING else None
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.logit_softcap = config.attn_logit_softcapping
        if config.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, positions, hidden, kv_cache, metadata, rotary):
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if self.q_norm is not None:
            # Per-head norms written back into the fused rows, which RoPE then rotates in place.
            q, k = qkv[:, :self.q_size], qkv[:, self.q_size:self.q_size + self.kv_size]
            q.copy_(self.q_norm(q.reshape(-1, self.head_dim)).view(num_tokens, self.q_size))
            k.copy_(self.k_norm(k.reshape(-1, self.head_dim)).view(num_tokens, self.kv_size))
        rotary_embedding_(qkv, positions, rotary.cos, rotary.sin, self.num_heads, self.num_kv_heads,
                          self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        out = paged_attention(q.view(num_tokens, self.num_heads, self.head_dim),
                              k.view(num_tokens, self.num_kv_heads, self.head_dim),
                              v.view(num_tokens, self.num_kv_heads, self.head_dim),
                              kv_cache[0], kv_cache[1], metadata, self.scale, self.sliding_window,
                              self.logit_softcap)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class Gemma3MLP(nn.Module):
    def __init__(self, config: Gemma3Config) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Gemma3Config, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.self_attn = Gemma3Attention(config, layer_type)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.mlp = Gemma3MLP(config)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, positions, hidden, kv_cache, metadata, rotary):
        """``hidden``: the residual stream ``[num_tokens, hidden_size]``; returns the next one."""
        attn = self.self_attn(positions, self.input_layernorm(hidden), kv_cache, metadata, rotary)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """The Gemma 3 text decoder; weights, packing, quantization and logits as
    ``LlamaForCausalLM`` (same module names), forward its own.

    Args:
        config: a ``Gemma3Config``.
        dtype, quantization: as ``LlamaForCausalLM``.

    Attributes:
        fused_decode: None (see the module docstring).
        rotary, rotary_local: RoPE tables of the global and the local layers.

    Raises:
        ValueError: ``layer_types`` does not name every layer, or names an unknown type;
            ``tp.size > 1`` (no tensor parallelism for this family).
    """

    family_name = "Gemma 3"
    # GGUF tensor names (after ``blk.N.``) that differ from Llama's meaning (llama.cpp's
    # convert_hf_to_gguf.py ``Gemma3Model``), and the extra ones.
    gguf_layer_names = {
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
    }

    def __init__(self, config: Gemma3Config, dtype: torch.dtype = torch.float32,
                 quantization: Optional[str] = None, tp: TensorParallelShard = TensorParallelShard()) -> None:
        nn.Module.__init__(self)
        if tp.size != 1:
            # Its layers are not sharded (models/sharding.py splits Llama-shaped layers only).
            raise ValueError(f"{self.family_name} runs with tensor_parallel_size=1 only, got {tp.size}")
        self.tp = tp
        layer_types = tuple(config.layer_types) or tuple(default_layer_types(config.num_hidden_layers))
        if len(layer_types) != config.num_hidden_layers or set(layer_types) - {SLIDING, FULL}:
            raise ValueError(f"layer_types must give {SLIDING!r} or {FULL!r} for each of the "
                             f"{config.num_hidden_layers} layers, got {layer_types}")
        self.config = config
        self.dtype = dtype
        self.quantization = quantization
        self.unquantized_weight_bytes: Optional[int] = None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, t) for t in layer_types)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.rotary_local = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                            config.rope_local_base_freq)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.fused_decode = None
        self.lora_context = None
        self.requires_grad_(False)
        if config.attn_logit_softcapping is not None:
            logger.info("attention logit soft-capping (%s): attention runs the torch formulation, decode and "
                        "prefill (the C++ attention kernels do not cap)", config.attn_logit_softcapping)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """As ``LlamaForCausalLM.compute_logits``, soft-capped by ``final_logit_softcapping``
        where the config sets it (Gemma 2: ``c * tanh(logits / c)``, HF ``Gemma2ForCausalLM``)."""
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                metadata: AttentionMetadata) -> torch.Tensor:
        """As ``LlamaForCausalLM.forward``: ``[num_tokens]`` ids and positions ->
        ``[num_tokens, hidden_size]`` final-normed hidden states."""
        hidden, _ = self.embed(input_ids)
        for index, kv_cache in enumerate(kv_caches):
            hidden, _ = self.run_layer(index, positions, hidden, None, kv_cache, metadata)
        return self.norm(hidden)

    def embed(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, None]:
        """As ``LlamaForCausalLM.embed``, scaled by ``sqrt(hidden_size)``."""
        # HF multiplies by the scale as a tensor of the weights' dtype (sqrt(640) in bf16 is 25.25).
        normalizer = torch.tensor(self.config.hidden_size ** 0.5, dtype=self.dtype)
        return self.embed_tokens(input_ids) * normalizer, None

    def run_layer(self, index, positions, hidden, residual, kv_cache, metadata):
        """As ``LlamaForCausalLM.run_layer``; ``hidden`` is the whole residual stream (the
        residual is always None), and local layers take the local RoPE table."""
        layer = self.layers[index]
        rotary = self.rotary_local if layer.layer_type == SLIDING else self.rotary
        return layer(positions, hidden, kv_cache, metadata, rotary), None

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor],
                           on_layer_loaded: Optional[Callable[[int], None]] = None) -> None:
        """As ``LlamaForCausalLM.load_hf_state_dict``, plus the pre/post-feedforward norms and
        the q/k norms (HF names, e.g. ``model.layers.0.self_attn.q_norm.weight``).

        Raises:
            ValueError: a tensor is missing or has the wrong shape.
        """
        def load_norms(i: int) -> None:
            layer = self.layers[i]
            p = f"model.layers.{i}."
            norms = [("pre_feedforward_layernorm", layer.pre_feedforward_layernorm),
                     ("post_feedforward_layernorm", layer.post_feedforward_layernorm)]
            if layer.self_attn.q_norm is not None:
                norms += [("self_attn.q_norm", layer.self_attn.q_norm), ("self_attn.k_norm", layer.self_attn.k_norm)]
            for name, norm in norms:
                key = p + name + ".weight"
                if key not in state_dict:
                    raise ValueError(f"weight {key!r} missing from the checkpoint")
                if tuple(state_dict[key].shape) != tuple(norm.weight.shape):
                    raise ValueError(f"weight {key!r}: expected shape {tuple(norm.weight.shape)}, "
                                     f"got {tuple(state_dict[key].shape)}")
                norm.weight = nn.Parameter(state_dict[key].to(self.dtype).contiguous(), requires_grad=False)

        def layer_loaded(i: int) -> None:
            load_norms(i)  # before the callback: the w8a8 calibration runs the whole layer there
            if on_layer_loaded is not None:
                on_layer_loaded(i)

        super().load_hf_state_dict(state_dict, layer_loaded)

    @staticmethod
    def complete_hf_config(raw: dict, field: Callable[[str, object], object]) -> None:
        """Turn the loader's Llama-style ``config.json`` dict for a GGUF file into a
        ``Gemma3TextConfig`` one, in place. ``field(key, default)`` reads ``gemma3.<key>``.

        The GGUF states the global RoPE base and the window; the local base (10,000), the
        one-in-six global layers and ``query_pre_attn_scalar`` are not in the file, and are
        what llama.cpp's ``llm_build_gemma3`` assumes too (the scalar is ``head_dim``, except
        for the 27B model, whose 62 layers use ``hidden_size / num_heads``).
        """
        num_layers = raw["num_hidden_layers"]
        scalar = raw["hidden_size"] // raw["num_attention_heads"] if num_layers == 62 else raw["head_dim"]
        raw.update({
            "rope_parameters": {FULL: {"rope_type": "default", "rope_theta": raw.pop("rope_theta")},
                                SLIDING: {"rope_type": "default", "rope_theta": 10000.0}},
            "sliding_window": int(field("attention.sliding_window", 4096)),
            "layer_types": default_layer_types(num_layers),
            "query_pre_attn_scalar": scalar,
            "hidden_activation": "gelu_pytorch_tanh",
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
        })

    @staticmethod
    def gguf_tensor_to_hf(name: str, array: np.ndarray) -> np.ndarray:
        """llama.cpp stores Gemma's norm weights plus one (ggml multiplies by the weight); HF
        (and this model) add the one at run time (as transformers' ``Gemma2TensorProcessor``)."""
        return array - 1 if name.endswith("norm.weight") else array

    @staticmethod
    def config_from_hf(raw: dict, common: dict) -> Gemma3Config:
        """A ``Gemma3Config`` from a ``config.json`` dict (``model_type`` ``gemma3_text``) and the
        loader's Llama fields ``common``.

        Raises:
            ValueError: logit soft-capping (Gemma 2), an activation other than GELU-tanh,
                scaled RoPE (Gemma 3 4B-27B's global layers), biases (``attention_bias``:
                HF puts them on q/k/v and o) or bidirectional attention (EmbeddingGemma).
        """
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if raw.get(key) is not None:
                raise ValueError(f"{key}={raw[key]} is not supported (Gemma 3 has none)")
        for key in ("attention_bias", "use_bidirectional_attention"):
            if raw.get(key):
                raise ValueError(f"{key}={raw[key]!r} is not supported (Gemma 3 text decoders have neither)")
        activation = raw.get("hidden_activation", "gelu_pytorch_tanh")
        if activation != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation {activation!r} is not supported (gelu_pytorch_tanh only)")
        if raw.get("rope_scaling") is not None:
            raise ValueError(f"rope_scaling={raw['rope_scaling']} is not supported (default RoPE only; "
                             "the 4B-27B models scale it)")
        rope = raw.get("rope_parameters") or {}
        for layer_type in (FULL, SLIDING):
            if (rope.get(layer_type) or {}).get("rope_type", "default") != "default":
                raise ValueError(f"{layer_type} rope_type {rope[layer_type]['rope_type']!r} is not supported "
                                 "(default RoPE only; the 4B-27B models scale it)")
        num_layers = raw["num_hidden_layers"]
        pattern = raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6))
        return Gemma3Config(
            **{**common,
               "rope_theta": float((rope.get(FULL) or {}).get("rope_theta", raw.get("rope_theta", 1_000_000.0))),
               "tie_word_embeddings": raw.get("tie_word_embeddings", True) or common["tie_word_embeddings"],
               "sliding_window": int(raw.get("sliding_window") or 4096), "qk_norm": True},
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
            layer_types=tuple(raw.get("layer_types") or default_layer_types(num_layers, pattern)),
            rope_local_base_freq=float((rope.get(SLIDING) or {}).get(
                "rope_theta", raw.get("rope_local_base_freq", 10000.0))),
        )
