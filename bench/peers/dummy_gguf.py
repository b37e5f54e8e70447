"""Write a GGUF of a config.json's shape with random weights, for timing llama.cpp at the sizes
pagedllm's dummy models have (``load_format="dummy"``; bench/scale.py).

    python bench/peers/dummy_gguf.py bench/configs/Llama-3.1-8B-Instruct.json /tmp/llama-8b-q4_0.gguf --type Q4_0
    llama-bench -m /tmp/llama-8b-q4_0.gguf -p 1024,16384 -n 0            # prefill (TTFT)
    llama-bench -m /tmp/llama-8b-q4_0.gguf -p 0 -n 32 -d 1024,16384      # decode at a context depth

Every 2-D weight (the token embedding and output head included) is quantized by
``gguf.quants`` to ``--type`` (F32, BF16, Q8_0, Q4_0, Q4_1); norms stay F32, as llama.cpp's
converter writes them. One random tensor is drawn per distinct shape and written for every
layer (the values do not change the work, and drawing and quantizing 8B weights in numpy
would take many minutes). The vocabulary is a placeholder SentencePiece one (``<unk>``,
``<s>``, ``</s>``, the 256 byte tokens, then ``<tN>``) of the config's size, enough for
llama.cpp to load the file and for llama-bench, which feeds random token ids. RoPE scaling
is left out: it changes no cost. Llama-family configs only (``model_type`` llama or mistral).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

TYPES = ("F32", "BF16", "Q8_0", "Q4_0", "Q4_1")
_LAYER_TENSORS = {  # GGUF name after blk.N. -> (rows, columns) as functions of the config
    "attn_q.weight": lambda c: (c["q"], c["h"]), "attn_k.weight": lambda c: (c["kv"], c["h"]),
    "attn_v.weight": lambda c: (c["kv"], c["h"]), "attn_output.weight": lambda c: (c["h"], c["q"]),
    "ffn_gate.weight": lambda c: (c["i"], c["h"]), "ffn_up.weight": lambda c: (c["i"], c["h"]),
    "ffn_down.weight": lambda c: (c["h"], c["i"]),
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
    """Write ``out``: llama metadata from ``config_path`` and random weights of ``tensor_type``.

    Raises:
        ValueError: a ``model_type`` other than llama/mistral, or an unknown ``tensor_type``.
    """
    import gguf

    if tensor_type not in TYPES:
        raise ValueError(f"--type must be one of {TYPES}, got {tensor_type!r}")
    raw = json.loads(config_path.read_text())
    if raw.get("model_type") not in ("llama", "mistral"):
        raise ValueError(f"model_type {raw.get('model_type')!r}: only llama-family configs are written")
    heads = raw["num_attention_heads"]
    kv_heads = raw.get("num_key_value_heads") or heads
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    dims = {"h": raw["hidden_size"], "i": raw["intermediate_size"], "q": heads * head_dim, "kv": kv_heads * head_dim}
    qtype = gguf.GGMLQuantizationType[tensor_type]
    rng = np.random.default_rng(seed)
    drawn: dict[tuple[int, int], np.ndarray] = {}

    def matrix(rows: int, columns: int) -> np.ndarray:
        if (rows, columns) not in drawn:
            values = rng.uniform(-0.0346, 0.0346, size=(rows, columns)).astype(np.float32)
            drawn[(rows, columns)] = gguf.quants.quantize(values, qtype)
        return drawn[(rows, columns)]

    writer = gguf.GGUFWriter(str(out), "llama")
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
    writer.add_tensor("token_embd.weight", matrix(raw["vocab_size"], dims["h"]), raw_dtype=qtype)
    writer.add_tensor("output_norm.weight", norm)
    if not raw.get("tie_word_embeddings", False):
        writer.add_tensor("output.weight", matrix(raw["vocab_size"], dims["h"]), raw_dtype=qtype)
    for layer in range(raw["num_hidden_layers"]):
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", norm)
        writer.add_tensor(f"blk.{layer}.ffn_norm.weight", norm)
        for name, shape in _LAYER_TENSORS.items():
            writer.add_tensor(f"blk.{layer}.{name}", matrix(*shape(dims)), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path, help="a config.json (bench/configs/*.json)")
    parser.add_argument("out", type=Path, help="the .gguf to write")
    parser.add_argument("--type", default="Q8_0", choices=TYPES, help="type of the 2-D weights (default Q8_0)")
    args = parser.parse_args()
    write_dummy_gguf(args.config, args.out, args.type)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
