#!/usr/bin/env bash
# Builds llama.cpp's llama-server (the llama.cpp vendored in llama-cpp-python 0.3.36's source
# package, the same one setup_llama_cpp.sh builds) with GGML_NATIVE, statically linked, and
# copies it to OUT_DIR/llama-server, for serve_compare.sh (SYSTEMS=llama-server).
#   bash bench/peers/setup_llama_server.sh [OUT_DIR]   (default $PAGEDLLM_PEERS_DIR, itself
#   $PAGEDLLM_CACHE_DIR/peers by default; 20+ minutes on 2 cores)
# Env: PIP (default OUT_DIR/llama-venv/bin/pip, setup_llama_cpp.sh's venv) downloads the source
# package and, if there is no cmake on PATH, installs cmake beside itself.
# No network at build time: no curl/openssl, no prebuilt web UI download (the UI is left empty).
set -euo pipefail
OUT=${1:-${PAGEDLLM_PEERS_DIR:-${PAGEDLLM_CACHE_DIR:-$HOME/.cache/pagedllm}/peers}}
VERSION=0.3.36
PIP=${PIP:-$OUT/llama-venv/bin/pip}
WORK=$(mktemp -d)
mkdir -p "$OUT"
"$PIP" download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK"
tar xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
CMAKE=$(command -v cmake || true)
if [ -z "$CMAKE" ]; then "$PIP" install cmake; CMAKE=$(dirname "$PIP")/cmake; fi
# LLAMA_CURL is deprecated (no effect) in this version; LLAMA_OPENSSL and LLAMA_USE_PREBUILT_UI
# are what would reach the network.
"$CMAKE" -S "$SRC" -B "$SRC/build" -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF \
  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
nice -n 19 "$CMAKE" --build "$SRC/build" --target llama-server -j "${JOBS:-2}"
cp "$SRC/build/bin/llama-server" "$OUT/llama-server"
rm -rf "$WORK"
"$OUT/llama-server" --help | head -n 3
echo "llama-server: $OUT/llama-server"
