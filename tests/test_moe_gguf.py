"""Mixture-of-experts GGUF files (Qwen3-MoE, Mixtral, OLMoE), written as llama.cpp's converter
writes them (convert_hf_to_gguf.py ``Qwen3MoeModel``, ``LlamaModel`` for Mixtral, ``OlmoeModel``:
each layer's experts stacked in one ``blk.N.ffn_{gate,up,down}_exps.weight``), against Hugging
Face transformers fp32.

Each file goes through the loader's whole conversion (``model_folder``), tokenizer included: a
byte-level BPE vocabulary of the 256 bytes (``tokenizer.ggml.model`` ``gpt2``), which
transformers converts for ``qwen3moe`` and ``llama`` but refuses for ``olmoe`` (the loader copies
the keys into a ``llama`` file for it). The expert tensors are stored as F16 (gate), BF16 (up)
and Q8_0 (down), the rest F32. The
reference model's experts are those values (each weight rounded through the type and back), so
the comparison is as exact as the HF-folder one: greedy tokens equal and prompt logprobs within
``LOGPROB_TOL`` (1e-4, tests/test_model_families.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.models.loader import _read_gguf, build_model, load_checkpoint, load_tokenizer
from pagedllm.models.moe import SparseMoeBlock
from tests.test_model_families import VOCAB, assert_parity, random_prompts, save_tiny_hf, write_gguf
from tests.test_moe import FAMILIES

GGUF_ARCHITECTURES = {"qwen3_moe": "qwen3moe", "mixtral": "llama", "olmoe": "olmoe"}


def expert_types():
    import gguf

    return {"ffn_gate_exps": gguf.GGMLQuantizationType.F16, "ffn_up_exps": gguf.GGMLQuantizationType.BF16,
            "ffn_down_exps": gguf.GGMLQuantizationType.Q8_0}


def byte_vocabulary() -> list[str]:
    """GPT-2's byte-level alphabet: token ``i`` is byte ``i``."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return list(bytes_to_unicode().values())


def moe_metadata(family: str, config) -> dict:
    """The expert keys llama.cpp's converter writes for ``family`` (``TextModel`` and the family's
    ``set_gguf_parameters``); OLMoE's ``clip_qkv`` as ``attention.clamp_kqv``."""
    metadata = {"add_expert_count": config.num_experts if family != "mixtral" else config.num_local_experts,
                "add_expert_used_count": config.num_experts_per_tok}
    if family == "qwen3_moe":
        metadata["add_expert_feed_forward_length"] = config.moe_intermediate_size
    if getattr(config, "clip_qkv", None) is not None:
        metadata["add_clamp_kqv"] = config.clip_qkv
    return metadata


def write_moe_gguf(family: str, tmp_path):
    """A tiny random ``family`` model whose experts are rounded through ``expert_types()``, saved
    as a Hugging Face folder and written as a GGUF; returns the transformers model (fp32, loaded
    back from the folder) and the GGUF's path."""
    import gguf
    import transformers
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "hf"
    save_tiny_hf(family, folder, **FAMILIES[family])
    state_dict = load_file(str(folder / "model.safetensors"))
    suffixes = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps", "w3": "ffn_up_exps",
                "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}
    for name, tensor in state_dict.items():
        if ".experts." in name:
            qtype = expert_types()[suffixes[name.split(".")[-2]]]
            rounded = gguf.quants.dequantize(gguf.quants.quantize(tensor.numpy(), qtype), qtype)
            state_dict[name] = torch.from_numpy(np.array(rounded.reshape(tensor.shape), dtype=np.float32))
    save_file(state_dict, str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    config = hf.config
    tensor_types = {f"blk.{i}.{kind}.weight": qtype for i in range(config.num_hidden_layers)
                    for kind, qtype in expert_types().items()}
    assert config.vocab_size == VOCAB == 256
    tokenizer = {"add_tokenizer_model": "gpt2", "add_tokenizer_pre": "default", "add_token_list": byte_vocabulary(),
                 "add_token_types": [1] * VOCAB, "add_token_scores": [0.0] * VOCAB, "add_eos_token_id": 0}
    path = tmp_path / "m.gguf"
    write_gguf(path, GGUF_ARCHITECTURES[family], hf, {**moe_metadata(family, config), **tokenizer},
               state_dict=state_dict, tensor_types=tensor_types)
    return hf, path


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_gguf_equals_transformers(family, tmp_path, monkeypatch):
    import gguf

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    hf, path = write_moe_gguf(family, tmp_path)
    assert {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors if "_exps" in t.name} == {
        "F16", "BF16", "Q8_0"}
    config, state_dict = load_checkpoint(path)
    assert load_tokenizer(path)("hello").input_ids == [byte_vocabulary().index(c) for c in "hello"]
    overrides = FAMILIES[family]
    assert (config.architecture, config.num_experts, config.num_experts_per_tok) == (
        family, overrides.get("num_experts", overrides.get("num_local_experts")), overrides["num_experts_per_tok"])
    # llama.cpp's graph renormalizes for qwen3moe and llama (Mixtral), not for olmoe, as these models' configs.
    assert config.norm_topk_prob == (family != "olmoe")
    assert config.moe_layers == ((False, True) if family == "qwen3_moe" else (True, True))
    assert config.clip_qkv == overrides.get("clip_qkv")
    model = build_model(config, state_dict, torch.float32)
    assert sum(isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers) == sum(config.moe_layers)
    assert_parity(hf, model, random_prompts(30, 4))


def test_moe_gguf_router_metadata(tmp_path):
    """``expert_weights_norm`` overrides llama.cpp's per-architecture default (the file states
    ``norm_topk_prob``); a router llama.cpp would scale or gate otherwise, or shared experts, are
    refused by name; Mixtral layers without experts, and ``clamp_kqv`` outside OLMoE, are refused."""
    import gguf

    _SIGMOID = gguf.ExpertGatingFuncType.SIGMOID
    hf = save_tiny_hf("qwen3_moe", tmp_path, **{**FAMILIES["qwen3_moe"], "num_hidden_layers": 1,
                                                "mlp_only_layers": []})
    base = moe_metadata("qwen3_moe", hf.config)
    write_gguf(tmp_path / "m.gguf", "qwen3moe", hf, {**base, "add_expert_weights_norm": False},
               state_dict=_saved(tmp_path))
    raw, state_dict, _ = _read_gguf(tmp_path / "m.gguf")
    assert (raw["norm_topk_prob"], raw["mlp_only_layers"], raw["moe_intermediate_size"]) == (False, [], 32)
    assert state_dict["model.layers.0.mlp.experts.7.down_proj.weight"].shape == (64, 32)
    for key, value, message in (("add_expert_weights_scale", 2.5, "qwen3moe.expert_weights_scale=2.5"),
                                ("add_expert_shared_count", 1, "qwen3moe.expert_shared_count=1"),
                                ("add_expert_gating_func", _SIGMOID, "qwen3moe.expert_gating_func=2")):
        write_gguf(tmp_path / "bad.gguf", "qwen3moe", hf, {**base, key: value}, state_dict=_saved(tmp_path))
        with pytest.raises(ValueError, match=message):
            _read_gguf(tmp_path / "bad.gguf")
    dense = save_tiny_hf("llama", tmp_path / "llama", num_hidden_layers=1)
    write_gguf(tmp_path / "dense.gguf", "llama", dense, {"add_expert_count": 4, "add_expert_used_count": 2})
    with pytest.raises(ValueError, match=r"llama.expert_count=4: layers \[0\] have no experts"):
        _read_gguf(tmp_path / "dense.gguf")
    # Clipping q/k/v is OLMoE's only (ignored, before, for every architecture).
    write_gguf(tmp_path / "dense.gguf", "llama", dense, {"add_clamp_kqv": 8.0})
    with pytest.raises(ValueError, match=r"llama.attention.clamp_kqv=8.0 is not supported"):
        _read_gguf(tmp_path / "dense.gguf")


def _saved(tmp_path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(tmp_path / "model.safetensors"))
