"""Llama 3.x RoPE scaling, Qwen3 and Mistral against Hugging Face transformers, and the audit of
config fields (``models/hf_config.py``): every field transformers' model reads is implemented or
refused with a ``ValueError`` naming it.

Each parity test builds a tiny random model with transformers, saves it, loads it through
pagedllm's loader, and compares fp32 greedy tokens (equal) and prompt logprobs (within
``LOGPROB_TOL``) with native ops on and off.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.layers import ops
from pagedllm.models.hf_config import FAMILY_FIELDS, INERT_FIELDS, READ_FIELDS, config_from_hf
from pagedllm.models.llama import rope_inverse_frequencies
from pagedllm.models.loader import MODEL_CLASSES, build_model, load_checkpoint
from pagedllm.sampling_params import SamplingParams
from tests.conftest import run_to_completion
from tests.gguf_writer import GGUF_GLOBAL_NAMES, hf_metadata, write_gguf_file

VOCAB = 256
MAX_TOKENS = 8
# fp32 against fp32; the two sum in other orders (fused QKV, paged attention): measured up to
# 3e-5 over a 700-token prompt.
LOGPROB_TOL = 1e-4
# A Llama 3.x GGUF states llama.cpp's frequency divisors, not HF's parameters: its frequencies
# differ from HF's by an ulp or so, its angles by up to 1.5e-5 at position 900, and prompt
# logprobs by up to 2.1e-4 (measured, 700 tokens).
GGUF_LLAMA3_LOGPROB_TOL = 1e-3
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=1024, bos_token_id=None,
            eos_token_id=None, pad_token_id=None)


def hf_config_class(model_type: str):
    import transformers

    return {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
            "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig,
            "phi3": transformers.Phi3Config, "gemma2": transformers.Gemma2Config,
            "gemma3_text": transformers.Gemma3TextConfig, "mixtral": transformers.MixtralConfig,
            "qwen3_moe": transformers.Qwen3MoeConfig, "olmoe": transformers.OlmoeConfig}[model_type]


def save_tiny_hf(model_type: str, folder, embed_std: float = 1.0, **overrides):
    """A random transformers model of ``model_type`` (weights wide enough that attention is sharp
    and logits are not flat), saved to ``folder``; returns it. ``embed_std``: the embedding's
    (a tied head with std 1 gives logits in the tens, whose fp32 rounding alone is ~1e-4)."""
    import transformers

    model_class = {"llama": transformers.LlamaForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
                   "mistral": transformers.MistralForCausalLM, "phi3": transformers.Phi3ForCausalLM,
                   "gemma2": transformers.Gemma2ForCausalLM, "mixtral": transformers.MixtralForCausalLM,
                   "qwen3_moe": transformers.Qwen3MoeForCausalLM,
                   "olmoe": transformers.OlmoeForCausalLM}[model_type]
    torch.manual_seed(0)
    hf = model_class(hf_config_class(model_type)(**{**TINY, **overrides})).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0, embed_std if "embed" in name else 0.3)
    hf.save_pretrained(str(folder))
    return hf


@torch.inference_mode()
def hf_reference(hf, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens (EOS ignored) and the prompt's logprobs (of tokens 1..n-1) from transformers."""
    logits = hf(torch.tensor([prompt])).logits[0]
    logprobs = torch.log_softmax(logits[:-1].double(), -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    # An explicit mask: else generate masks every prompt token equal to pad_token_id.
    generated = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                            max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return generated[0, len(prompt):].tolist(), logprobs.tolist()


def pagedllm_run(model, prompts: list[list[int]], max_model_len: int = 1024,
                 max_num_batched_tokens: int = 1024) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and prompt logprobs from pagedllm; a ``max_num_batched_tokens`` below a
    prompt's length prefills it in chunks over its cached prefix."""
    engine = LLMEngine(EngineArgs.from_kwargs(dtype="float32", block_size=16, num_gpu_blocks_override=128,
                                              max_model_len=max_model_len,
                                              max_num_batched_tokens=max_num_batched_tokens,
                                              max_num_seqs=min(256, max_num_batched_tokens)),
                       model=model, tokenizer=None)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=0)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", {"prompt_token_ids": prompt}, params)
    finals = run_to_completion(engine)
    return [(finals[f"p{i}"].outputs[0].token_ids,
             [next(iter(d.values())).logprob for d in finals[f"p{i}"].prompt_logprobs[1:]])
            for i in range(len(prompts))]


@pytest.fixture(params=[True, False], ids=["native", "torch"])
def native(request, monkeypatch):
    """Runs the test with the C++ ops, then with their torch twins (``PAGEDLLM_NATIVE_OPS=0``)."""
    monkeypatch.setenv("PAGEDLLM_NATIVE_OPS", "1" if request.param else "0")
    ops.native_ops.cache_clear()
    assert (ops.native_ops() is not None) == request.param
    yield request.param
    monkeypatch.delenv("PAGEDLLM_NATIVE_OPS")
    ops.native_ops.cache_clear()


def assert_parity(hf, model, prompts: list[list[int]], logprob_tol: float = LOGPROB_TOL,
                  max_model_len: int = 1024, max_num_batched_tokens: int = 1024) -> None:
    for prompt, (tokens, logprobs) in zip(prompts, pagedllm_run(model, prompts, max_model_len,
                                                                max_num_batched_tokens)):
        expected_tokens, expected_logprobs = hf_reference(hf, prompt)
        assert tokens == expected_tokens
        torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.float64),
                                   torch.tensor(expected_logprobs, dtype=torch.float64), rtol=0, atol=logprob_tol)


def random_prompts(*lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


# ------------------------------------------------------------------------------ Llama 3.x RoPE
@pytest.fixture(scope="module")
def tiny_llama3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama3")
    hf = save_tiny_hf("llama", folder, rope_parameters={**LLAMA3_ROPE, "rope_theta": 10000.0})
    config, state_dict = load_checkpoint(folder)
    return hf, build_model(config, state_dict, torch.float32)


def test_llama3_rope_frequencies_are_transformers(tiny_llama3):
    """Bitwise HF's inverse frequencies, and (with original_max_position_embeddings 64 and
    head_dim 16) some kept, some interpolated, most divided by the factor."""
    hf, model = tiny_llama3
    assert model.config.rope_scaling == LLAMA3_ROPE
    ours = rope_inverse_frequencies(16, 10000.0, model.config.rope_scaling)
    assert torch.equal(ours, hf.model.rotary_emb.inv_freq)
    plain = rope_inverse_frequencies(16, 10000.0)
    assert ours[0] == plain[0] and torch.equal(ours[3:], plain[3:] / 8) and (ours[1:3] < plain[1:3]).all()


def test_llama3_greedy_and_prompt_logprobs_equal_transformers(tiny_llama3, native):
    """700 tokens, ten times the 'original' context: the scaled frequencies decide the output."""
    hf, model = tiny_llama3
    assert_parity(hf, model, random_prompts(700, 5))


def test_llama3_config_of_transformers_4_reads_rope_scaling(tmp_path):
    """Llama 3.1's config.json (transformers 4): ``rope_scaling`` with ``rope_theta`` at the top."""
    raw = {**TINY, "model_type": "llama", "rope_theta": 500000.0, "rope_scaling": {**LLAMA3_ROPE},
           "rope_parameters": {"rope_type": "default", "rope_theta": 1.0}}
    config = config_from_hf(raw, has_lm_head=True)
    assert (config.rope_theta, config.rope_scaling) == (500000.0, LLAMA3_ROPE)
    raw["rope_scaling"] = {"type": "linear", "factor": 2.0}
    assert config_from_hf(raw, True).rope_scaling == {"rope_type": "linear", "factor": 2.0}


# ------------------------------------------------------------------------------ Qwen3, Mistral
def test_qwen3_equals_transformers(tmp_path, native):
    """q/k norms per head, head_dim 32 against hidden_size / heads = 16."""
    hf = save_tiny_hf("qwen3", tmp_path, head_dim=32, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    config, state_dict = load_checkpoint(tmp_path)
    assert (config.architecture, config.qk_norm, config.head_dim, config.attention_bias) == ("qwen3", True, 32, False)
    model = build_model(config, state_dict, torch.float32)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.fused_decode is not None
    assert_parity(hf, model, random_prompts(40, 3))


def test_mistral_sliding_window_equals_transformers(tmp_path, native):
    """A window of 16 tokens under a 100-token prompt: prefill and decode both cut by it."""
    hf = save_tiny_hf("mistral", tmp_path, sliding_window=16)
    config, state_dict = load_checkpoint(tmp_path)
    assert (config.architecture, config.sliding_window) == ("mistral", 16)
    model = build_model(config, state_dict, torch.float32)
    assert type(model).__name__ == "MistralForCausalLM"
    assert_parity(hf, model, random_prompts(100, 7))


def test_mistral_without_window_is_full_attention(tmp_path):
    """Mistral v0.2 and later: ``sliding_window: null``; a window no shorter than the RoPE
    table is full attention as well, and both keep the fused decode op. An absent key is
    transformers' default, 4096."""
    raw = {**TINY, "model_type": "mistral", "sliding_window": None}
    config = config_from_hf(raw, True)
    assert config.sliding_window is None
    assert MODEL_CLASSES["mistral"](config).fused_decode is not None
    assert config_from_hf({**raw, "sliding_window": 1024}, True).sliding_window is None
    absent = {k: v for k, v in raw.items() if k != "sliding_window"}
    assert config_from_hf({**absent, "max_position_embeddings": 8192}, True).sliding_window == 4096


# ------------------------------------------------------------------------------ the audit
@pytest.mark.parametrize("model_type", sorted(MODEL_CLASSES))
def test_every_transformers_config_field_is_handled(model_type):
    """Each field the installed transformers' config class declares is read, checked, or inert."""
    fields = set(hf_config_class(model_type)().to_dict())
    unhandled = fields - INERT_FIELDS - READ_FIELDS - FAMILY_FIELDS[model_type]
    assert not unhandled, f"{model_type}: transformers reads {sorted(unhandled)}; pagedllm neither reads nor refuses"


REFUSED = [
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type='yarn'"),
    ("llama", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
    ("qwen3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type='longrope'"),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "needs low_freq_factor"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("mistral", {"hidden_act": "relu"}, "hidden_act='relu'"),
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window=True"),
    ("qwen3", {"use_sliding_window": True}, "use_sliding_window=True"),
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types="),
    ("mistral", {"sliding_window": 0}, "sliding_window=0"),
    ("llama", {"tie_word_embeddings": False, "_no_lm_head": True}, "tie_word_embeddings=false"),
]


@pytest.mark.parametrize("model_type,overrides,message", REFUSED, ids=[m for _, _, m in REFUSED])
def test_unimplemented_config_fields_are_refused(model_type, overrides, message):
    raw = {**hf_config_class(model_type)(**TINY).to_dict(), **overrides}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        config_from_hf(raw, has_lm_head=not raw.pop("_no_lm_head", False))


def test_gemma3_biases_and_bidirectional_attention_are_refused():
    base = hf_config_class("gemma3_text")(**TINY).to_dict()
    for key in ("attention_bias", "use_bidirectional_attention"):
        with pytest.raises(ValueError, match=f"{key}=True"):
            config_from_hf({**base, key: True}, True, MODEL_CLASSES["gemma3_text"].config_from_hf)


def test_llama_biases_everywhere_equal_transformers(tmp_path):
    """HF Llama's ``attention_bias`` biases o_proj as well as q/k/v, ``mlp_bias`` gate/up/down;
    both were silently dropped before (no o/MLP bias was loaded)."""
    hf = save_tiny_hf("llama", tmp_path, attention_bias=True, mlp_bias=True)
    config, state_dict = load_checkpoint(tmp_path)
    assert (config.attention_bias, config.o_proj_bias, config.mlp_bias) == (True, True, True)
    model = build_model(config, state_dict, torch.float32)
    assert_parity(hf, model, random_prompts(20))
    with pytest.raises(ValueError, match="mlp.down_proj.bias"):
        build_model(config, {k: v for k, v in state_dict.items() if k != "model.layers.1.mlp.down_proj.bias"},
                    torch.float32)


def test_json_round_trip_of_a_real_llama31_config(tmp_path):
    """Llama-3.2-1B's config.json, as published (transformers 4.45), reads as llama3 RoPE."""
    raw = json.loads("""{"architectures": ["LlamaForCausalLM"], "attention_bias": false,
        "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
        "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
        "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
        "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0,
        "low_freq_factor": 1.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0", "use_cache": true, "vocab_size": 128256}""")
    config = config_from_hf(raw, has_lm_head=False)
    assert config.rope_scaling["factor"] == 32.0 and config.rope_theta == 500000.0
    assert config.tie_word_embeddings and config.head_dim == 64


# ------------------------------------------------------------------------------ GGUF
_HF_TO_GGUF_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                     "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                     "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                     "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm",
                     "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
                     "block_sparse_moe.gate": "ffn_gate_inp"}
# An expert's projection (Qwen3-MoE/OLMoE names, then Mixtral's) -> the GGUF tensor stacking all experts'.
_HF_TO_GGUF_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                       "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute``: HF "rotate half" rows to its
    interleaved RoPE pairs (what ``loader._unpermute_rope`` undoes)."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2) \
        .reshape(weight.shape)


def write_gguf(path, arch: str, hf, extra=None, extra_tensors=None, state_dict=None, tensor_types=None) -> None:
    """``hf`` as llama.cpp's converter writes it (fp32 tensors unless ``tensor_types`` says, no
    tokenizer): hyper-parameters under ``{arch}.``, Q/K rows permuted for ``llama``, for llama3
    RoPE the ``rope_freqs.weight`` divisors (``LlamaModel.generate_extra_tensors``), and each
    layer's experts stacked into one ``[num_experts, out, in]`` tensor per projection
    (``Qwen2MoeModel.modify_tensors``). ``state_dict``: the tensors by checkpoint name (the saved
    file's, which for MoE models names each expert; default ``hf.state_dict()``)."""
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads  # Mixtral: None; OLMoE: absent
    metadata = hf_metadata(c, add_key_length=head_dim, add_value_length=head_dim, add_rope_dimension_count=head_dim,
                           **(extra or {}))
    tensors = list((extra_tensors or {}).items())
    rope = c.rope_parameters
    if rope["rope_type"] == "llama3":
        plain = rope_inverse_frequencies(head_dim, rope["rope_theta"])
        tensors.append(("rope_freqs.weight", (plain / hf.model.rotary_emb.inv_freq).numpy()))
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, tensor in (hf.state_dict() if state_dict is None else state_dict).items():
        array = tensor.float().numpy()
        if name in GGUF_GLOBAL_NAMES:
            tensors.append((GGUF_GLOBAL_NAMES[name], array))
            continue
        layer, rest = name[len("model.layers."):].split(".", 1)
        module, kind = rest.rsplit(".", 1)
        if ".experts." in module:
            _, expert, projection = module.rsplit(".", 2)
            experts.setdefault(f"blk.{layer}.{_HF_TO_GGUF_EXPERTS[projection]}.{kind}", {})[int(expert)] = array
            continue
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            array = llama_cpp_permute(array, c.num_attention_heads if "q_proj" in module else c.num_key_value_heads)
        tensors.append((f"blk.{layer}.{_HF_TO_GGUF_LAYER[module]}.{kind}", array))
    tensors += [(name, np.stack([by_index[e] for e in sorted(by_index)])) for name, by_index in experts.items()]
    write_gguf_file(path, arch, metadata, tensors, tensor_types)


def load_gguf(path):
    """``loader._read_gguf``'s config and weights, saved as the folder ``model_folder`` writes
    (without the tokenizer, which needs a vocabulary in the file), and loaded back."""
    from safetensors.torch import save_file

    from pagedllm.models.loader import _read_gguf

    raw, state_dict, _ = _read_gguf(path)
    folder = path.parent / "converted"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw))
    save_file(state_dict, str(folder / "model.safetensors"))
    return load_checkpoint(folder)


def test_llama3_gguf_rope_freqs_equal_transformers(tiny_llama3, tmp_path):
    """A Llama 3.x GGUF carries the scaling as ``rope_freqs.weight`` only (no metadata key); it
    was skipped before, as any tensor the loader did not know."""
    hf, _ = tiny_llama3
    write_gguf(tmp_path / "m.gguf", "llama", hf)
    config, state_dict = load_gguf(tmp_path / "m.gguf")
    assert config.rope_scaling is None and len(config.rope_freq_factors) == 8
    model = build_model(config, state_dict, torch.float32)
    # Divided by llama.cpp's factors rather than scaled as HF does: the frequencies differ by
    # an ulp or so, the angles by that times the position (1.5e-5 at position ~900).
    torch.testing.assert_close(model.rotary.cos, tiny_llama3[1].rotary.cos, rtol=0, atol=1e-4)
    assert_parity(hf, model, random_prompts(700), GGUF_LLAMA3_LOGPROB_TOL)


def test_qwen3_gguf_equals_transformers(tmp_path):
    hf = save_tiny_hf("qwen3", tmp_path, head_dim=32, tie_word_embeddings=False)
    write_gguf(tmp_path / "m.gguf", "qwen3", hf)
    config, state_dict = load_gguf(tmp_path / "m.gguf")
    assert (config.architecture, config.qk_norm, config.head_dim) == ("qwen3", True, 32)
    assert_parity(hf, build_model(config, state_dict, torch.float32), random_prompts(40))


GGUF_REFUSED = [
    ({"add_rope_scaling_type": "yarn"}, "llama.rope.scaling.type='yarn'"),
    ({"add_expert_count": 8}, "llama.expert_count=8"),
    ({"add_sliding_window": 4096}, "llama.attention.sliding_window=4096"),
]


@pytest.mark.parametrize("metadata,message", GGUF_REFUSED, ids=[m for _, m in GGUF_REFUSED])
def test_gguf_metadata_the_engine_does_not_implement_is_refused(tmp_path, metadata, message):
    import gguf

    hf = save_tiny_hf("llama", tmp_path, num_hidden_layers=1)
    if "add_rope_scaling_type" in metadata:
        metadata = {"add_rope_scaling_type": gguf.RopeScalingType(metadata["add_rope_scaling_type"])}
    write_gguf(tmp_path / "m.gguf", "llama", hf, metadata)
    with pytest.raises(ValueError, match=message):
        load_gguf(tmp_path / "m.gguf")


def test_gguf_tensor_the_engine_would_not_read_is_refused(tmp_path):
    """Skipped silently before (as ``rope_freqs.weight`` was): an expert's weight of a Mixtral
    GGUF, which llama.cpp writes under the ``llama`` architecture too."""
    hf = save_tiny_hf("llama", tmp_path, num_hidden_layers=1)
    write_gguf(tmp_path / "m.gguf", "llama", hf, extra_tensors={"blk.0.ffn_gate_exps.weight": np.zeros((2, 4, 8),
                                                                                                       np.float32)})
    with pytest.raises(ValueError, match="GGUF tensor 'blk.0.ffn_gate_exps.weight'"):
        load_gguf(tmp_path / "m.gguf")
