"""``load_format="dummy"`` (vLLM's name, ``vllm/model_executor/model_loader/dummy_loader.py``):
a model built from a ``config.json`` alone, with random weights of the shapes the real
checkpoint has, so that a 7B-class model can be timed without its weights on disk.

The weights go through the same path as a real checkpoint's (``build_model``:
``load_hf_state_dict``, each layer quantized as it loads when ``quantization`` is set, then
packing), so the built model's tensors, dtypes and quantized layouts are those of the real one
(``tests/test_dummy_weights.py`` compares them). Each tensor is drawn only when the model
reads it, directly in the compute dtype, so building an 8B model in bf16 holds the model and
one tensor, not a second fp32 copy of the checkpoint (quantized: the quantized model and one
layer in float).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from pagedllm.models.hf_config import config_from_hf
from pagedllm.models.llama import LlamaConfig
from pagedllm.models.moe import MoEConfig

# Half-width of the uniform draw: the standard deviation of transformers' initializer_range
# (0.02) is 0.0346 / sqrt(3); a realistic activation scale, unlike vLLM's 1e-3.
DUMMY_WEIGHT_RANGE = 0.0346
# Elements drawn from one generator: a tensor is drawn in pieces of this many, each from its own
# generator, by torch's threads at once (one generator's uniform_ runs on one thread; on 2 cores
# a w4a8 SmolLM2-1.7B builds in 12.2-12.7 s against 15.1-15.4 with one generator per tensor,
# Zen 4). The pieces keep the values independent of the thread count.
DRAW_PIECE_ELEMENTS = 1 << 22
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def dummy_config_file(model: str) -> Path:
    """The ``config.json`` that ``load_format="dummy"`` builds ``model`` from: ``model`` itself
    (any ``.json`` file) or ``model/config.json``.

    Raises:
        ValueError: neither exists (a GGUF file has no ``config.json``: give its converted
            folder, or a config from ``bench/configs/``).
    """
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.suffix != ".json" or not path.is_file():
        raise ValueError(f"load_format='dummy' builds the model from a config.json: {model!r} is neither a "
                         ".json file nor a folder holding config.json (see bench/configs/)")
    return path


def hf_weight_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a Hugging Face checkpoint of ``config`` holds, by name, with its shape
    (``[out_features, in_features]`` for a projection): what ``load_hf_state_dict`` of the
    family's model class reads, as transformers' ``save_pretrained`` names them (Phi-3's fused
    ``qkv_proj``/``gate_up_proj``, a MoE layer's router and experts in place of its MLP). No
    ``lm_head.weight`` when the embeddings are tied."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    gemma = config.architecture in ("gemma2", "gemma3_text")  # four norms per layer
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes.update({p + "self_attn.o_proj.weight": (h, q),
                       p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        if config.architecture == "phi3":  # fused projections in the checkpoint
            shapes[p + "self_attn.qkv_proj.weight"] = (q + 2 * kv, h)
        else:
            shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                           p + "self_attn.v_proj.weight": (kv, h)})
        if isinstance(config, MoEConfig) and config.moe_layers[layer]:
            shapes.update(_expert_shapes(config, p))
        elif config.architecture == "phi3":
            shapes.update({p + "mlp.gate_up_proj.weight": (2 * i, h), p + "mlp.down_proj.weight": (h, i)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                           p + "mlp.down_proj.weight": (h, i)})
        if config.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if config.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if config.mlp_bias:
            shapes.update({p + "mlp.gate_proj.bias": (i,), p + "mlp.up_proj.bias": (i,), p + "mlp.down_proj.bias": (h,)})
        if config.architecture == "olmoe":  # normed across heads
            shapes.update({p + "self_attn.q_norm.weight": (q,), p + "self_attn.k_norm.weight": (kv,)})
        elif config.qk_norm or config.architecture == "gemma3_text":
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        if gemma:
            shapes.update({p + "pre_feedforward_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,)})
    return shapes


def _expert_shapes(config: MoEConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """A MoE layer's router and experts, under its family's checkpoint names (``moe.py``)."""
    from pagedllm.models.loader import MODEL_CLASSES

    model_class = MODEL_CLASSES[config.architecture]
    block = prefix + model_class.moe_block_name + "."
    gate, up, down = model_class.expert_weight_names
    h, i = config.hidden_size, config.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {block + "gate.weight": (config.num_experts, h)}
    for expert in range(config.num_experts):
        p = f"{block}experts.{expert}."
        shapes.update({p + gate + ".weight": (i, h), p + up + ".weight": (i, h), p + down + ".weight": (h, i)})
    return shapes


class DummyStateDict(Mapping):
    """A read-only ``{Hugging Face name: tensor}`` whose tensors are drawn when read.

    Norm weights are ones (transformers' initialization); every other tensor is uniform in
    ``[-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE)``, drawn in ``dtype``, each piece of
    ``DRAW_PIECE_ELEMENTS`` from a generator seeded by ``seed``, the name and the piece's
    index, so that reading a name twice, on another tensor-parallel rank or with another
    number of threads, gives the same tensor.
    """

    def __init__(self, config: LlamaConfig, dtype: torch.dtype, seed: int = 0) -> None:
        self.shapes = hf_weight_shapes(config)
        self.dtype = dtype
        self.seed = seed

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=self.dtype)
        tensor = torch.empty(shape, dtype=self.dtype)
        pieces = tensor.view(-1).split(DRAW_PIECE_ELEMENTS)

        def draw(index: int) -> None:
            generator = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{name}:{index}".encode()))
            pieces[index].uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=generator)

        workers = min(len(pieces), torch.get_num_threads())
        if workers <= 1:
            for index in range(len(pieces)):
                draw(index)
        else:
            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(draw, range(len(pieces))))
        return tensor

    def __contains__(self, name: object) -> bool:
        # Mapping's own __contains__ reads the item, which would draw the tensor (the loader
        # asks `name in state_dict` before it reads a name: every weight drawn twice).
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def load_dummy_checkpoint(model: str, dtype: torch.dtype, seed: int = 0) -> tuple[LlamaConfig, DummyStateDict]:
    """The architecture read from ``model``'s ``config.json`` (``dummy_config_file``) and a
    ``DummyStateDict`` of its weights in ``dtype``.

    Raises:
        ValueError: no such config, a ``model_type`` without a model class, or a field the
            engine does not implement (as for a real checkpoint, ``config_from_hf``); a config
            with ``quantization_config`` (its integer layout comes from the checkpoint's files).
    """
    from pagedllm.models.loader import MODEL_CLASSES, SUPPORTED_ARCHITECTURES

    raw = json.loads(dummy_config_file(model).read_text())
    model_type = raw.get("model_type")
    if model_type not in MODEL_CLASSES:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {SUPPORTED_ARCHITECTURES})")
    if "quantization_config" in raw:
        raise ValueError("load_format='dummy' with a quantization_config (AWQ/GPTQ/compressed-tensors) is not "
                         "supported: remove it and pass quantization='int4'/'int8' for the same weight bytes")
    tied = bool(raw.get("tie_word_embeddings", model_type == "gemma3_text"))
    config = config_from_hf(raw, not tied, getattr(MODEL_CLASSES[model_type], "config_from_hf", None))
    return config, DummyStateDict(config, dtype, seed)


def load_dummy_tokenizer(model: str):
    """The tokenizer beside ``model``'s ``config.json`` when its folder has one, else None
    (a bare config: prompts are token ids)."""
    folder = dummy_config_file(model).parent
    if not any((folder / name).exists() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))
