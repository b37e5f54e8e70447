"""The C++ CPU ops (``pagedllm/csrc``) and their pure-torch references.

The ops are compiled when the package is built (``setup.py``), once per instruction-set
variant of ``pagedllm/cpu_isa.py``; ``native_ops()`` loads the variant this CPU runs best (or
the one ``PAGEDLLM_ISA`` names). Every op here has a torch formulation that computes the same
values (fp32 results agree up to summation order): the reference the tests compare against,
and the path ``PAGEDLLM_NATIVE_OPS=0`` asks for. The semantics mirror vLLM's ops of the same
names (``csrc/layernorm_kernels.cu``, ``pos_encoding_kernels.cu``, ``activation_kernels.cu``,
``cache_kernels.cu``); the arithmetic follows Hugging Face ``modeling_llama.py``.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from pagedllm import cpu_isa, envs
from pagedllm.config import KV_SCALE_BYTES

logger = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parent.parent
CSRC = PACKAGE_DIR / "csrc"
NATIVE_OPS_ENV = "PAGEDLLM_NATIVE_OPS"


class NativeOpsUnavailable(RuntimeError):
    """The C++ ops cannot be loaded; the message says why and how to fix it."""


def library_path(variant: cpu_isa.IsaVariant) -> Path:
    """The built library of ``variant``, ``pagedllm/_C_<name>.<python ABI tag>.so``.

    Raises:
        NativeOpsUnavailable: it was not built (a checkout used without ``pip install``).
    """
    found = sorted(PACKAGE_DIR.glob(f"_C_{variant.name}.*so"))
    if not found:
        raise NativeOpsUnavailable(
            f"pagedllm/_C_{variant.name}.*.so is not built; build the C++ ops with "
            f"`pip install --no-build-isolation -e .` in the checkout, or run {NATIVE_OPS_ENV}=0 for the torch path")
    return found[0]


@functools.lru_cache(maxsize=1)
def load_native_ops():
    """Load the C++ ops built for this CPU and return ``torch.ops.pagedllm``.

    One variant per process: every variant registers the same ``torch.ops.pagedllm``
    names, so a process that loaded one cannot load another (the tests run each variant in a
    subprocess).

    Raises:
        NativeOpsUnavailable: no variant runs on this CPU, ``PAGEDLLM_ISA`` names one it cannot
            run, the library is missing, or it was built from other sources than
            ``pagedllm/csrc`` (a checkout edited after its build).
    """
    try:
        variant = cpu_isa.select_variant()
    except ValueError as exc:
        raise NativeOpsUnavailable(str(exc)) from None
    torch.ops.load_library(str(library_path(variant)))
    built_isa, _, built_digest = torch.ops.pagedllm.build_info().partition(" ")
    if CSRC.is_dir() and built_digest != cpu_isa.sources_digest(str(CSRC)):
        raise NativeOpsUnavailable(
            f"pagedllm's C++ ops ({built_isa}) were built from other sources than {CSRC}; rebuild them "
            "with `pip install --no-build-isolation -e .`")
    logger.info("C++ ops: the %s build", built_isa)
    return torch.ops.pagedllm


def native_ops_error() -> Optional[str]:
    """Why the C++ ops cannot be used (None when they can, or when ``PAGEDLLM_NATIVE_OPS=0``
    asked for the torch path)."""
    if not envs.PAGEDLLM_NATIVE_OPS:
        return None
    try:
        load_native_ops()
    except (NativeOpsUnavailable, OSError, RuntimeError) as exc:
        return str(exc)
    return None


@functools.lru_cache(maxsize=1)
def native_ops():
    """The compiled ops (``torch.ops.pagedllm``), or None: with ``PAGEDLLM_NATIVE_OPS=0``, or
    where they cannot be loaded (one warning says why; ``pagedllm serve`` refuses to start
    then, see ``native_ops_error``).

    Raises:
        ValueError: ``PAGEDLLM_ISA`` names no variant, or one this CPU cannot run: a variant
            asked for by name is never replaced by the torch path without a word.
    """
    if not envs.PAGEDLLM_NATIVE_OPS:
        return None
    if envs.PAGEDLLM_ISA:
        cpu_isa.select_variant()
    error = native_ops_error()
    if error is not None:
        logger.warning("C++ ops unavailable (%s); using the pure-torch path", error)
        return None
    return load_native_ops()


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` in fp32 (Zhang & Sennrich 2019; HF ``LlamaRMSNorm``).

    Args: ``x`` ``[tokens, hidden]``, ``weight`` ``[hidden]``, both the compute dtype.
    """
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As ``rms_norm_torch``; returns a new ``[tokens, hidden]`` tensor."""
    ops = native_ops()
    return rms_norm_torch(x, weight, eps) if ops is None else ops.rms_norm(x, weight, eps)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` in place, then returns ``rms_norm(residual)`` (vLLM's fused_add_rms_norm)."""
    ops = native_ops()
    if ops is None:
        residual.add_(x)
        return rms_norm_torch(residual, weight, eps)
    return ops.add_rms_norm_(x, residual, weight, eps)


def rotary_embedding_torch_(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """Rotates q and k inside ``qkv`` in place (Su et al. 2021, "rotate half" layout as HF's).

    Args:
        qkv: ``[tokens, (num_q_heads + 2 * num_kv_heads) * head_dim]``, q then k then v.
        positions: ``[tokens]`` int64.
        cos, sin: ``[max_positions, rotary_dim]`` fp32; ``rotary_dim < head_dim`` rotates the
            first ``rotary_dim`` features of each head and passes the rest (partial rotary,
            HF ``apply_rotary_pos_emb`` of Phi-3).
    """
    tokens = qkv.shape[0]
    qk = qkv[:, :(num_q_heads + num_kv_heads) * head_dim].view(tokens, num_q_heads + num_kv_heads, head_dim)
    rotary_dim = cos.shape[1]
    qk = qk[..., :rotary_dim]
    c = cos[positions].to(qkv.dtype).unsqueeze(1)
    s = sin[positions].to(qkv.dtype).unsqueeze(1)
    half = rotary_dim // 2
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    qk.copy_(qk * c + rotated * s)


def rotary_embedding_(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      num_q_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """As ``rotary_embedding_torch_``. Partial rotary (``cos`` narrower than ``head_dim``) runs
    the torch formulation: the C++ op rotates whole heads.

    Raises:
        ValueError: a position outside ``[0, max_positions)`` (native path).
    """
    ops = native_ops()
    if ops is None or cos.shape[1] != head_dim:
        rotary_embedding_torch_(qkv, positions, cos, sin, num_q_heads, num_kv_heads, head_dim)
    else:
        ops.rotary_embedding_(qkv, positions, cos, sin, num_q_heads, num_kv_heads, head_dim)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``[tokens, 2 * d]`` (gate, up) -> ``silu(gate) * up`` ``[tokens, d]`` (SwiGLU, Shazeer 2020)."""
    ops = native_ops()
    if ops is None:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    return ops.silu_and_mul(x)


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """Rows of K or V as int8 cache rows (``kv_cache_dtype="int8"``).

    Symmetric per row: ``scale = max |x| / 127`` (fp32), ``code = round(x / scale)`` (half to
    even), the scale's 4 bytes appended. A row of zeros, or one holding NaN or infinity, gets
    codes 0 and its scale (0, NaN or infinity), so it reads back as zeros or NaN. The C++
    ``reshape_and_cache_`` writes the same bytes (tested bitwise).

    Args:
        x: ``[..., head_dim]`` float32 or bfloat16.

    Returns:
        ``[..., head_dim + 4]`` int8.
    """
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / 127
    usable = (scale > 0) & torch.isfinite(scale)
    codes = torch.round(x / torch.where(usable, scale, 1.0)).clamp_(-127, 127).masked_fill_(~usable, 0)
    return torch.cat([codes.to(torch.int8), scale.view(torch.int8)], dim=-1)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Int8 cache rows ``[..., head_dim + 4]`` as ``[..., head_dim]`` values ``code * scale``
    (computed in fp32, returned in ``dtype``)."""
    head_dim = rows.shape[-1] - KV_SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return (rows[..., :head_dim].float() * scale).to(dtype)


def reshape_and_cache_(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new K/V ``[tokens, num_kv_heads * head_dim]`` into their flat slots, in place.

    Args:
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, the dtype
            of key/value or bfloat16 for float32 key/value (rows rounded to nearest even); or
            int8 ``[..., head_dim + 4]``, each KV head's row quantized (``quantize_kv``).
        slot_mapping: ``[tokens]`` int64, ``block_id * block_size + offset``.

    Raises:
        ValueError: a slot outside the cache (native path).
    """
    ops = native_ops()
    if ops is None:
        num_kv_heads, row_width = key_cache.shape[2:]
        for new, cache in ((key, key_cache), (value, value_cache)):
            if cache.dtype == torch.int8:
                new = quantize_kv(new.reshape(new.shape[0], num_kv_heads, -1))
            cache.view(-1, num_kv_heads * row_width).index_copy_(
                0, slot_mapping, new.reshape(new.shape[0], -1).to(cache.dtype))
    else:
        ops.reshape_and_cache_(key, value, key_cache, value_cache, slot_mapping)
