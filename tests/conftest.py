"""Shared fixtures: a tiny random-weight Llama for engine logic, the real SmolLM2 for parity."""

from __future__ import annotations

import functools

import pytest
import torch

from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.models.llama import LlamaConfig, LlamaForCausalLM

TINY_VOCAB = 256


def pytest_terminal_summary(terminalreporter) -> None:
    """Which build of the C++ ops this run tested, and which variants the CPU could run (the
    others' tests, in ``test_native_build.py``, are reported as skipped with the reason)."""
    from pagedllm import cpu_isa, envs
    from pagedllm.layers import ops

    runnable = ", ".join(v.name for v in cpu_isa.executable_variants()) or "none"
    if not envs.PAGEDLLM_NATIVE_OPS:
        loaded = "off (PAGEDLLM_NATIVE_OPS=0)"
    elif ops.native_ops() is None:
        loaded = f"not loaded ({ops.native_ops_error()})"
    else:
        loaded = f"the {ops.native_ops().build_info().split()[0]} build"
    terminalreporter.write_line(f"pagedllm C++ ops: {loaded}; this CPU executes the variants: {runnable}")


def tiny_config(**overrides) -> LlamaConfig:
    values = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                  rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False,
                  eos_token_id=None)
    values.update(overrides)
    return LlamaConfig(**values)


def tiny_state_dict(config: LlamaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face names, scaled so logits are not flat."""
    g = torch.Generator().manual_seed(seed)
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d

    def rand(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    sd = {"model.embed_tokens.weight": rand(config.vocab_size, h, scale=1.0),
          "model.norm.weight": 1 + rand(h, scale=0.1),
          "lm_head.weight": rand(config.vocab_size, h, scale=0.5)}
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        sd.update({
            p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
            p + "input_layernorm.weight": 1 + rand(h, scale=0.1),
            p + "post_attention_layernorm.weight": 1 + rand(h, scale=0.1),
        })
        if config.attention_bias:
            sd.update({p + "self_attn.q_proj.bias": rand(q), p + "self_attn.k_proj.bias": rand(kv),
                       p + "self_attn.v_proj.bias": rand(kv)})
    return sd


def save_tiny_checkpoint(folder, config: LlamaConfig, seed: int = 0) -> str:
    """Write ``tiny_state_dict(config, seed)`` as a Hugging Face folder (``config.json`` and
    ``model.safetensors``) that ``models/loader.py`` reads; returns the folder as a string."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    folder = Path(folder)
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings")
    (folder / "config.json").write_text(json.dumps(dict(model_type="llama", tie_word_embeddings=False,
                                                        **{key: getattr(config, key) for key in fields})))
    save_file(tiny_state_dict(config, seed), str(folder / "model.safetensors"))
    return str(folder)


def hf_tiny_model(seed: int = 0, ours=None):
    """HF's Llama with the weights of ``build_model(ours, tiny_state_dict(ours, seed))``."""
    import transformers

    ours = ours or tiny_config()
    config = transformers.LlamaConfig(
        vocab_size=ours.vocab_size, hidden_size=ours.hidden_size, intermediate_size=ours.intermediate_size,
        num_hidden_layers=ours.num_hidden_layers, num_attention_heads=ours.num_attention_heads,
        num_key_value_heads=ours.num_key_value_heads, head_dim=ours.head_dim, rms_norm_eps=ours.rms_norm_eps,
        rope_theta=ours.rope_theta, max_position_embeddings=ours.max_position_embeddings,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(config).eval()
    model.load_state_dict(tiny_state_dict(ours, seed))
    return model


@functools.lru_cache(maxsize=4)
def _tiny_model(dtype: torch.dtype, seed: int) -> LlamaForCausalLM:
    from pagedllm.models.loader import build_model
    config = tiny_config()
    return build_model(config, tiny_state_dict(config, seed), dtype)


def make_tiny_engine(dtype: torch.dtype = torch.float32, seed: int = 0, **engine_kwargs) -> LLMEngine:
    """An ``LLMEngine`` over a tiny random llama (no tokenizer: prompts are token ids).

    Defaults: 64 blocks of 4 tokens, max_model_len 128.
    """
    kwargs = dict(block_size=4, num_gpu_blocks_override=64, max_model_len=128,
                  max_num_seqs=16, max_num_batched_tokens=64)
    kwargs.update(engine_kwargs)
    return LLMEngine(EngineArgs.from_kwargs(**kwargs), model=_tiny_model(dtype, seed), tokenizer=None)


def run_to_completion(engine: LLMEngine, max_steps: int = 100_000) -> dict:
    """Step until idle; return request_id -> final RequestOutput. Fails on a hang."""
    finals = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finals
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    raise AssertionError(f"engine did not finish within {max_steps} steps")


@pytest.fixture
def tiny_engine_factory():
    return make_tiny_engine


@pytest.fixture(scope="session")
def smollm2_llm_fp32():
    """The real default model in fp32 (for parity with transformers), shared by the session."""
    from pagedllm import LLM
    return LLM(dtype="float32", kv_cache_memory_bytes=512 * 2**20, max_model_len=2048)
