"""The basic C++ CPU ops (``pagedllm/csrc``) and their pure-torch references.

Each op is a ``CustomOp`` (``layers/custom_op.py``): called like a function, it runs the C++
op where the library is loaded and its torch formulation otherwise (``PAGEDLLM_NATIVE_OPS=0``),
chosen once; ``op.forward_native`` / ``op.forward_cpu`` run one path explicitly (the tests
compare the two). Both compute the same values (fp32 results agree up to summation order).
The semantics mirror vLLM's ops of the same names (``csrc/layernorm_kernels.cu``,
``pos_encoding_kernels.cu``, ``activation_kernels.cu``, ``cache_kernels.cu``); the arithmetic
follows Hugging Face ``modeling_llama.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.config import KV_SCALE_BYTES
from pagedllm.layers.custom_op import CustomOp
# The library itself, for callers that ask for it by this module (pagedllm serve's check, tests).
from pagedllm.layers.custom_op import native_ops as native_ops, native_ops_error as native_ops_error


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` in fp32 (Zhang & Sennrich 2019; HF ``LlamaRMSNorm``).

    Args: ``x`` ``[tokens, hidden]``, ``weight`` ``[hidden]``, both the compute dtype.
    """
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm_torch_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` in place, then returns ``rms_norm(residual)`` (vLLM's fused_add_rms_norm)."""
    residual.add_(x)
    return rms_norm_torch(residual, weight, eps)


# ``rms_norm(x, weight, eps)``: a new ``[tokens, hidden]`` tensor.
rms_norm = CustomOp("rms_norm", rms_norm_torch)
add_rms_norm_ = CustomOp("add_rms_norm_", add_rms_norm_torch_)


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


class RotaryEmbeddingOp(CustomOp):
    """``rotary_embedding_(qkv, positions, cos, sin, num_q_heads, num_kv_heads, head_dim)``, as
    ``rotary_embedding_torch_``. Partial rotary (``cos`` narrower than ``head_dim``) runs the
    torch formulation: the C++ op rotates whole heads.

    Raises:
        ValueError: a position outside ``[0, max_positions)`` (C++ op).
    """

    def __init__(self) -> None:
        super().__init__("rotary_embedding_")

    def forward_native(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       num_q_heads: int, num_kv_heads: int, head_dim: int) -> None:
        rotary_embedding_torch_(qkv, positions, cos, sin, num_q_heads, num_kv_heads, head_dim)

    def forward_cpu(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    num_q_heads: int, num_kv_heads: int, head_dim: int) -> None:
        if cos.shape[1] != head_dim:
            rotary_embedding_torch_(qkv, positions, cos, sin, num_q_heads, num_kv_heads, head_dim)
        else:
            torch.ops.pagedllm.rotary_embedding_(qkv, positions, cos, sin, num_q_heads, num_kv_heads, head_dim)


rotary_embedding_ = RotaryEmbeddingOp()


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """``[tokens, 2 * d]`` (gate, up) -> ``silu(gate) * up`` ``[tokens, d]`` (SwiGLU, Shazeer 2020)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


silu_and_mul = CustomOp("silu_and_mul", silu_and_mul_torch)


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


def reshape_and_cache_torch_(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new K/V ``[tokens, num_kv_heads * head_dim]`` into their flat slots, in place.

    Args:
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, the dtype
            of key/value or bfloat16 for float32 key/value (rows rounded to nearest even); or
            int8 ``[..., head_dim + 4]``, each KV head's row quantized (``quantize_kv``).
        slot_mapping: ``[tokens]`` int64, ``block_id * block_size + offset``.

    Raises:
        ValueError: a slot outside the cache (C++ op).
    """
    num_kv_heads, row_width = key_cache.shape[2:]
    for new, cache in ((key, key_cache), (value, value_cache)):
        if cache.dtype == torch.int8:
            new = quantize_kv(new.reshape(new.shape[0], num_kv_heads, -1))
        cache.view(-1, num_kv_heads * row_width).index_copy_(
            0, slot_mapping, new.reshape(new.shape[0], -1).to(cache.dtype))


reshape_and_cache_ = CustomOp("reshape_and_cache_", reshape_and_cache_torch_)


class ArgmaxLogsumexpOp(CustomOp):
    """``argmax_logsumexp(logits)``: per row of fp32 ``[rows, vocab]`` logits, the index of the
    largest (the first of ties; ``torch.argmax``'s rule for NaN) and ``logsumexp``, as
    ``([rows] int64, [rows] fp32)``. The C++ op (``csrc/fused_ops.cpp``) reads the row once for
    both; it takes rows of unit stride, others run the torch formulation.
    """

    def __init__(self) -> None:
        super().__init__("argmax_logsumexp")

    def forward_native(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return logits.argmax(dim=-1), logits.logsumexp(dim=-1)

    def forward_cpu(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if logits.stride(-1) != 1:
            return self.forward_native(logits)
        return torch.ops.pagedllm.argmax_logsumexp(logits)


argmax_logsumexp = ArgmaxLogsumexpOp()
