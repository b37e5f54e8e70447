"""Checkpoints quantized by other tools: AWQ (AutoAWQ), GPTQ (GPTQModel / AutoGPTQ) and
compressed-tensors (llm-compressor), read into pagedllm's int4 / int8 weights without
dequantizing.

The method comes from ``config.json``'s ``quantization_config`` (vLLM's
``get_quant_config``; its ``quant_method`` names: ``awq``, ``gptq``, ``compressed-tensors``).
Every format stores ``W = s * (q - z)`` per group of ``G`` input features; pagedllm's int4
holds ``W = scales * codes + mins`` per group of 32 (``layers/quantization/``), so a
checkpoint group becomes ``G / 32`` groups with ``scales = s`` and ``mins = -z * s``. For the
16-bit scales these formats store, ``z * s`` and ``(q - z) * s`` are exact in fp32 (an 11-bit
significand times an integer below 2^5), so the weights pagedllm multiplies by are exactly
the checkpoint's values (the formats' own fp16 dequantization rounds them; see tests). The
8-bit formats become ``Int8Weight`` codes ``q - z`` (symmetric, so they fit int8).

Layouts, as ``W`` is ``[N, K]`` (out, in) and ``G`` the group size:

- AWQ ``version: gemm`` (AutoAWQ ``WQLinear_GEMM``; vLLM ``awq.py``): ``qweight`` int32
  ``[K, N / 8]``, eight 4-bit codes of consecutive output channels per int32, nibble ``i``
  holding channel ``[0, 2, 4, 6, 1, 3, 5, 7][i]`` of the eight; ``qzeros`` int32
  ``[K / G, N / 8]`` in the same order; ``scales`` fp16 ``[K / G, N]``.
- GPTQ (GPTQModel ``PackableQuantLinear``; vLLM ``gptq.py``): ``qweight`` int32
  ``[K * bits / 32, N]``, ``32 / bits`` codes of consecutive input features per int32, lowest
  bits first; ``qzeros`` int32 ``[groups, N * bits / 32]`` packed the same way along ``N``;
  ``scales`` fp16 ``[groups, N]``; ``g_idx`` int32 ``[K]``, the group of each input feature
  (with ``desc_act`` the groups follow the activation order, not ``k // G``).
  ``checkpoint_format: gptq`` (v1, the default) stores each zero point minus one,
  ``gptq_v2`` stores it as is.
- compressed-tensors ``pack-quantized`` (``compressed_tensors.compressors.pack_quantized``):
  ``weight_packed`` int32 ``[N, K / 8]``, eight codes of consecutive input features per int32,
  lowest bits first, each the signed value plus 8; ``weight_scale`` ``[N, K / G]``;
  ``weight_shape``; for ``symmetric: false`` a ``weight_zero_point`` packed the same way
  along ``N``; ``weight_g_idx`` for ``actorder: group``. ``int-quantized`` (W8A8):
  ``weight`` int8 ``[N, K]`` and ``weight_scale`` ``[N, 1]``. Its activations are quantized
  per token at run time in vLLM; pagedllm keeps them in fp32 (weight-only), so its outputs
  are those of the stored weights without that rounding.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from pagedllm.layers.quantization import CHECKPOINT_QUANTIZATION_METHODS, INT4_GROUP_SIZE, Int4Weight, Int8Weight

logger = logging.getLogger(__name__)

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds output channel AWQ_PACK_ORDER[i] of 8
# Tensors a quantized linear layer stores instead of ``weight``, by method.
_PARAMS = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx"),
}


@dataclass(frozen=True)
class CheckpointQuantization:
    """What ``checkpoint_quantization`` read from a ``quantization_config``.

    Attributes:
        method: ``"awq"``, ``"gptq"`` or ``"compressed-tensors"``.
        bits: 4 or 8.
        group_size: input features per scale; -1 for one per output channel.
        zero_offset: added to stored zero points (1 for GPTQ v1, else 0).
        format: compressed-tensors' ``pack-quantized`` / ``int-quantized``; else the method.
    """

    method: str
    bits: int
    group_size: int
    zero_offset: int = 0
    format: str = ""


def checkpoint_quantization(raw_config: dict, requested: Optional[str]) -> Optional[CheckpointQuantization]:
    """The quantization a Hugging Face ``config.json`` declares, checked against ``requested``
    (the ``quantization`` option), or None for an unquantized checkpoint.

    Raises:
        ValueError: naming the setting, for a ``quant_method`` or layout pagedllm cannot load
            exactly (3-bit, AWQ ``gemv``, a group size that is not a multiple of 32, ...), or
            when ``requested`` is a different method (or a checkpoint method and the folder
            is not quantized).
    """
    config = raw_config.get("quantization_config") or raw_config.get("compression_config")
    if config is None:
        if requested in CHECKPOINT_QUANTIZATION_METHODS:
            raise ValueError(f"quantization={requested!r} needs a checkpoint quantized with it, but "
                             "config.json has no quantization_config")
        return None
    method = str(config.get("quant_method", "")).lower().replace("_", "-")
    if method not in CHECKPOINT_QUANTIZATION_METHODS:
        raise ValueError(f"quantization_config quant_method {config.get('quant_method')!r} is not supported "
                         f"(supported: {', '.join(CHECKPOINT_QUANTIZATION_METHODS)})")
    if requested is not None and requested != method:
        raise ValueError(f"quantization={requested!r} does not match the checkpoint, which is quantized "
                         f"with {method!r} (quantization_config); pass {method!r} or leave it unset")
    if method == "awq":
        return _awq(config)
    if method == "gptq":
        return _gptq(config)
    return _compressed_tensors(config)


def _check_group_size(method: str, group_size) -> int:
    if not isinstance(group_size, int) or not (group_size == -1 or (group_size > 0 and group_size % INT4_GROUP_SIZE == 0)):
        raise ValueError(f"{method}: group_size {group_size!r} is not supported (a multiple of "
                         f"{INT4_GROUP_SIZE}, or -1 for per channel)")
    return group_size


def _awq(config: dict) -> CheckpointQuantization:
    bits = config.get("bits", config.get("w_bit"))
    if bits != 4:
        raise ValueError(f"awq: {bits}-bit weights are not supported (4 only)")
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"awq: version {version!r} is not supported (gemm only)")
    if not config.get("zero_point", True):
        raise ValueError("awq: zero_point=false is not supported")
    group_size = _check_group_size("awq", config.get("group_size", config.get("q_group_size", 128)))
    return CheckpointQuantization("awq", 4, group_size, format="awq")


def _gptq(config: dict) -> CheckpointQuantization:
    bits = config.get("bits")
    if bits not in (4, 8):
        raise ValueError(f"gptq: {bits}-bit weights are not supported (4 or 8)")
    if bits == 8 and not config.get("sym", True):
        raise ValueError("gptq: 8-bit with sym=false is not supported (pagedllm's int8 kernels have no zero point)")
    if config.get("lm_head"):
        raise ValueError("gptq: lm_head=true (a quantized LM head) is not supported")
    if config.get("dynamic"):
        raise ValueError("gptq: per-module 'dynamic' overrides are not supported")
    checkpoint_format = config.get("checkpoint_format") or "gptq"
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"gptq: checkpoint_format {checkpoint_format!r} is not supported (gptq, gptq_v2)")
    group_size = _check_group_size("gptq", config.get("group_size", 128))
    return CheckpointQuantization("gptq", bits, group_size, zero_offset=1 if checkpoint_format == "gptq" else 0,
                                  format=checkpoint_format)


def _compressed_tensors(config: dict) -> CheckpointQuantization:
    name = "compressed-tensors"
    if config.get("kv_cache_scheme"):
        raise ValueError(f"{name}: kv_cache_scheme is not supported")
    if (config.get("sparsity_config") or {}).get("format", "dense") not in ("dense", None):
        raise ValueError(f"{name}: sparsity_config {config['sparsity_config'].get('format')!r} is not supported")
    groups = list((config.get("config_groups") or {}).values())
    if not groups:
        raise ValueError(f"{name}: quantization_config has no config_groups")
    found = set()
    for group in groups:
        weights, inputs = group.get("weights") or {}, group.get("input_activations")
        form = group.get("format") or config.get("format")
        found.add((form, weights.get("num_bits"), weights.get("type"), weights.get("strategy"),
                   weights.get("group_size"), weights.get("symmetric", True), bool(inputs)))
        if inputs and (inputs.get("type") != "int" or not inputs.get("dynamic")):
            raise ValueError(f"{name}: input_activations {inputs!r} are not supported (dynamic int only)")
        if group.get("output_activations"):
            raise ValueError(f"{name}: output_activations are not supported")
    if len(found) > 1:
        raise ValueError(f"{name}: config_groups with different schemes are not supported: {sorted(map(str, found))}")
    form, bits, kind, strategy, group_size, symmetric, has_inputs = found.pop()
    if kind != "int":
        raise ValueError(f"{name}: weights of type {kind!r} are not supported (int)")
    if strategy not in ("group", "channel"):
        raise ValueError(f"{name}: weight strategy {strategy!r} is not supported (group, channel)")
    group_size = _check_group_size(name, group_size) if strategy == "group" else -1
    if form == "pack-quantized" and bits == 4 and not has_inputs:
        return CheckpointQuantization(name, 4, group_size, format=form)
    if form == "int-quantized" and bits == 8 and symmetric:
        if has_inputs:
            logger.warning("%s W8A8: activations stay fp32 here (weight-only int8); vLLM quantizes them "
                           "to int8 per token", name)
        return CheckpointQuantization(name, 8, group_size, format=form)
    raise ValueError(f"{name}: format {form!r} with {bits}-bit weights (symmetric={symmetric}) is not supported "
                     "(pack-quantized 4-bit W4A16, int-quantized symmetric 8-bit)")


def pop_quantized_modules(tensors: dict[str, torch.Tensor],
                          quant: CheckpointQuantization) -> dict[str, dict[str, torch.Tensor]]:
    """Take the quantized layers' tensors out of ``tensors`` (a checkpoint's, by name): module
    prefix (``model.layers.0.self_attn.q_proj``) -> its tensors by parameter name."""
    params = _PARAMS[quant.method]
    marker = "weight_scale" if quant.method == "compressed-tensors" else "qweight"
    prefixes = [name[:-len(marker) - 1] for name in tensors if name.endswith("." + marker)]
    modules = {}
    for prefix in prefixes:
        names = params + (("weight",) if quant.format == "int-quantized" else ())
        modules[prefix] = {p: tensors.pop(f"{prefix}.{p}") for p in names if f"{prefix}.{p}" in tensors}
    return modules


def weight_shape(parts: dict[str, torch.Tensor], quant: CheckpointQuantization) -> tuple[int, int]:
    """``(N, K)`` of a quantized layer from its tensors (``pop_quantized_modules``)."""
    if quant.method == "awq":
        return parts["qweight"].shape[1] * 8, parts["qweight"].shape[0]
    if quant.method == "gptq":
        return parts["qweight"].shape[1], parts["qweight"].shape[0] * 32 // quant.bits
    if quant.format == "int-quantized":
        return tuple(parts["weight"].shape)
    n, k = (int(d) for d in parts["weight_shape"])
    return n, k


def read_quantized_weight(parts: dict[str, torch.Tensor], quant: CheckpointQuantization) -> Int4Weight | Int8Weight:
    """One layer's tensors (``pop_quantized_modules``) as the weight pagedllm multiplies by,
    exactly ``s * (q - z)`` of the checkpoint (see the module docstring).

    Raises:
        ValueError: a dimension or ``g_idx`` pagedllm's groups cannot represent, or 8-bit
            codes ``q - z`` outside int8.
    """
    n, k = weight_shape(parts, quant)
    if k % INT4_GROUP_SIZE:
        raise ValueError(f"{quant.method}: in_features {k} is not a multiple of {INT4_GROUP_SIZE}")
    if quant.method == "awq":
        codes = _unpack_rows(parts["qweight"], 4)[:, _awq_unpack_index(n)].t()
        zeros = _unpack_rows(parts["qzeros"], 4)[:, _awq_unpack_index(n)].t()
        scales, g_idx = parts["scales"].t(), None
    elif quant.method == "gptq":
        codes = _unpack_rows(parts["qweight"].t(), quant.bits)            # [N, K]
        zeros = _unpack_rows(parts["qzeros"], quant.bits)[:, :n].t() + quant.zero_offset
        scales, g_idx = parts["scales"].t(), parts.get("g_idx")
    elif quant.format == "int-quantized":
        zero_point = parts.get("weight_zero_point")
        if zero_point is not None and bool(zero_point.ne(0).any()):
            raise ValueError("compressed-tensors int-quantized: nonzero weight_zero_point is not supported")
        codes, scales = parts["weight"].to(torch.int16), parts["weight_scale"].reshape(n, -1)
        zeros, g_idx = torch.zeros_like(scales, dtype=torch.int16), parts.get("weight_g_idx")
    else:
        codes = _unpack_rows(parts["weight_packed"], 4)[:, :k]
        scales, g_idx = parts["weight_scale"].reshape(n, -1), parts.get("weight_g_idx")
        packed_zeros = parts.get("weight_zero_point")
        zeros = (torch.full_like(scales, 8, dtype=torch.int16) if packed_zeros is None
                 else _unpack_rows(packed_zeros.t(), 4)[:, :n].t())
    group_size = k if quant.group_size == -1 else quant.group_size
    if scales.shape != (n, k // group_size) or zeros.shape != scales.shape:
        raise ValueError(f"{quant.method}: scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} do not "
                         f"match a [{n}, {k}] weight in groups of {group_size}")
    input_order = _input_order(g_idx, k, group_size)
    if input_order is not None:
        codes = codes[:, input_order]
    scales, zeros = scales.float(), zeros.float()
    repeat = group_size // INT4_GROUP_SIZE
    if quant.bits == 4:
        return Int4Weight(codes.to(torch.uint8).contiguous(), scales.repeat_interleave(repeat, dim=1).contiguous(),
                          (-(zeros * scales)).repeat_interleave(repeat, dim=1).contiguous(), input_order)
    signed = codes.to(torch.int16) - zeros.to(torch.int16).repeat_interleave(group_size, dim=1)
    if signed.min() < -128 or signed.max() > 127:
        raise ValueError(f"{quant.method}: 8-bit codes minus zero points leave int8 ({int(signed.min())}.."
                         f"{int(signed.max())})")
    scales = scales[:, 0] if quant.group_size == -1 else scales.repeat_interleave(repeat, dim=1)
    return Int8Weight(signed.to(torch.int8).contiguous(), scales.contiguous(), input_order)


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``[R, C]`` int32 holding ``32 / bits`` values each, lowest bits first -> ``[R, C * 32 / bits]``
    int16 values (unsigned)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    return values.reshape(packed.shape[0], -1).to(torch.int16)


def _awq_unpack_index(n: int) -> torch.Tensor:
    """Columns of the unpacked ``qweight`` in output-channel order: channel ``c`` of each run of
    8 sits at nibble ``AWQ_PACK_ORDER.index(c)``."""
    inverse = torch.tensor([AWQ_PACK_ORDER.index(c) for c in range(8)])
    return (torch.arange(0, n, 8)[:, None] + inverse).reshape(-1)


def _input_order(g_idx: Optional[torch.Tensor], k: int, group_size: int) -> Optional[torch.Tensor]:
    """None when ``g_idx`` is absent or ``k // group_size``; else the permutation that sorts the
    input features by group (stable), under which every group is a run of ``group_size``.

    Raises:
        ValueError: groups of unequal size (no permutation makes them runs).
    """
    if g_idx is None:
        return None
    g_idx = g_idx.long()
    expected = torch.arange(k) // group_size
    if torch.equal(g_idx, expected):
        return None
    order = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[order], expected):
        raise ValueError(f"g_idx does not split the {k} input features into groups of {group_size}")
    return order
