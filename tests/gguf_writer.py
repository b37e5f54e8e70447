"""Writing a tiny transformers model as a GGUF file, as llama.cpp's converter
(convert_hf_to_gguf.py) lays one out, for the loader's GGUF tests (tests/test_model_families.py,
test_phi3.py, test_gemma2.py, test_moe_gguf.py): the hyper-parameters every converter writes,
and the file itself. Each test names its architecture's tensors and extra keys.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

# Hugging Face names of the tensors outside the layers -> GGUF names.
GGUF_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}


def hf_metadata(config, **extra) -> dict:
    """``GGUFWriter`` method name -> value for the hyper-parameters of transformers ``config``
    that ``TextModel.set_gguf_parameters`` writes for every architecture, plus ``extra``."""
    return {"add_block_count": config.num_hidden_layers,
            "add_context_length": config.max_position_embeddings,
            "add_embedding_length": config.hidden_size,
            "add_feed_forward_length": config.intermediate_size,
            "add_head_count": config.num_attention_heads,
            "add_head_count_kv": config.num_key_value_heads,
            "add_layer_norm_rms_eps": config.rms_norm_eps,
            "add_rope_freq_base": config.rope_parameters["rope_theta"],
            "add_vocab_size": config.vocab_size,
            **extra}


def write_gguf_file(path, arch: str, metadata: dict, tensors: Iterable[tuple[str, np.ndarray]],
                    tensor_types: dict | None = None) -> None:
    """A GGUF file at ``path``: ``general.architecture`` ``arch``, each ``metadata`` item as a
    call of that ``GGUFWriter`` method, and ``tensors`` (GGUF name, array in the HF layout:
    ``[out, in]``, experts ``[num_experts, out, in]``), fp32 unless ``tensor_types`` maps the
    name to a ``GGMLQuantizationType`` (encoded with ``gguf.quants.quantize``)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for method, value in metadata.items():
        getattr(writer, method)(value)
    for name, array in tensors:
        qtype = (tensor_types or {}).get(name, gguf.GGMLQuantizationType.F32)
        data = gguf.quants.quantize(np.asarray(array, dtype=np.float32), qtype)
        # F32/F16 come back as float arrays (the writer infers their type), the others as bytes.
        writer.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
