"""The instruction-set variants pagedllm's C++ ops are built in, and the choice among them.

``setup.py`` compiles ``pagedllm/csrc`` once per variant of ``VARIANTS`` into
``pagedllm/_C_<name>.*.so`` when the package is built (no compiler is needed at run time).
At run time ``select_variant`` takes the best one this CPU can execute, or the one that
``PAGEDLLM_ISA`` names. The kernels choose their vector paths at compile time from the
``__AVX512F__`` / ``__AVX512BW__`` / ``__AVX512VNNI__`` / ``__AVX512BF16__`` macros, so each
variant is one set of those macros. The split mirrors vLLM's CPU wheel (``_C_AVX2`` and
``_C_AVX512``) with two more AVX-512 levels, because VNNI (int8 dot products) and AVX512_BF16
each change a kernel.

This module imports nothing beyond the standard library: ``setup.py`` loads it before torch
or pagedllm can be imported.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

ISA_ENV = "PAGEDLLM_ISA"


@dataclass(frozen=True)
class IsaVariant:
    """One build of the C++ ops.

    Attributes:
        name: the suffix of its library, ``_C_<name>``, and the value ``PAGEDLLM_ISA`` takes.
        cpu_flags: the ``/proc/cpuinfo`` flags a CPU needs to execute it.
        cflags: the compiler's target flags for it (GCC >= 11 / Clang >= 12 spellings).
    """

    name: str
    cpu_flags: tuple[str, ...]
    cflags: tuple[str, ...]


_V3 = ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe")
_V4 = _V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")

# Lowest first. AMX is left out: no kernel uses it.
VARIANTS: tuple[IsaVariant, ...] = (
    IsaVariant("avx2", _V3, ("-march=x86-64-v3",)),
    IsaVariant("avx512", _V4, ("-march=x86-64-v4",)),
    IsaVariant("avx512_vnni", _V4 + ("avx512_vnni",), ("-march=x86-64-v4", "-mavx512vnni")),
    IsaVariant("avx512_bf16", _V4 + ("avx512_vnni", "avx512_bf16"),
               ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16")),
)


def built_variants() -> tuple[IsaVariant, ...]:
    """The variants ``setup.py`` builds on this machine's architecture: all on x86-64, none
    elsewhere (there the torch references run)."""
    return VARIANTS if platform.machine().lower() in ("x86_64", "amd64") else ()


def executable_variants(flags: frozenset[str] | None = None) -> list[IsaVariant]:
    """The built variants whose instructions ``flags`` (default: this CPU's) all include, lowest
    first."""
    if flags is None:
        # Imported here: setup.py runs this file alone, without the pagedllm package.
        from pagedllm.platform import cpu_flags

        flags = cpu_flags()
    return [v for v in built_variants() if set(v.cpu_flags) <= flags]


def select_variant(flags: frozenset[str] | None = None, requested: str | None = None) -> IsaVariant:
    """The variant to load: ``requested`` (default ``$PAGEDLLM_ISA``) if set, else the highest
    one the CPU executes.

    Raises:
        ValueError: ``requested`` names no variant, or one this CPU cannot execute (the missing
            flags are named); or the CPU executes none of them (not x86-64, or no AVX2).
    """
    if requested is None:
        # Imported here: setup.py runs this file alone, without the pagedllm package.
        from pagedllm import envs

        requested = envs.PAGEDLLM_ISA
    if flags is None:
        from pagedllm.platform import cpu_flags

        flags = cpu_flags()
    runnable = executable_variants(flags)
    if requested:
        known = {v.name: v for v in built_variants()}
        if requested not in known:
            raise ValueError(f"{ISA_ENV}={requested!r} names no variant built for "
                             f"{platform.machine()}; choose one of {sorted(known)}")
        variant = known[requested]
        if variant not in runnable:
            missing = sorted(set(variant.cpu_flags) - flags)
            raise ValueError(f"{ISA_ENV}={requested!r} needs CPU flags {missing}, which this CPU lacks; "
                             f"it can run {[v.name for v in runnable]}")
        return variant
    if not runnable:
        raise ValueError(f"no build of pagedllm's C++ ops runs on this CPU ({platform.machine()}; "
                         f"x86-64 with AVX2 and FMA is the lowest target)")
    return runnable[-1]


def sources_digest(csrc: str) -> str:
    """SHA-256 (hex) of the C++ sources in the folder ``csrc`` (every ``.cpp`` and ``.h``, by
    name and content): compiled into each library, so that a library built from other sources
    than those beside it is detected at load."""
    import hashlib

    digest = hashlib.sha256()
    for name in sorted(n for n in os.listdir(csrc) if n.endswith((".cpp", ".h"))):
        with open(os.path.join(csrc, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read())
    return digest.hexdigest()
