"""GGUF's 4-bit blocks (``Q4_1``, ``Q4_K``) as pagedllm's ``Int4Weight``, without
dequantizing: both store ``W = scale * q + min`` per 32 consecutive weights of a row, the
layout of ``int4`` / ``w4a8`` (``layers/quantization/``), so a GGUF file's 4-bit weights load
as they are (``loader.load_prequantized_int4``).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.layers.quantization import Int4Weight


def int4_from_q4_1(blocks: np.ndarray, shape: tuple[int, int]) -> Int4Weight:
    """Codes, scales and mins of a GGUF ``Q4_1`` tensor, without dequantizing.

    A ``Q4_1`` block is 20 bytes for 32 consecutive weights of a row: fp16 ``d``, fp16 ``m``,
    16 bytes whose low nibbles are weights 0-15 and high nibbles weights 16-31;
    ``w = d * q + m`` (llama.cpp ``dequantize_row_q4_1``; ``gguf.quants.Q4_1``).

    Args:
        blocks: the tensor's raw bytes (any shape, uint8), ``N * K / 32`` blocks.
        shape: ``(N, K)`` in row-major (Hugging Face) order.
    """
    n, k = shape
    blocks = np.ascontiguousarray(blocks).view(np.uint8).reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    packed = blocks[:, 4:]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)
    return Int4Weight(torch.from_numpy(codes.reshape(n, k)),
                      torch.from_numpy(d.reshape(n, k // 32)), torch.from_numpy(m.reshape(n, k // 32)))


def int4_from_q4_k(blocks: np.ndarray, shape: tuple[int, int]) -> Int4Weight:
    """Codes, scales and mins of a GGUF ``Q4_K`` tensor, without dequantizing.

    A ``Q4_K`` super-block is 144 bytes for 256 weights: fp16 ``d`` and ``dmin``, 12 bytes of
    eight 6-bit sub-block scales ``sc`` and mins ``m``, then 128 bytes where byte ``i`` of the
    ``j``-th 32-byte run holds weight ``i`` of sub-block ``2j`` (low nibble) and ``2j + 1``
    (high nibble); ``w = (d * sc) * q - dmin * m`` per 32-weight sub-block (llama.cpp
    ``dequantize_row_q4_K``; ``gguf.quants.Q4_K``, whose scale unpacking is reused).
    """
    from gguf.quants import Q4_K

    n, k = shape
    blocks = np.ascontiguousarray(blocks).view(np.uint8).reshape(-1, 144)
    num_blocks = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    scales = d * sc.astype(np.float32)
    mins = -(dmin * m.astype(np.float32))
    packed = blocks[:, 16:].reshape(num_blocks, 4, 1, 32)
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=2)  # [blocks, 4, 2, 32]
    return Int4Weight(torch.from_numpy(codes.reshape(n, k)),
                      torch.from_numpy(scales.reshape(n, k // 32)), torch.from_numpy(mins.reshape(n, k // 32)))

