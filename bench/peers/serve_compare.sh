#!/bin/bash
# Serving side by side: `vllm bench serve` (vLLM's own client) against `pagedllm serve` and then
# `vllm serve`, never both at once, same random workload (256 prompt / 128 output tokens, 64
# prompts, seed 0), each server started fresh and killed after its run. Benchmarks only.
#
#   bash bench/peers/serve_compare.sh [DTYPE] [vllm bench serve options...]
#   bash bench/peers/serve_compare.sh bfloat16 --request-rate 2
#   bash bench/peers/serve_compare.sh bfloat16 --max-concurrency 16
#   PAGEDLLM_ARGS="--quantization w8a8" bash bench/peers/serve_compare.sh bfloat16 --max-concurrency 16
#
# Needs setup_vllm.sh's venv and exported model (VLLM_VENV, MODEL_DIR below). Loopback only.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
DTYPE=${1:-bfloat16}; shift || true
VLLM_VENV=${VLLM_VENV:-/tmp/peers/vllm-venv}
MODEL_DIR=${MODEL_DIR:-/tmp/peers/smollm2-hf}
PORT=${PORT:-8311}
PAGEDLLM=${PAGEDLLM:-$ROOT/.venv/bin/pagedllm}
LOGS=${LOGS:-/tmp/peers/serve-logs}
mkdir -p "$LOGS"
export HF_HUB_OFFLINE=1

grep -m1 "model name" /proc/cpuinfo
echo "flags: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx512_bf16|avx512_vnni|avx_vnni|amx_bf16|amx_int8)$' | tr '\n' ' ')"
echo "dtype $DTYPE; client options: $*; pagedllm options: ${PAGEDLLM_ARGS:-none}"

start_server() {  # $1: system
  if [ "$1" = pagedllm ]; then
    "$PAGEDLLM" serve --port "$PORT" --dtype "$DTYPE" --kv-cache-memory-bytes 4294967296 \
      --served-model-name bench ${PAGEDLLM_ARGS:-} > "$LOGS/pagedllm.log" 2>&1 &
  else
    env VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND="0-$(($(nproc) - 1))" \
      LD_PRELOAD="$(ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 2>/dev/null):$VLLM_VENV/lib/libiomp5.so" \
      "$VLLM_VENV/bin/vllm" serve "$MODEL_DIR" --served-model-name bench --port "$PORT" --dtype "$DTYPE" \
      --max-model-len 2048 > "$LOGS/vllm.log" 2>&1 &
  fi
  SERVER=$!
  for _ in $(seq 1 600); do
    curl -s -o /dev/null -w "%{http_code}" "http://127.0.0.1:$PORT/v1/models" 2>/dev/null | grep -q 200 && return 0
    kill -0 "$SERVER" 2>/dev/null || return 1
    sleep 1
  done
  return 1
}

for system in pagedllm vllm; do
  echo "== $system (load average $(cut -d' ' -f1 /proc/loadavg))"
  if start_server "$system"; then
    "$VLLM_VENV/bin/vllm" bench serve --backend openai --base-url "http://127.0.0.1:$PORT" --model bench \
      --tokenizer "$MODEL_DIR" --dataset-name random --random-input-len 256 --random-output-len 128 \
      --num-prompts 64 --seed 0 "$@" 2>&1 | grep -E "Successful|duration|throughput|TTFT|TPOT"
  else
    echo "$system did not start; see $LOGS/$system.log"
  fi
  pkill -TERM -P "$SERVER" 2>/dev/null; kill -TERM "$SERVER" 2>/dev/null
  for _ in $(seq 1 30); do kill -0 "$SERVER" 2>/dev/null || break; sleep 1; done
  kill -KILL "$SERVER" 2>/dev/null; pkill -KILL -f -- "--port $PORT" 2>/dev/null
  sleep 2
done
