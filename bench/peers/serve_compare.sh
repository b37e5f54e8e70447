#!/bin/bash
# Serving side by side: `vllm bench serve` (vLLM's own client) against `pagedllm serve` and then
# `vllm serve` (and llama.cpp's `llama-server` if SYSTEMS names it), one at a time, same random
# workload (256 prompt / 128 output tokens, 64 prompts, seed 0), each server started fresh and
# killed after its run; a table of every system that ran at the end. Benchmarks only.
#
#   bash bench/peers/serve_compare.sh [DTYPE] [vllm bench serve options...]
#   bash bench/peers/serve_compare.sh bfloat16 --request-rate 2
#   bash bench/peers/serve_compare.sh bfloat16 --max-concurrency 16
#   PAGEDLLM_ARGS="--quantization w8a8" bash bench/peers/serve_compare.sh bfloat16 --max-concurrency 16
#   SYSTEMS="pagedllm vllm llama-server" bash bench/peers/serve_compare.sh bfloat16 --max-concurrency 16
#   SYSTEMS="pagedllm pagedllm-spec" bash bench/peers/serve_compare.sh bfloat16 --max-concurrency 16
#   MAX_MODEL_LEN=8192 bash bench/peers/serve_compare.sh bfloat16 --random-input-len 7680 \
#     --random-output-len 256 --num-prompts 32 --max-concurrency 8     # long documents
#
# MAX_MODEL_LEN (default 2048) is every server's max_model_len (llama-server: per slot).
# pagedllm-spec is `pagedllm serve` with PAGEDLLM_ARGS and --speculative-config "$SPEC_CONFIG"
# (default ngram, 5 tokens, adaptive: disable_by_batch_size left at its default);
# serve_spec_compare.sh alternates it with pagedllm.
# Needs setup_vllm.sh's venv and exported model (VLLM_VENV, MODEL_DIR below; by default under
# $PAGEDLLM_PEERS_DIR, itself $PAGEDLLM_CACHE_DIR/peers by default). Loopback only.
# llama-server (setup_llama_server.sh) serves LLAMA_GGUF (setup_llama_cpp.sh's q8_0 conversion of
# MODEL_DIR; DTYPE does not apply) with 16 slots of 2048 tokens; the client still tokenizes with
# MODEL_DIR.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
DTYPE=${1:-bfloat16}; shift || true
PEERS_DIR=${PAGEDLLM_PEERS_DIR:-${PAGEDLLM_CACHE_DIR:-$HOME/.cache/pagedllm}/peers}
VLLM_VENV=${VLLM_VENV:-$PEERS_DIR/vllm-venv}
MODEL_DIR=${MODEL_DIR:-$PEERS_DIR/smollm2-hf}
PORT=${PORT:-8311}
PAGEDLLM=${PAGEDLLM:-$ROOT/.venv/bin/pagedllm}
LOGS=${LOGS:-$PEERS_DIR/serve-logs}
SYSTEMS=${SYSTEMS:-pagedllm vllm}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-2048}
LLAMA_SERVER=${LLAMA_SERVER:-$PEERS_DIR/llama-server}
LLAMA_GGUF=${LLAMA_GGUF:-$PEERS_DIR/smollm2-q8_0.gguf}
SPEC_CONFIG=${SPEC_CONFIG:-'{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'}
mkdir -p "$LOGS"
export HF_HUB_OFFLINE=1

grep -m1 "model name" /proc/cpuinfo
echo "flags: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx512_bf16|avx512_vnni|avx_vnni|amx_bf16|amx_int8)$' | tr '\n' ' ')"
echo "systems: $SYSTEMS; dtype $DTYPE; max_model_len $MAX_MODEL_LEN; client options: $*; pagedllm options: ${PAGEDLLM_ARGS:-none}"
case " $SYSTEMS " in *" pagedllm-spec "*) echo "pagedllm-spec: --speculative-config '$SPEC_CONFIG'";; esac

descendants() {  # $1: pid; prints the ids of all its descendants
  local child
  for child in $(pgrep -P "$1"); do echo "$child"; descendants "$child"; done
}

start_server() {  # $1: system
  if [ "$1" = pagedllm ] || [ "$1" = pagedllm-spec ]; then
    local spec=()
    [ "$1" = pagedllm-spec ] && spec=(--speculative-config "$SPEC_CONFIG")
    "$PAGEDLLM" serve --port "$PORT" --dtype "$DTYPE" --kv-cache-memory-bytes 4294967296 \
      --max-model-len "$MAX_MODEL_LEN" \
      --served-model-name bench ${PAGEDLLM_ARGS:-} "${spec[@]}" > "$LOGS/$1.log" 2>&1 &
  elif [ "$1" = llama-server ]; then
    "$LLAMA_SERVER" -m "$LLAMA_GGUF" --host 127.0.0.1 --port "$PORT" -np 16 -c $((16 * MAX_MODEL_LEN)) \
      -t "$(nproc)" -cb --alias bench > "$LOGS/llama-server.log" 2>&1 &
  else
    env VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND="0-$(($(nproc) - 1))" \
      LD_PRELOAD="$(ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 2>/dev/null):$VLLM_VENV/lib/libiomp5.so" \
      "$VLLM_VENV/bin/vllm" serve "$MODEL_DIR" --served-model-name bench --port "$PORT" --dtype "$DTYPE" \
      --max-model-len "$MAX_MODEL_LEN" > "$LOGS/vllm.log" 2>&1 &
  fi
  SERVER=$!
  for _ in $(seq 1 600); do
    curl -s -o /dev/null -w "%{http_code}" "http://127.0.0.1:$PORT/v1/models" 2>/dev/null | grep -q 200 && return 0
    kill -0 "$SERVER" 2>/dev/null || return 1
    sleep 1
  done
  return 1
}

RAN=()
for system in $SYSTEMS; do
  echo "== $system (load average $(cut -d' ' -f1 /proc/loadavg))"
  if start_server "$system"; then
    "$VLLM_VENV/bin/vllm" bench serve --backend openai --base-url "http://127.0.0.1:$PORT" --model bench \
      --tokenizer "$MODEL_DIR" --dataset-name random --random-input-len 256 --random-output-len 128 \
      --num-prompts 64 --seed 0 "$@" 2>&1 | grep -E "Successful|duration|throughput|TTFT|TPOT" \
      | tee "$LOGS/$system.result"
    [ -s "$LOGS/$system.result" ] && RAN+=("$system")
    if [ "$system" = pagedllm-spec ]; then  # the proof that drafts were verified, and how many were accepted
      curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)_total' \
        | sed -E 's/\{[^}]*\}//' | tee "$LOGS/$system.spec_metrics"
    fi
  else
    echo "$system did not start; see $LOGS/$system.log"
  fi
  # The server and every process under it (vllm's engine core), by id, listed before any exits.
  PIDS="$SERVER $(descendants "$SERVER")"
  kill -TERM $PIDS 2>/dev/null
  for _ in $(seq 1 30); do kill -0 "$SERVER" 2>/dev/null || break; sleep 1; done
  kill -KILL $PIDS 2>/dev/null
  sleep 2
done

[ ${#RAN[@]} -gt 0 ] || exit 1
echo "== side by side"
(cd "$LOGS" && awk -F: 'FNR == 1 { n++; name[n] = FILENAME; sub(/\.result$/, "", name[n]) }
  { gsub(/^ +| +$/, "", $2); if (!($1 in seen)) { seen[$1] = 1; keys[++k] = $1 } v[$1, n] = $2 }
  END { printf "%-40s", ""; for (i = 1; i <= n; i++) printf " %14s", name[i]; print ""
        for (j = 1; j <= k; j++) { printf "%-40s", keys[j]; for (i = 1; i <= n; i++) printf " %14s", v[keys[j], i]; print "" } }' \
  "${RAN[@]/%/.result}")
