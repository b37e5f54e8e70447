"""AWQ, GPTQ and compressed-tensors checkpoints load into pagedllm's int4/int8 layers exactly.

The checkpoints are written by ``tests/quantized_checkpoints.py`` (compressed-tensors by the
library itself; AWQ and GPTQ packed from their specifications) and the reference weights are
the format library's dequantization computed with fp32 scales: pagedllm's dequantized
weights equal them bit for bit (``s * (q - z)`` is exact in fp32 for fp16 scales), and equal
the library's own fp16 dequantization once rounded to fp16.
"""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.layers.quantization import Int4Linear, Int8Linear
from pagedllm.models.loader import build_model, load_checkpoint, load_prequantized
from tests.conftest import run_to_completion, tiny_config, tiny_state_dict
from tests.quantized_checkpoints import hf_config, write_checkpoint

pytest.importorskip("compressed_tensors")

# name -> write_checkpoint options
FORMATS = {
    "awq-g128": dict(method="awq", group_size=128),
    "awq-g64": dict(method="awq", group_size=64),
    "gptq4-v1-sym": dict(method="gptq", bits=4, sym=True, v1=True),
    "gptq4-v2-asym-act-order": dict(method="gptq", bits=4, sym=False, v1=False, desc_act=True, group_size=64),
    "gptq4-v1-asym-act-order": dict(method="gptq", bits=4, sym=False, v1=True, desc_act=True, group_size=32),
    "gptq8-sym-act-order": dict(method="gptq", bits=8, sym=True, desc_act=True, group_size=64),
    "gptq8-per-channel": dict(method="gptq", bits=8, sym=True, group_size=-1),
    "ct-w4a16-sym": dict(method="compressed-tensors", fmt="pack-quantized", sym=True),
    "ct-w4a16-asym": dict(method="compressed-tensors", fmt="pack-quantized", sym=False, group_size=64),
    "ct-w8a8": dict(method="compressed-tensors", fmt="int-quantized", sym=True),
}
PROJECTIONS = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "self_attn.o_proj": ("o_proj",),
               "mlp.gate_up_proj": ("gate_proj", "up_proj"), "mlp.down_proj": ("down_proj",)}


def _config(tied: bool = False):
    # in_features 128 / 256: multiples of the 128-wide groups
    return tiny_config(hidden_size=128, intermediate_size=256, head_dim=32, tie_word_embeddings=tied)


def _state_dict(config):
    state_dict = tiny_state_dict(config, seed=5)
    if config.tie_word_embeddings:
        del state_dict["lm_head.weight"]
    return state_dict


def _load(folder, quantization=None):
    config, state_dict = load_checkpoint(folder)
    method, prequantized = load_prequantized(folder, quantization)
    return build_model(config, state_dict, torch.float32, method, prequantized)


def _checkpoint_order(module) -> torch.Tensor:
    """The layer's dequantized weight with its input features back in checkpoint order."""
    weight = module.dequantize()
    if module.input_order is None:
        return weight
    restored = torch.empty_like(weight)
    restored[:, module.input_order] = weight
    return restored


@pytest.mark.parametrize("name", FORMATS)
def test_dequantized_weights_equal_the_format_library(tmp_path, name):
    options = FORMATS[name]
    config = _config()
    reference = write_checkpoint(tmp_path, config, _state_dict(config), **options)
    model = _load(tmp_path)
    assert model.quantization == options["method"]
    expected_type = Int8Linear if options.get("bits") == 8 or options.get("fmt") == "int-quantized" else Int4Linear
    for i, layer in enumerate(model.layers):
        for attr, parts in PROJECTIONS.items():
            module = layer.get_submodule(attr)
            assert type(module) is expected_type, (attr, type(module))
            prefix = f"model.layers.{i}.{attr.split('.')[0]}."
            expected = torch.cat([reference[prefix + part + ".weight"] for part in parts])
            weight = _checkpoint_order(module)
            assert torch.equal(weight, expected), (name, attr, (weight - expected).abs().max())
            # The library's fp16 dequantization is the exact value rounded once to fp16.
            assert torch.equal(weight.half(), expected.half())
            assert (module.input_order is not None) == bool(options.get("desc_act")), attr
    # Embedding and head stay float, as the checkpoint stores them.
    assert isinstance(model.embed_tokens, torch.nn.Embedding) and not isinstance(model.lm_head, (Int4Linear, Int8Linear))


@pytest.mark.parametrize("name", ["awq-g128", "gptq4-v1-asym-act-order", "gptq8-sym-act-order", "ct-w4a16-sym",
                                  "ct-w8a8"])
@pytest.mark.parametrize("tied", [False, True])
def test_greedy_output_equals_float_model_with_the_dequantized_weights(tmp_path, name, tied):
    """Through the engine: prefill takes the dequantize-then-GEMM path, decode the C++ kernels
    (or the fused decode op), against a float model given the library's dequantized weights
    (token ids in and out: the tiny folders have no tokenizer; ``LLM(model=folder)`` is
    tested on SmolLM2)."""
    config = _config(tied)
    reference_weights = write_checkpoint(tmp_path, config, _state_dict(config), **FORMATS[name])
    args = dict(dtype="float32", block_size=4, num_gpu_blocks_override=64, max_model_len=64)
    engine = LLMEngine(EngineArgs.from_kwargs(**args), model=_load(tmp_path), tokenizer=None)
    assert engine.model.quantization == FORMATS[name]["method"]
    assert engine.weight_bytes < engine.model.unquantized_weight_bytes * (0.6 if tied else 0.75)
    reference = LLMEngine(EngineArgs.from_kwargs(**args), model=build_model(config, reference_weights, torch.float32),
                          tokenizer=None)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[3, 17, 99, 4, 250, 8], [42], list(range(10, 40))]
    outputs = []
    for e in (engine, reference):
        for i, prompt in enumerate(prompts):
            e.add_request(str(i), {"prompt_token_ids": prompt}, params)
        finals = run_to_completion(e)
        outputs.append([finals[str(i)].outputs[0].token_ids for i in range(len(prompts))])
    assert outputs[0] == outputs[1]


def test_quantization_option_must_match_the_folder(tmp_path):
    config = _config()
    write_checkpoint(tmp_path / "awq", config, _state_dict(config), method="awq")
    assert _load(tmp_path / "awq", "awq").quantization == "awq"
    with pytest.raises(ValueError, match="quantization='gptq' does not match.*'awq'"):
        load_prequantized(tmp_path / "awq", "gptq")
    with pytest.raises(ValueError, match="quantization='int4'.*already quantized"):
        load_prequantized(tmp_path / "awq", "int4")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps(hf_config(config, None)))
    with pytest.raises(ValueError, match="quantization='awq' needs a checkpoint quantized with it"):
        load_prequantized(plain, "awq")
    config_, state_dict = load_checkpoint(tmp_path / "awq")
    with pytest.raises(ValueError, match="quantized"):
        build_model(config_, state_dict, torch.float32)


@pytest.mark.parametrize("quantization_config, message", [
    ({"quant_method": "awq", "bits": 3, "group_size": 128, "version": "gemm"}, "awq: 3-bit"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version 'gemv'"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq: 3-bit"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 16}, "group_size 16"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128, "sym": False}, "sym=false"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "'marlin'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                                 "strategy": "channel"}}}}, "type 'float'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 2, "type": "int",
                                                                 "strategy": "group", "group_size": 128}}}},
     "'pack-quantized' with 2-bit"),
])
def test_unsupported_quantization_config_is_a_value_error_naming_it(tmp_path, quantization_config, message):
    (tmp_path / "config.json").write_text(json.dumps(hf_config(_config(), quantization_config)))
    with pytest.raises(ValueError, match=message):
        load_prequantized(tmp_path, None)
    with pytest.raises(ValueError, match=message):
        LLM(model=str(tmp_path))


def test_quantization_flag_accepts_the_checkpoint_methods():
    from pagedllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "some/folder", "--quantization", "compressed-tensors"])
    assert EngineArgs.from_cli_args(args).quantization == "compressed-tensors"


SMOLLM2_FORMATS = {
    # SmolLM2's hidden size 576 is 9 groups of 64, not of 128.
    "awq-g64": dict(method="awq", group_size=64),
    "gptq4-v1-act-order-g64": dict(method="gptq", bits=4, sym=True, v1=True, desc_act=True, group_size=64),
    "ct-w4a16-g64": dict(method="compressed-tensors", fmt="pack-quantized", sym=True, group_size=64),
    "ct-w8a8": dict(method="compressed-tensors", fmt="int-quantized", sym=True),
}


@pytest.fixture(scope="module")
def smollm2_source():
    from pagedllm.models.loader import model_folder, resolve_model_path

    folder = model_folder(resolve_model_path(None))
    config, state_dict = load_checkpoint(folder)
    return folder, config, state_dict


@pytest.mark.slow
@pytest.mark.parametrize("name", SMOLLM2_FORMATS)
def test_smollm2_greedy_output_equals_transformers_on_the_dequantized_weights(tmp_path, smollm2_source, name):
    """``LLM(model=folder)`` detects the method; its greedy tokens equal transformers fp32 given
    the format library's dequantized weights, token for token."""
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    from tests.test_parity import hf_greedy

    source, config, state_dict = smollm2_source
    reference = write_checkpoint(tmp_path, config, state_dict, tokenizer_folder=source, **SMOLLM2_FORMATS[name])
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory_bytes=64 * 2**20, max_model_len=512)
    assert llm.llm_engine.model.quantization == SMOLLM2_FORMATS[name]["method"]
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):",
                                             "The old lighthouse keeper climbed the spiral stairs every evening,")]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    hf = LlamaForCausalLM(HFLlamaConfig(**json.loads((tmp_path / "config.json").read_text()) | {
        "quantization_config": None})).eval()
    hf.load_state_dict({k: v for k, v in reference.items()}, strict=False)
    hf.tie_weights()
    assert torch.equal(hf.lm_head.weight, reference["model.embed_tokens.weight"])
    for prompt, output in zip(prompts, outputs):
        assert list(output.outputs[0].token_ids) == hf_greedy(hf, prompt, 16), name


def test_tensor_parallelism_refuses_checkpoint_methods_by_name(tmp_path):
    from pagedllm.config import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine

    config = _config()
    write_checkpoint(tmp_path / "awq", config, _state_dict(config), method="awq")
    args = EngineArgs(model=str(tmp_path / "awq"), tensor_parallel_size=2, num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 is not supported for 'awq' checkpoints"):
        LLMEngine(args)
