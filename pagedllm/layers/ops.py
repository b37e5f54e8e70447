"""The C++ CPU ops (``pagedllm/csrc``) and their pure-torch references.

``native_ops()`` builds ``paged_attention.cpp`` and ``fused_ops.cpp`` into one extension on
first use. Every op here has a torch formulation that computes the same values (fp32 results
agree up to summation order), used when the extension cannot be built and by the tests as the
reference. The semantics mirror vLLM's ops of the same names (``csrc/layernorm_kernels.cu``,
``pos_encoding_kernels.cu``, ``activation_kernels.cu``, ``cache_kernels.cu``); the arithmetic
follows Hugging Face ``modeling_llama.py``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedllm.config import KV_SCALE_BYTES

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = [CSRC / name for name in ("paged_attention.cpp", "prefill_attention.cpp", "fused_ops.cpp",
                                        "quant_gemm.cpp", "w8a8.cpp", "w4a8.cpp",
                                        "decoder_layer.cpp")]
HEADERS = [CSRC / "cpu_vec.h", CSRC / "ops.h"]


def cflags() -> list[str]:
    """The compiler flags: ``-march=native`` unless ``PAGEDLLM_MARCH`` names another target
    (the tests build ``x86-64-v3``, AVX2 without AVX-512, to run the portable code paths on a
    CPU that has AVX-512)."""
    return ["-O3", f"-march={os.environ.get('PAGEDLLM_MARCH', 'native')}", "-fopenmp"]



def _cpu_flags() -> str:
    """The CPU's feature flags (``/proc/cpuinfo``), or "" where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def build_directory() -> Path:
    """Where the extension is built: one folder per (sources, headers, their folder, flags,
    torch version, CPU flags) under torch's extension root (``$TORCH_EXTENSIONS_DIR``, default
    ``~/.cache/torch_extensions``).

    Two checkouts never rewrite each other's build files: ninja's build file names the sources
    by absolute path, so two checkouts of the same sources sharing a folder would rebuild on
    every switch (seen with several git worktrees: minutes of waiting on the build lock). A build
    made with ``-march=native`` on one CPU is never loaded on a CPU that lacks its instructions
    (a machine's disk can outlive its CPU model here).
    """
    from torch.utils import cpp_extension

    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(" ".join(cflags() + [torch.__version__, _cpu_flags(), str(SOURCES[0].parent.resolve())]).encode())
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
    return root / f"pagedllm_ops_{digest.hexdigest()[:16]}"


def _load_extension(directory: Path) -> None:
    """Build (or only load) the extension in ``directory`` under an ``flock``.

    torch guards a build with a ``lock`` file that stays behind when the building process is
    killed, and every later ``load`` then waits on it forever. The ``flock`` is released by the
    kernel when its holder dies, so a ``lock`` file found while holding it is such a leftover
    and is removed. A process that finds another one building says so, then waits for it.
    """
    import fcntl

    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "pagedllm.flock", "w") as guard:
        try:
            fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("another process is building pagedllm's C++ ops in %s; waiting for it", directory)
            fcntl.flock(guard, fcntl.LOCK_EX)
        stale = directory / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a build that was interrupted", stale)
            stale.unlink(missing_ok=True)
        cpp_extension.load(name=directory.name, sources=[str(s) for s in SOURCES], extra_cflags=cflags(),
                           extra_ldflags=["-fopenmp"], build_directory=str(directory),
                           is_python_module=False, verbose=False)


@functools.lru_cache(maxsize=1)
def native_ops():
    """The compiled ops (``torch.ops.pagedllm``), or None where they cannot be had.

    Compiled on first use by ``torch.utils.cpp_extension`` (ninja + the system C++ compiler,
    ``-O3 -march=native -fopenmp``) into ``build_directory()``, so later processes only load
    it; an interrupted build never blocks a later one (``_load_extension``).
    ``PAGEDLLM_NATIVE_OPS=0`` skips it. A failed build logs one warning and leaves the
    pure-torch paths, which compute the same results more slowly.
    """
    if os.environ.get("PAGEDLLM_NATIVE_OPS", "1") == "0":
        return None
    try:
        # pip installs ninja into the venv's bin, which is not on PATH unless it is activated.
        venv_bin = str(Path(sys.executable).parent)
        if venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
        _load_extension(build_directory())
        return torch.ops.pagedllm
    except Exception as exc:  # any build or load failure: the torch paths still work
        logger.warning("C++ ops unavailable (%s: %s); using the pure-torch path",
                       type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None


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
        cos, sin: ``[max_positions, head_dim]`` fp32.
    """
    tokens = qkv.shape[0]
    qk = qkv[:, :(num_q_heads + num_kv_heads) * head_dim].view(tokens, num_q_heads + num_kv_heads, head_dim)
    c = cos[positions].to(qkv.dtype).unsqueeze(1)
    s = sin[positions].to(qkv.dtype).unsqueeze(1)
    half = head_dim // 2
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    qk.copy_(qk * c + rotated * s)


def rotary_embedding_(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      num_q_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """As ``rotary_embedding_torch_``.

    Raises:
        ValueError: a position outside ``[0, max_positions)`` (native path).
    """
    ops = native_ops()
    if ops is None:
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
