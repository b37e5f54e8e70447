"""Write a GGUF of a config.json's shape with random weights, for timing llama.cpp at the sizes
pagedllm's dummy models have (``load_format="dummy"``; bench/scale.py).

    python bench/peers/dummy_gguf.py bench/configs/Llama-3.1-8B-Instruct.json /tmp/llama-8b-q4_0.gguf --type Q4_0
    llama-bench -m /tmp/llama-8b-q4_0.gguf -p 1024,16384 -n 0            # prefill (TTFT)
    llama-bench -m /tmp/llama-8b-q4_0.gguf -p 0 -n 32 -d 1024,16384      # decode at a context depth

Every weight matrix (the token embedding and output head included) is quantized by
``gguf.quants`` to ``--type`` (F32, BF16, Q8_0, Q4_0, Q4_1); norms (and a MoE router) stay
F32, as llama.cpp's converter writes them. One random tensor is drawn per distinct shape and
written for every layer (the values do not change the work, and drawing and quantizing 8B
weights in numpy would take many minutes). The vocabulary is a placeholder SentencePiece one (``<unk>``,
``<s>``, ``</s>``, the 256 byte tokens, then ``<tN>``) of the config's size, enough for
llama.cpp to load the file and for llama-bench, which feeds random token ids. RoPE scaling
is left out: it changes no cost.

Llama-family configs (``model_type`` llama or mistral) and Qwen3-MoE ones (``qwen3_moe``, e.g.
bench/configs/Qwen3-30B-A3B.json; llama.cpp's ``qwen3moe``, laid out as its converter writes
it): per layer the Q/K RMSNorms (F32), the router ``ffn_gate_inp`` (``[experts, hidden]``, F32
as llama.cpp keeps it) and each projection of all experts stacked in one 3-D tensor
(``ffn_{gate,up,down}_exps``, ``[experts, out, in]``, blocks along ``in``) of ``--type``. One
expert matrix per projection shape is drawn and quantized, then repeated for every expert. Every
layer has experts (llama.cpp's qwen3moe has no dense layers: ``mlp_only_layers`` must be empty
and ``decoder_sparse_step`` 1).

``GGUFWriter`` holds the arrays it is given until it writes the file: the same array objects
are handed over for every layer, so memory is one layer's distinct tensors (and the embedding
and output head), not the model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

TYPES = ("F32", "BF16", "Q8_0", "Q4_0", "Q4_1")
# Hugging Face model_type -> GGUF general.architecture (llama.cpp writes Mistral as llama).
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen3_moe": "qwen3moe"}
_ATTENTION_TENSORS = {  # GGUF name after blk.N. -> (rows, columns) as functions of the config
    "attn_q.weight": lambda c: (c["q"], c["h"]), "attn_k.weight": lambda c: (c["kv"], c["h"]),
    "attn_v.weight": lambda c: (c["kv"], c["h"]), "attn_output.weight": lambda c: (c["h"], c["q"]),
}
_DENSE_MLP_TENSORS = {
    "ffn_gate.weight": lambda c: (c["i"], c["h"]), "ffn_up.weight": lambda c: (c["i"], c["h"]),
    "ffn_down.weight": lambda c: (c["h"], c["i"]),
}
_EXPERT_TENSORS = {  # each expert's (rows, columns); stacked [experts, rows, columns]
    "ffn_gate_exps.weight": lambda c: (c["e"], c["h"]), "ffn_up_exps.weight": lambda c: (c["e"], c["h"]),
    "ffn_down_exps.weight": lambda c: (c["h"], c["e"]),
}


def placeholder_vocab(vocab_size: int) -> list[str]:
    """``vocab_size`` distinct SentencePiece-style tokens: 3 specials, 256 bytes, then fillers.

    Raises:
        ValueError: ``vocab_size`` below 259.
    """
    if vocab_size < 259:
        raise ValueError(f"vocab_size must be >= 259 for the byte tokens, got {vocab_size}")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)]
    return tokens + [f"<t{index}>" for index in range(len(tokens), vocab_size)]


def write_dummy_gguf(config_path: Path, out: Path, tensor_type: str = "Q8_0", seed: int = 0) -> None:
    """Write ``out``: metadata from ``config_path`` (``ARCHITECTURES``) and random weights of
    ``tensor_type``.

    Raises:
        ValueError: a ``model_type`` not in ``ARCHITECTURES``, a Qwen3-MoE config with dense
            layers, or an unknown ``tensor_type``.
    """
    import gguf

    if tensor_type not in TYPES:
        raise ValueError(f"--type must be one of {TYPES}, got {tensor_type!r}")
    raw = json.loads(config_path.read_text())
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type {model_type!r}: only {', '.join(ARCHITECTURES)} configs are written")
    moe = model_type == "qwen3_moe"
    if moe and (raw.get("mlp_only_layers") or raw.get("decoder_sparse_step", 1) != 1):
        raise ValueError(f"{config_path.name}: mlp_only_layers={raw.get('mlp_only_layers')} decoder_sparse_step="
                         f"{raw.get('decoder_sparse_step')}: llama.cpp's qwen3moe has experts in every layer")
    heads = raw["num_attention_heads"]
    kv_heads = raw.get("num_key_value_heads") or heads
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    dims = {"h": raw["hidden_size"], "i": raw["intermediate_size"], "q": heads * head_dim, "kv": kv_heads * head_dim,
            "e": raw.get("moe_intermediate_size", 0)}
    qtype = gguf.GGMLQuantizationType[tensor_type]
    rng = np.random.default_rng(seed)
    drawn: dict[tuple, np.ndarray] = {}
    stacked: dict[tuple[int, int], np.ndarray] = {}

    def matrix(rows: int, columns: int, kind=qtype) -> np.ndarray:
        if (rows, columns, kind) not in drawn:
            values = rng.uniform(-0.0346, 0.0346, size=(rows, columns)).astype(np.float32)
            drawn[(rows, columns, kind)] = gguf.quants.quantize(values, kind)
        return drawn[(rows, columns, kind)]

    def experts(rows: int, columns: int) -> np.ndarray:
        # One quantized expert repeated (contiguous: the writer's tofile streams it in one go).
        if (rows, columns) not in stacked:
            one = matrix(rows, columns)
            stacked[(rows, columns)] = np.ascontiguousarray(np.broadcast_to(one, (raw["num_experts"], *one.shape)))
        return stacked[(rows, columns)]

    writer = gguf.GGUFWriter(str(out), ARCHITECTURES[model_type])
    writer.add_name(f"{config_path.stem} (random weights, {tensor_type})")
    writer.add_context_length(raw.get("max_position_embeddings", 2048))
    writer.add_embedding_length(dims["h"])
    writer.add_block_count(raw["num_hidden_layers"])
    writer.add_feed_forward_length(dims["i"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(raw.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(raw.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(raw["vocab_size"])
    if moe:
        writer.add_expert_count(raw["num_experts"])
        writer.add_expert_used_count(raw["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(dims["e"])
        # llama.cpp's qwen3moe graph always renormalizes; pagedllm's reader takes the key.
        writer.add_expert_weights_norm(bool(raw.get("norm_topk_prob", False)))
    file_types = {"F32": gguf.LlamaFileType.ALL_F32, "BF16": gguf.LlamaFileType.MOSTLY_BF16,
                  "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
                  "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}
    writer.add_file_type(file_types[tensor_type])
    tokens = placeholder_vocab(raw["vocab_size"])
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
                           + [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (len(tokens) - 259))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)

    norm = np.ones(dims["h"], dtype=np.float32)
    head_norm = np.ones(head_dim, dtype=np.float32)
    writer.add_tensor("token_embd.weight", matrix(raw["vocab_size"], dims["h"]), raw_dtype=qtype)
    writer.add_tensor("output_norm.weight", norm)
    if not raw.get("tie_word_embeddings", False):
        writer.add_tensor("output.weight", matrix(raw["vocab_size"], dims["h"]), raw_dtype=qtype)
    for layer in range(raw["num_hidden_layers"]):
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", norm)
        writer.add_tensor(f"blk.{layer}.ffn_norm.weight", norm)
        for name, shape in _ATTENTION_TENSORS.items():
            writer.add_tensor(f"blk.{layer}.{name}", matrix(*shape(dims)), raw_dtype=qtype)
        if not moe:
            for name, shape in _DENSE_MLP_TENSORS.items():
                writer.add_tensor(f"blk.{layer}.{name}", matrix(*shape(dims)), raw_dtype=qtype)
            continue
        writer.add_tensor(f"blk.{layer}.attn_q_norm.weight", head_norm)
        writer.add_tensor(f"blk.{layer}.attn_k_norm.weight", head_norm)
        writer.add_tensor(f"blk.{layer}.ffn_gate_inp.weight",
                          matrix(raw["num_experts"], dims["h"], gguf.GGMLQuantizationType.F32))
        for name, shape in _EXPERT_TENSORS.items():
            writer.add_tensor(f"blk.{layer}.{name}", experts(*shape(dims)), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path, help="a config.json (bench/configs/*.json)")
    parser.add_argument("out", type=Path, help="the .gguf to write")
    parser.add_argument("--type", default="Q8_0", choices=TYPES, help="type of the weight matrices (default Q8_0)")
    args = parser.parse_args()
    write_dummy_gguf(args.config, args.out, args.type)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
