"""A Hugging Face ``config.json`` as a ``LlamaConfig``: every field that transformers' model reads
is implemented or refused, never ignored.

transformers' modeling code reads the fields its config class declares (``LlamaConfig``,
``Qwen2Config``, ``Qwen3Config``, ``MistralConfig``, ``Phi3Config``, ``Gemma3TextConfig``, ...), plus the older
spellings ``rope_scaling``, ``rope_theta`` and ``torch_dtype`` that it folds into
``rope_parameters`` and ``dtype``. A key no class declares is kept by transformers as an
attribute and never read, so it is ignored here as there. Each declared field is in one of:

- ``INERT_FIELDS``: no effect on what inference computes (training, output plumbing, metadata);
- ``READ_FIELDS``: read into the ``LlamaConfig`` (all families);
- ``FAMILY_FIELDS[model_type]``: read or checked by that family, which refuses with a
  ``ValueError`` naming the field and value any setting it does not implement.

``tests/test_model_families.py`` checks that the three cover every field of the installed
transformers' classes, so a field added by a newer transformers fails a test rather than being
skipped. Absent keys take the values of transformers' class defaults (``FAMILY_DEFAULTS``), as
``from_pretrained`` does.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

from pagedllm.models.llama import LlamaConfig
from pagedllm.models.moe import MoEConfig, moe_layers

INERT_FIELDS = frozenset({
    "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype", "id2label", "label2id",
    "is_encoder_decoder", "model_type", "output_attentions", "output_hidden_states", "problem_type",
    "return_dict", "transformers_version", "use_cache",
    "initializer_range", "attention_dropout", "resid_pdrop", "embd_pdrop",  # training only
    "pad_token_id",  # batches are not padded
    "output_router_logits", "router_aux_loss_coef", "router_jitter_noise",  # MoE training only
    # transformers 4 split each matmul into pretraining_tp slices of the same product (Llama 2's
    # tensor-parallel layout); transformers 5 no longer reads it.
    "pretraining_tp",
})
READ_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
    "bos_token_id", "eos_token_id", "rope_parameters", "rope_scaling", "rope_theta",
})
_QWEN_WINDOW_FIELDS = frozenset({"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"})
FAMILY_FIELDS = {
    "llama": frozenset({"hidden_act", "attention_bias", "mlp_bias"}),
    "qwen2": frozenset({"hidden_act"}) | _QWEN_WINDOW_FIELDS,
    "qwen3": frozenset({"hidden_act", "attention_bias"}) | _QWEN_WINDOW_FIELDS,
    "mistral": frozenset({"hidden_act", "sliding_window"}),
    "phi3": frozenset({"hidden_act", "sliding_window", "original_max_position_embeddings"}),
    # models/gemma3.py: config_from_hf
    "qwen3_moe": frozenset({"hidden_act", "attention_bias", "use_sliding_window", "sliding_window",
                            "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                            "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"}),
    "mixtral": frozenset({"hidden_act", "sliding_window", "num_local_experts", "num_experts_per_tok"}),
    "olmoe": frozenset({"hidden_act", "attention_bias", "clip_qkv", "num_experts", "num_experts_per_tok",
                        "norm_topk_prob"}),
    # models/gemma2.py: config_from_hf
    "gemma2": frozenset({"hidden_activation", "attention_bias", "use_bidirectional_attention",
                         "final_logit_softcapping", "attn_logit_softcapping", "query_pre_attn_scalar",
                         "sliding_window", "layer_types"}),
    "gemma3_text": frozenset({"hidden_activation", "attention_bias", "use_bidirectional_attention",
                              "final_logit_softcapping", "attn_logit_softcapping", "query_pre_attn_scalar",
                              "sliding_window", "layer_types", "_sliding_window_pattern", "sliding_window_pattern",
                              "rope_local_base_freq"}),
}
# transformers' class defaults for the keys a real config.json may leave out and that differ
# between families (``configuration_<family>.py``); the others default as ``LlamaConfig``'s.
FAMILY_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048},
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32},
    "qwen3": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128},
    "mistral": {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8, "sliding_window": 4096},
    "phi3": {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "sliding_window": None},
    "qwen3_moe": {"max_position_embeddings": 32768, "num_key_value_heads": 4, "num_experts": 128,
                  "num_experts_per_tok": 8, "moe_intermediate_size": 768},
    "mixtral": {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
                "sliding_window": None, "num_experts": 8, "num_experts_per_tok": 2},
    "olmoe": {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "num_experts": 64, "num_experts_per_tok": 8},
    "gemma2": {"max_position_embeddings": 8192, "num_key_value_heads": 4, "head_dim": 256},
    "gemma3_text": {"max_position_embeddings": 131072, "num_key_value_heads": 4, "head_dim": 256},
}
DEFAULT_ROPE_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta
PHI3_ORIGINAL_MAX_POSITIONS = 4096  # Phi3Config.original_max_position_embeddings


def _refuse(field: str, value, supported: str) -> None:
    raise ValueError(f"{field}={value!r} is not supported ({supported})")


def rope_from_hf(raw: dict, model_type: str = "llama") -> tuple[float, Optional[dict]]:
    """``(rope_theta, rope_scaling)`` for ``LlamaConfig`` from a ``config.json`` dict, resolved as
    transformers 5 does (``modeling_rope_utils.RotaryEmbeddingConfigMixin``): ``rope_scaling``
    (transformers 4's key, Llama 3.1's config.json) wins over ``rope_parameters``; its
    ``rope_theta`` over the top-level one; ``type`` is the old name of ``rope_type``; llama3's
    ``original_max_position_embeddings`` defaults to ``max_position_embeddings``.

    Phi-3 (``model_type`` ``phi3``) may also use ``longrope`` (``su`` and ``yarn`` are its old
    names there, ``Phi3Config.convert_rope_params_to_dict``) and partial rotary
    (``_phi3_family`` reads it): ``_compute_longrope_parameters``' ``factor`` defaults to
    ``max_position_embeddings / original_max_position_embeddings``, and its
    ``attention_factor`` (multiplying cos and sin) to ``sqrt(1 + ln(factor) / ln(original))``,
    1 for a factor up to 1.

    Returns ``rope_scaling`` None for plain RoPE, else the parameters
    ``llama.rope_inverse_frequencies`` takes.

    Raises:
        ValueError: a ``rope_type`` other than default, linear and llama3 (yarn, dynamic, ...),
            longrope or partial rotary outside phi3, per-layer-type RoPE parameters, or a
            scaled type without its parameters.
    """
    params = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    nested = [key for key, value in params.items() if isinstance(value, dict)]
    if nested:
        _refuse("rope_parameters", {key: params[key] for key in nested}, "one RoPE for all layers")
    if model_type != "phi3":
        for partial in (raw.get("partial_rotary_factor"), params.get("partial_rotary_factor")):
            if partial not in (None, 1, 1.0):
                _refuse("partial_rotary_factor", partial, "RoPE over the whole head only; partial: phi3")
    theta = float(params.get("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if model_type == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"
    if rope_type == "default":
        return theta, None
    if rope_type == "longrope" and model_type == "phi3":
        return theta, _longrope_from_hf(raw, params)
    if rope_type not in ("linear", "llama3"):
        _refuse("rope_type", rope_type, "default, linear, llama3; longrope for phi3")
    needed = ("factor",) if rope_type == "linear" else ("factor", "low_freq_factor", "high_freq_factor")
    missing = [key for key in needed if params.get(key) is None]
    if missing:
        raise ValueError(f"rope_type {rope_type!r} needs {', '.join(missing)} in rope_parameters, got {params}")
    scaling = {"rope_type": rope_type, **{key: float(params[key]) for key in needed}}
    if rope_type == "llama3":
        scaling["original_max_position_embeddings"] = int(params.get(
            "original_max_position_embeddings", raw.get("max_position_embeddings", 2048)))
    return theta, scaling


def _longrope_from_hf(raw: dict, params: dict) -> dict:
    missing = [key for key in ("short_factor", "long_factor") if not params.get(key)]
    if missing:
        raise ValueError(f"rope_type 'longrope' needs {', '.join(missing)} in rope_parameters, got {params}")
    original = int(params.get("original_max_position_embeddings",
                              raw.get("original_max_position_embeddings", PHI3_ORIGINAL_MAX_POSITIONS)))
    factor = params.get("factor")
    if factor is None:
        factor = raw.get("max_position_embeddings", FAMILY_DEFAULTS["phi3"]["max_position_embeddings"]) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"rope_type": "longrope", "short_factor": tuple(float(x) for x in params["short_factor"]),
            "long_factor": tuple(float(x) for x in params["long_factor"]),
            "original_max_position_embeddings": original, "attention_factor": float(attention_factor)}


def _check_hidden_act(raw: dict) -> None:
    if raw.get("hidden_act", "silu") != "silu":
        _refuse("hidden_act", raw["hidden_act"], "silu: the MLP is SwiGLU")


def _check_qwen_window(raw: dict) -> None:
    """Qwen2/Qwen3 slide a window over layers ``max_window_layers`` and up when
    ``use_sliding_window`` is set (HF ``Qwen2Config.__post_init__``); no released checkpoint does."""
    if raw.get("use_sliding_window"):
        _refuse("use_sliding_window", raw["use_sliding_window"], "full attention only")
    windowed = [t for t in raw.get("layer_types") or () if t != "full_attention"]
    if windowed:
        _refuse("layer_types", sorted(set(windowed)), "full_attention only")


def _llama_family(raw: dict, common: dict) -> dict:
    _check_hidden_act(raw)
    bias = bool(raw.get("attention_bias", False))
    return {"attention_bias": bias, "o_proj_bias": bias, "mlp_bias": bool(raw.get("mlp_bias", False))}


def _qwen2_family(raw: dict, common: dict) -> dict:
    _check_hidden_act(raw)
    _check_qwen_window(raw)
    return {"attention_bias": True}  # HF Qwen2Attention: q/k/v always biased, o never


def _qwen3_family(raw: dict, common: dict) -> dict:
    _check_hidden_act(raw)
    _check_qwen_window(raw)
    bias = bool(raw.get("attention_bias", False))
    return {"attention_bias": bias, "o_proj_bias": bias, "qk_norm": True}


def _window(raw: dict, common: dict, model_type: str) -> Optional[int]:
    """A window at least as long as the RoPE table can never cut a sequence short, so it is
    full attention (and keeps the fused decode op)."""
    window = raw.get("sliding_window", FAMILY_DEFAULTS[model_type]["sliding_window"])
    if window is not None and (not isinstance(window, int) or window < 1):
        _refuse("sliding_window", window, "a positive number of tokens or null")
    if window is not None and window >= common["max_position_embeddings"]:
        window = None
    return window


def _mistral_family(raw: dict, common: dict) -> dict:
    _check_hidden_act(raw)
    return {"sliding_window": _window(raw, common, "mistral")}


def _phi3_family(raw: dict, common: dict) -> dict:
    """Phi-3's window is Mistral's (HF ``Phi3Model`` masks with ``sliding_window``: Phi-3-mini-4k
    sets 2047, Phi-3.5-mini 262144, longer than its context); ``partial_rotary_factor`` (in
    ``rope_parameters`` or at the top, Phi-4-mini 0.75) rotates ``int(head_dim * factor)``
    features (HF ``_compute_longrope_parameters``)."""
    _check_hidden_act(raw)
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    partial = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(common["head_dim"] * partial)
    if not 0 < rotary_dim <= common["head_dim"] or rotary_dim % 2:
        _refuse("partial_rotary_factor", partial, f"an even number of features up to head_dim={common['head_dim']}")
    scaling = common["rope_scaling"]
    if scaling is not None and scaling["rope_type"] == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(scaling[key]) != rotary_dim // 2:
                raise ValueError(f"longrope {key} has {len(scaling[key])} factors, a rotary dimension of "
                                 f"{rotary_dim} needs {rotary_dim // 2}")
    return {"sliding_window": _window(raw, common, "phi3"),
            "rotary_dim": None if rotary_dim == common["head_dim"] else rotary_dim}


def _experts(raw: dict, common: dict, model_type: str, moe_intermediate_size: int, normalize: bool) -> dict:
    """The ``MoEConfig`` fields (``num_experts`` is ``num_local_experts`` in some configs)."""
    defaults = FAMILY_DEFAULTS[model_type]
    num_experts = raw.get("num_experts", raw.get("num_local_experts", defaults["num_experts"]))
    top_k = raw.get("num_experts_per_tok", defaults["num_experts_per_tok"])
    if not isinstance(num_experts, int) or num_experts < 1:
        _refuse("num_experts", num_experts, "a positive number of experts; a dense model has its own model_type")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        _refuse("num_experts_per_tok", top_k, f"between 1 and num_experts={num_experts}")
    step = raw.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        _refuse("decoder_sparse_step", step, "a positive integer")
    return {"num_experts": num_experts, "num_experts_per_tok": top_k, "moe_intermediate_size": moe_intermediate_size,
            "norm_topk_prob": normalize,
            "moe_layers": moe_layers(common["num_hidden_layers"], raw.get("mlp_only_layers") or (), step)}


def _qwen3_moe_family(raw: dict, common: dict) -> dict:
    return {**_qwen3_family(raw, common),
            **_experts(raw, common, "qwen3_moe",
                       raw.get("moe_intermediate_size", FAMILY_DEFAULTS["qwen3_moe"]["moe_intermediate_size"]),
                       bool(raw.get("norm_topk_prob", False)))}


def _mixtral_family(raw: dict, common: dict) -> dict:
    """HF ``MixtralTopKRouter`` always renormalizes the top-k probabilities."""
    _check_hidden_act(raw)
    return {"sliding_window": _window(raw, common, "mixtral"),
            **_experts(raw, common, "mixtral", common["intermediate_size"], True)}


def _olmoe_family(raw: dict, common: dict) -> dict:
    """HF ``OlmoeAttention``: ``attention_bias`` on q/k/v and o; the experts are ``intermediate_size``."""
    _check_hidden_act(raw)
    clip = raw.get("clip_qkv")
    if clip is not None and not clip > 0:
        _refuse("clip_qkv", clip, "a positive bound or null")
    bias = bool(raw.get("attention_bias", False))
    return {"attention_bias": bias, "o_proj_bias": bias, "clip_qkv": None if clip is None else float(clip),
            **_experts(raw, common, "olmoe", common["intermediate_size"], bool(raw.get("norm_topk_prob", False)))}


_FAMILY_CONFIG: dict[str, Callable[[dict, dict], dict]] = {
    "llama": _llama_family, "qwen2": _qwen2_family, "qwen3": _qwen3_family, "mistral": _mistral_family,
    "phi3": _phi3_family, "qwen3_moe": _qwen3_moe_family, "mixtral": _mixtral_family, "olmoe": _olmoe_family}
_MOE_FAMILIES = ("qwen3_moe", "mixtral", "olmoe")


def config_from_hf(raw: dict, has_lm_head: bool,
                   family_config: Optional[Callable[[dict, dict], LlamaConfig]] = None) -> LlamaConfig:
    """The ``LlamaConfig`` of a ``config.json`` dict whose ``model_type`` is supported.

    Args:
        raw: the ``config.json`` dict (a GGUF's too: ``models/loader.py`` writes one, with
            ``rope_freq_factors`` from its ``rope_freqs.weight``).
        has_lm_head: whether the checkpoint has ``lm_head.weight``.
        family_config: a model class's ``config_from_hf(raw, common)`` that builds the config
            itself from the common fields (Gemma 3); else the family's own checks here apply.

    Raises:
        ValueError: a field set to what the engine does not implement (see the module
            docstring and ``rope_from_hf``), or an untied config without ``lm_head.weight``
            (transformers would start the head from random weights).
    """
    model_type = raw["model_type"]
    defaults = FAMILY_DEFAULTS.get(model_type, {})
    num_heads = raw["num_attention_heads"]
    rope_theta, rope_scaling = rope_from_hf(raw, model_type) if family_config is None else (None, None)
    tied = bool(raw.get("tie_word_embeddings", model_type in ("gemma2", "gemma3_text")))
    if not tied and not has_lm_head:
        raise ValueError("tie_word_embeddings=false but the checkpoint has no lm_head.weight")
    eos = raw.get("eos_token_id")
    common = dict(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=num_heads,
        # An absent key takes the class default, a null one the value derived from the others.
        num_key_value_heads=raw.get("num_key_value_heads", defaults.get("num_key_value_heads")) or num_heads,
        head_dim=raw.get("head_dim", defaults.get("head_dim")) or raw["hidden_size"] // num_heads,
        rms_norm_eps=raw.get("rms_norm_eps", defaults.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=raw.get("max_position_embeddings", defaults.get("max_position_embeddings", 2048)),
        tie_word_embeddings=tied,
        architecture=model_type,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
    )
    if family_config is not None:
        return family_config(raw, common)
    factors = raw.get("rope_freq_factors")
    common.update(rope_scaling=rope_scaling, rope_freq_factors=None if factors is None else tuple(factors))
    config_class = MoEConfig if model_type in _MOE_FAMILIES else LlamaConfig
    return config_class(**common, **_FAMILY_CONFIG[model_type](raw, common))
