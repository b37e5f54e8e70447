"""``load_format="dummy"`` (models/dummy.py): the model built from a config.json alone holds the
same modules, tensor shapes, dtypes and quantized layouts as the model the real loader builds
from the checkpoint, for the tiny model (a safetensors folder written here) and for SmolLM2
(its GGUF against ``bench/configs/SmolLM2-135M-Instruct.json``), in every quantization pagedllm
applies itself. See docs/benchmarks/serving-size.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedllm import LLM
from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.models.dummy import DummyStateDict, hf_weight_shapes, load_dummy_checkpoint
from pagedllm.models.loader import MODEL_CLASSES, build_model, load_checkpoint, load_prequantized
from pagedllm.sampling_params import SamplingParams
from tests.conftest import tiny_config, tiny_state_dict

CONFIGS = Path(__file__).resolve().parent.parent / "bench" / "configs"
QUANTIZATIONS = [None, "int8", "int4", "w8a8", "w4a8"]


def layout(model: torch.nn.Module) -> dict[str, object]:
    """Every module's class and every tensor attribute's shape, dtype and layout (a packed
    ``Linear``'s opaque mkldnn tensor and the RoPE tables included), by dotted name."""
    described: dict[str, object] = {}
    for module_name, module in model.named_modules():
        described[module_name or "."] = type(module).__name__
        for attribute, value in {**vars(module), **module._parameters, **module._buffers}.items():
            if isinstance(value, torch.Tensor):
                described[f"{module_name}.{attribute}"] = (tuple(value.shape), value.dtype, str(value.layout))
    return described


def _write_tiny_folder(folder: Path) -> None:
    from safetensors.torch import save_file

    config = tiny_config()
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
           "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
           "num_hidden_layers": config.num_hidden_layers, "num_attention_heads": config.num_attention_heads,
           "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
           "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
           "max_position_embeddings": config.max_position_embeddings, "tie_word_embeddings": False}
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    save_file(tiny_state_dict(config), str(folder / "model.safetensors"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_tiny_dummy_model_has_the_real_loaders_layout(tmp_path, dtype, quantization):
    _write_tiny_folder(tmp_path)
    config, state_dict = load_checkpoint(tmp_path)
    method, prequantized = load_prequantized(tmp_path, quantization)
    real = build_model(config, state_dict, dtype, method, prequantized, calibration_token_ids=[1, 2, 3])
    dummy_config, dummy_weights = load_dummy_checkpoint(str(tmp_path), dtype)
    assert dummy_config == config
    assert {name: tuple(t.shape) for name, t in state_dict.items()} == dummy_weights.shapes
    dummy = build_model(dummy_config, dummy_weights, dtype, quantization, calibration_token_ids=[1, 2, 3])
    assert layout(dummy) == layout(real)
    assert (dummy.fused_decode is None) == (real.fused_decode is None)


def test_dummy_weights_are_drawn_in_the_compute_dtype_and_repeat():
    weights = DummyStateDict(tiny_config(), torch.bfloat16, seed=3)
    first = weights["model.layers.1.mlp.down_proj.weight"]
    assert first.dtype == torch.bfloat16 and first.shape == (64, 128)
    assert torch.equal(first, weights["model.layers.1.mlp.down_proj.weight"])
    assert not torch.equal(first, DummyStateDict(tiny_config(), torch.bfloat16, seed=4)
                           ["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(weights["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    assert first.float().abs().max() < 0.0347 and first.float().std() > 0.015


def test_dummy_weights_do_not_depend_on_the_thread_count(monkeypatch):
    """A tensor is drawn in pieces, each from its own generator, by torch's threads at once:
    the values are the same with one thread or two, and no piece repeats another."""
    from pagedllm.models import dummy

    monkeypatch.setattr(dummy, "DRAW_PIECE_ELEMENTS", 1000)  # [64, 128]: 9 pieces
    threads = torch.get_num_threads()
    drawn = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            drawn.append(DummyStateDict(tiny_config(), torch.float32)["model.layers.1.mlp.down_proj.weight"])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(drawn[0], drawn[1])
    flat = drawn[0].view(-1)
    assert not torch.equal(flat[:1000], flat[1000:2000]) and flat[8000:].abs().max() > 0


def test_a_build_draws_each_dummy_weight_once():
    """Asking whether a name is there draws nothing; building the model reads every weight
    exactly once (Mapping's own ``in`` reads the item: each weight was drawn twice)."""
    draws: list[str] = []

    class Counting(DummyStateDict):
        def __getitem__(self, name):
            draws.append(name)
            return super().__getitem__(name)

    weights = Counting(tiny_config(), torch.float32)
    assert "model.layers.0.mlp.up_proj.weight" in weights and "model.layers.9.mlp.up_proj.weight" not in weights
    assert draws == []
    build_model(tiny_config(), weights, torch.float32, "int8")
    assert sorted(draws) == sorted(weights.shapes)


def test_weight_shapes_follow_the_family_switches():
    shapes = hf_weight_shapes(tiny_config(attention_bias=True, qk_norm=True, tie_word_embeddings=True))
    assert shapes["model.layers.0.self_attn.k_proj.bias"] == (32,)
    assert shapes["model.layers.1.self_attn.q_norm.weight"] == (16,)
    assert "lm_head.weight" not in shapes and "model.layers.0.mlp.down_proj.bias" not in shapes


@pytest.fixture(scope="module")
def smollm2_real_layouts():
    """The real SmolLM2 GGUF (Q4_1: ``int4`` and ``w4a8`` take its 4-bit codes as they are)
    built by the engine in the default dtype, per quantization."""
    layouts = {}
    for quantization in QUANTIZATIONS:
        engine = LLMEngine(EngineArgs(quantization=quantization, num_gpu_blocks_override=8, max_model_len=64))
        layouts[quantization] = (layout(engine.model), engine.weight_bytes)
        del engine
    return layouts


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_smollm2_dummy_from_its_public_config_has_the_real_layout(smollm2_real_layouts, quantization):
    engine = LLMEngine(EngineArgs(model=str(CONFIGS / "SmolLM2-135M-Instruct.json"), load_format="dummy",
                                  quantization=quantization, num_gpu_blocks_override=8, max_model_len=64))
    real_layout, real_bytes = smollm2_real_layouts[quantization]
    assert layout(engine.model) == real_layout
    assert engine.weight_bytes == real_bytes
    assert engine.tokenizer is None


def test_llm_generates_from_a_dummy_config_and_the_cli_takes_the_option():
    llm = LLM(model=str(CONFIGS / "tiny-llama.json"), load_format="dummy", num_gpu_blocks_override=16,
              max_model_len=64, block_size=4)
    output, = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 4
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--model", "x.json", "--load-format", "dummy"]))
    assert args.load_format == "dummy"


@pytest.mark.parametrize("kwargs, message", [
    (dict(load_format="pt"), "load_format must be one of"),
    (dict(load_format="dummy"), "needs model"),
    (dict(load_format="dummy", model="c.json", quantization="awq"), "not supported"),
])
def test_bad_load_format_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs.from_kwargs(**kwargs)


def test_dummy_refuses_what_it_cannot_build(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_dummy_checkpoint(str(tmp_path), torch.float32)
    config = json.loads((CONFIGS / "tiny-llama.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "rwkv"}))
    with pytest.raises(ValueError, match="rwkv"):
        load_dummy_checkpoint(str(tmp_path), torch.float32)


_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, vocab_size=256, max_position_embeddings=512, pad_token_id=0)
_MOE = {"qwen3_moe": dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2),
        "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
        "olmoe": dict(num_experts=4, num_experts_per_tok=2)}


@pytest.mark.parametrize("model_type", sorted(MODEL_CLASSES))
def test_dummy_names_and_shapes_equal_a_transformers_checkpoint(tmp_path, model_type):
    """Every supported architecture: the dummy mapping holds exactly the tensors (names, shapes)
    that transformers' ``save_pretrained`` writes for the same config, and the engine builds and
    decodes from it."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **_SMALL, **_MOE.get(model_type, {}))
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    engine_config, weights = load_dummy_checkpoint(str(tmp_path / "config.json"), torch.float32)
    assert hf_weight_shapes(engine_config) == saved
    llm = LLM(model=str(tmp_path / "config.json"), load_format="dummy", num_gpu_blocks_override=16,
              max_model_len=64, block_size=4)
    output, = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, ignore_eos=True),
                           use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 3


def test_dummy_weights_tp2_equals_tp1():
    """``load_format="dummy"``: each rank draws every weight from its name, so the shards are of
    one model (the tiny config's single KV head is replicated on both ranks). Here, not in
    test_tensor_parallel.py, whose module-wide TP engine would refuse a second one."""
    config = str(CONFIGS / "tiny-llama.json")
    kwargs = dict(model=config, load_format="dummy", dtype="float32", num_gpu_blocks_override=32,
                  max_model_len=64, block_size=16)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts_ = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": list(range(40))}]
    expected = [o.outputs[0].token_ids for o in LLM(**kwargs).generate(prompts_, params, use_tqdm=False)]
    llm = LLM(tensor_parallel_size=2, tp_cores="0;1", **kwargs)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts_, params, use_tqdm=False)] == expected
    finally:
        llm.llm_engine.shutdown()
