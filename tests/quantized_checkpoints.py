"""Write AWQ, GPTQ and compressed-tensors checkpoints of a float Llama (test data; no hub here).

The maintained quantizers cannot run in this environment: ``gptqmodel==7.7.0`` and
``autoawq`` pull a CUDA torch (``pip install --dry-run`` replaces torch 2.13.0 with 2.14.1 /
adds triton), ``llmcompressor==0.14.0.1`` downgrades transformers to 5.17.0.
``compressed-tensors==0.20.0`` installs cleanly, so:

- compressed-tensors checkpoints are made by the library itself: its ``calculate_qparams``
  (min/max round-to-nearest, what llm-compressor's ``QuantizationModifier`` does without
  GPTQ) and its compressors' ``compress`` write ``weight_packed`` / ``weight`` and the
  config is its ``QuantizationConfig``; the reference weights are its ``decompress``;
- AWQ and GPTQ are packed here from their public specifications (AutoAWQ
  ``awq/modules/linear/gemm.py: WQLinear_GEMM.from_linear``, order map ``[0, 2, 4, 6, 1, 3, 5,
  7]``; GPTQModel ``gptqmodel/nn_modules/qlinear/__init__.py: PackableQuantLinear.pack``, rows
  of ``32 / bits`` codes, zeros stored minus one in the v1 format), with round-to-nearest
  codes (the GPTQ/AWQ search only changes which codes are stored, not how). The AWQ
  reference goes through the library's own ``AutoAWQConverter`` (AWQ -> compressed-tensors,
  contributed by the vLLM project) and ``decompress``; the GPTQ reference is
  ``s * (q - z)`` of the integers given to the packer.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from pagedllm.models.llama import LlamaConfig

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _to_int32(values: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) as the int32 of the same bits."""
    return torch.from_numpy(values.numpy().astype(np.uint32).view(np.int32))


def round_to_nearest(weight: torch.Tensor, bits: int, g_idx: torch.Tensor, sym: bool):
    """Codes ``q`` ``[N, K]`` in ``[0, 2^bits)``, zeros ``z`` and fp16 scales ``s`` ``[N, groups]``
    of min/max round-to-nearest over the groups ``g_idx`` (``[K]``, equal-sized) gives each
    input feature (GPTQ's ``Quantizer``: ``sym`` puts the zero at ``2^(bits-1)``)."""
    maxq = 2 ** bits - 1
    n, k = weight.shape
    order = torch.argsort(g_idx, stable=True)
    groups = weight[:, order].view(n, int(g_idx.max()) + 1, -1)
    lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    if sym:
        hi = torch.maximum(lo.abs(), hi)
        s = (2 * hi / maxq).clamp(min=1e-5).half()
        z = torch.full(s.shape, (maxq + 1) // 2, dtype=torch.int64)
    else:
        s = ((hi - lo) / maxq).clamp(min=1e-5).half()
        z = torch.round(-lo / s.float()).long().clamp(0, maxq)
    codes = (torch.round(groups / s.float()[..., None]).long() + z[..., None]).clamp(0, maxq).view(n, k)
    q = torch.empty_like(codes)
    q[:, order] = codes
    return q, z, s


def pack_awq(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM tensors of ``W[n, k] = s[n, k // G] * (q - z)``."""
    def pack(values):  # [R, N] -> [R, N / 8], nibble i = column AWQ_PACK_ORDER[i] of each 8
        runs = values.view(values.shape[0], -1, 8)
        return _to_int32(sum(runs[..., AWQ_PACK_ORDER[i]] << (4 * i) for i in range(8)))
    return {"qweight": pack(q.t().contiguous()), "qzeros": pack(z.t().contiguous()), "scales": s.t().contiguous()}


def pack_gptq(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, g_idx: torch.Tensor, bits: int,
              v1: bool) -> dict[str, torch.Tensor]:
    """GPTQ tensors (``checkpoint_format`` gptq when ``v1``: zeros stored minus one, wrapped to
    ``bits`` bits as GPTQModel's packer does; else gptq_v2)."""
    per_word = 32 // bits

    def pack_rows(values):  # [R, C] -> [R / per_word, C], value j of a word at bits * j
        runs = values.view(-1, per_word, values.shape[1])
        return _to_int32(sum(runs[:, j] << (bits * j) for j in range(per_word)))

    zeros = (z - 1) & (2 ** bits - 1) if v1 else z
    return {"qweight": pack_rows(q.t().contiguous()), "qzeros": pack_rows(zeros.contiguous()).t().contiguous(),
            "scales": s.t().contiguous(), "g_idx": g_idx.to(torch.int32)}


def _ct_scheme(fmt: str, sym: bool, group_size: int):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    if fmt == "pack-quantized":
        weights = QuantizationArgs(num_bits=4, type="int", symmetric=sym, strategy="group", group_size=group_size)
        return QuantizationScheme(targets=["Linear"], weights=weights)
    weights = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    inputs = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)


def _ct_compressor(fmt: str):
    from compressed_tensors.compressors import BaseCompressor

    return type(BaseCompressor.load_from_registry(fmt))


def write_checkpoint(folder: Path, config: LlamaConfig, state_dict: dict[str, torch.Tensor], method: str,
                     bits: int = 4, group_size: int = 128, sym: bool = False, desc_act: bool = False,
                     v1: bool = True, fmt: str = "pack-quantized",
                     tokenizer_folder: Optional[Path] = None) -> dict[str, torch.Tensor]:
    """Write ``folder`` (config.json, model.safetensors) with the decoder layers' linears
    quantized by ``method``; everything else is stored in fp32 as given.

    Returns:
        The fp32 state dict whose quantized weights are the format library's dequantization
        (fp32 scales; see the module docstring), for a float reference model.
    """
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors, reference = {}, {}
    for name, weight in state_dict.items():
        if not name.endswith(".weight") or not any(name.endswith(lin + ".weight") for lin in LINEARS):
            tensors[name] = reference[name] = weight.float().contiguous()
            continue
        prefix = name[:-len(".weight")]
        weight = weight.float()
        n, k = weight.shape
        if method == "compressed-tensors":
            parts, dequantized = _compressed_tensors_layer(weight, fmt, sym, group_size)
        else:
            # Act-order: one permutation per layer input, as GPTQ derives it from the input's
            # Hessian (shared by q/k/v and by gate/up).
            shared = prefix.rsplit(".", 1)[0] + {"q": "qkv", "k": "qkv", "v": "qkv", "g": "gu", "u": "gu"}.get(
                prefix.rsplit(".", 1)[1][0], prefix)
            perm = torch.randperm(k, generator=torch.Generator().manual_seed(zlib.crc32(shared.encode()))) if desc_act \
                else torch.arange(k)
            group = k if group_size == -1 else group_size
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[perm] = torch.arange(k) // group
            q, z, s = round_to_nearest(weight, bits, g_idx, sym)
            if method == "awq":
                parts = pack_awq(q, z, s)
                dequantized = _awq_library_dequantize(parts, bits, group_size)
            else:
                parts = pack_gptq(q, z, s, g_idx, bits, v1)
                dequantized = s.float()[:, g_idx] * (q - z[:, g_idx]).float()
        tensors.update({f"{prefix}.{p}": t for p, t in parts.items()})
        reference[name] = dequantized
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    quantization_config = _quantization_config(method, bits, group_size, sym, desc_act, v1, fmt)
    (folder / "config.json").write_text(json.dumps(hf_config(config, quantization_config), indent=2))
    if tokenizer_folder is not None:
        for file in tokenizer_folder.iterdir():
            if file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                (folder / file.name).write_bytes(file.read_bytes())
    return reference


def _compressed_tensors_layer(weight, fmt, sym, group_size):
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = _ct_scheme(fmt, sym, group_size)
    n, k = weight.shape
    weight16 = weight.half()  # llm-compressor stores scales in the model's dtype
    grouped = weight16.view(n, -1, group_size) if fmt == "pack-quantized" else weight16.view(n, 1, k)
    scale, zero_point = calculate_qparams(grouped.amin(-1), grouped.amax(-1), scheme.weights)
    compressor = _ct_compressor(fmt)
    state = {"weight": weight16, "weight_scale": scale, "weight_zero_point": zero_point}
    parts = compressor.compress(state, scheme)
    # The library's dequantization, with its scales widened to fp32 (see the test module).
    decompressed = compressor.decompress({**parts, "weight_scale": parts["weight_scale"].float()}, scheme)
    return parts, decompressed["weight"].float()


def _awq_library_dequantize(parts, bits, group_size):
    """AutoAWQ tensors -> compressed-tensors (``AutoAWQConverter``) -> ``decompress``, fp32 scales."""
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    converter = AutoAWQConverter(bits=bits, group_size=group_size, zero_point=True)
    converted = converter.process({f"m.{p}": t for p, t in parts.items()})
    scheme = converter._build_quant_config().config_groups["config_group_0"]
    local = {p[2:]: t for p, t in converted.items()}
    local["weight_scale"] = local["weight_scale"].float()
    return _ct_compressor("pack-quantized").decompress(local, scheme)["weight"].float()


def _quantization_config(method, bits, group_size, sym, desc_act, v1, fmt) -> dict:
    if method == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act,
                "sym": sym, "lm_head": False, "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig(config_groups={"group_0": _ct_scheme(fmt, sym, group_size)}, format=fmt,
                                ignore=["lm_head"], quantization_status="compressed")
    return json.loads(json.dumps(config.model_dump(), default=str))


def hf_config(config: LlamaConfig, quantization_config: Optional[dict]) -> dict:
    """A transformers ``LlamaConfig`` dict for ``config`` (+ ``quantization_config``)."""
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
           "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
           "num_hidden_layers": config.num_hidden_layers, "num_attention_heads": config.num_attention_heads,
           "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
           "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
           "max_position_embeddings": config.max_position_embeddings,
           "tie_word_embeddings": config.tie_word_embeddings, "bos_token_id": config.bos_token_id,
           "eos_token_id": config.eos_token_id, "torch_dtype": "float32"}
    if quantization_config is not None:
        raw["quantization_config"] = quantization_config
    return raw
