"""Gemma 2 decoder (Gemma 2 2B/9B/27B): Gemma 3's layer (``models/gemma3.py``: four norms per
layer, ``1 + weight`` RMSNorm, GELU-tanh MLP, embedding times ``sqrt(hidden_size)``,
``query_pre_attn_scalar``, local and global layers) without q/k norms, with soft-capping.

Hugging Face ``modeling_gemma2.py`` against ``modeling_gemma3.py``:

- attention scores are soft-capped, ``c * tanh(s / c)`` with ``c = attn_logit_softcapping``
  (50), before the mask and the softmax; the C++ attention kernels do not cap, so every
  attention of a capped model runs the torch formulation (``layers/attention.py:
  attention_softcapped``), chosen once when the model is built and logged then;
- the logits are soft-capped too, ``final_logit_softcapping`` (30);
- layers alternate local (sliding window, 4096) and global, local first (``layer_types``);
  both use one RoPE base, ``rope_theta``;
- no q/k norms.

Decode runs the Python layers, as Gemma 3's. Tensor parallelism: refused.
"""

from __future__ import annotations

from typing import Callable

from pagedllm.models.gemma3 import FULL, SLIDING, Gemma3Config, Gemma3ForCausalLM


def gemma2_layer_types(num_layers: int) -> list[str]:
    """Local, global, local, ... (HF ``Gemma2Config``'s default; llama.cpp's swa pattern 2)."""
    return [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """The Gemma 2 decoder: ``Gemma3ForCausalLM`` over a ``Gemma3Config`` with ``qk_norm``
    False, the RoPE base of both layer types ``rope_theta``, and the two soft-caps.

    Raises:
        ValueError: as ``Gemma3ForCausalLM``.
    """

    family_name = "Gemma 2"
    # GGUF tensor names (after ``blk.N.``) that differ from Llama's meaning (llama.cpp's
    # convert_hf_to_gguf.py ``Gemma2Model``; norms stored plus one, as Gemma 3's).
    gguf_layer_names = {
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    }

    @staticmethod
    def complete_hf_config(raw: dict, field: Callable[[str, object], object]) -> None:
        """Turn the loader's Llama-style ``config.json`` dict for a GGUF file into a
        ``Gemma2Config`` one, in place (``field(key, default)`` reads ``gemma2.<key>``): the
        window and both soft-caps are in the file; ``query_pre_attn_scalar`` is not, and is
        what llama.cpp's ``llm_build_gemma2`` assumes (``head_dim``, except for the 27B model,
        whose 46 layers use ``hidden_size / num_heads``)."""
        num_layers = raw["num_hidden_layers"]
        scalar = raw["hidden_size"] // raw["num_attention_heads"] if num_layers == 46 else raw["head_dim"]
        raw.update({
            "sliding_window": int(field("attention.sliding_window", 4096)),
            "layer_types": gemma2_layer_types(num_layers),
            "query_pre_attn_scalar": scalar,
            "hidden_activation": "gelu_pytorch_tanh",
            "attn_logit_softcapping": field("attn_logit_softcapping", None),
            "final_logit_softcapping": field("final_logit_softcapping", None),
        })

    gguf_tensor_to_hf = Gemma3ForCausalLM.gguf_tensor_to_hf

    @staticmethod
    def config_from_hf(raw: dict, common: dict) -> Gemma3Config:
        """A ``Gemma3Config`` for Gemma 2 from a ``config.json`` dict (``model_type`` ``gemma2``)
        and the loader's Llama fields ``common``.

        Raises:
            ValueError: an activation other than GELU-tanh, scaled RoPE, biases
                (``attention_bias``), bidirectional attention, a non-positive cap or window, or
                ``layer_types`` naming something else than the two attention types.
        """
        for key in ("attention_bias", "use_bidirectional_attention"):
            if raw.get(key):
                raise ValueError(f"{key}={raw[key]!r} is not supported (Gemma 2 decoders have neither)")
        activation = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        if activation != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation {activation!r} is not supported (gelu_pytorch_tanh only)")
        rope = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"rope_parameters={rope} is not supported (default RoPE only)")
        caps = {}
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = raw.get(key, 50.0 if key.startswith("attn") else 30.0)
            if value is not None and not value > 0:
                raise ValueError(f"{key}={value!r} is not supported (a positive cap or null)")
            caps[key] = None if value is None else float(value)
        window = raw.get("sliding_window", 4096)
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"sliding_window={window!r} is not supported (a positive number of tokens)")
        theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        return Gemma3Config(
            **{**common, "rope_theta": theta, "sliding_window": window, "qk_norm": False,
               "tie_word_embeddings": raw.get("tie_word_embeddings", True) or common["tie_word_embeddings"]},
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
            layer_types=tuple(raw.get("layer_types") or gemma2_layer_types(raw["num_hidden_layers"])),
            rope_local_base_freq=theta,
            **caps,
        )
