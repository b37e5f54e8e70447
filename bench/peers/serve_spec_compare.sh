#!/bin/bash
# Speculative decoding under load (issue 41: "no loss at 16 concurrent requests"): `vllm bench
# serve` against `pagedllm serve` without and with --speculative-config "$SPEC_CONFIG" (adaptive:
# disable_by_batch_size at its default), each server fresh, ROUNDS rounds of serve_compare.sh with
# the order swapped every round (pagedllm first in odd rounds, pagedllm-spec first in even ones).
# Prints each round's rows and then, per metric, both medians and spec / none. Benchmarks only.
#
#   bash bench/peers/serve_spec_compare.sh [DTYPE] [vllm bench serve options...]
#   ROUNDS=3 bash bench/peers/serve_spec_compare.sh bfloat16 --max-concurrency 16
#   SPEC_CONFIG='{"method": "suffix"}' bash bench/peers/serve_spec_compare.sh
#
# Client options default to --max-concurrency 16 (serve_compare.sh's workload: random 256-token
# prompts, 128 output tokens, 64 prompts, seed 0). Needs setup_vllm.sh's venv (the client) and
# exported model (the client's tokenizer); every serve_compare.sh variable applies (PAGEDLLM,
# PAGEDLLM_ARGS, MODEL_DIR, PORT, ...). Logs: $LOGS (default $PAGEDLLM_PEERS_DIR/serve-spec-logs)/DATE/roundN.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PEERS_DIR=${PAGEDLLM_PEERS_DIR:-${PAGEDLLM_CACHE_DIR:-$HOME/.cache/pagedllm}/peers}
DTYPE=${1:-bfloat16}; shift || true
[ $# -gt 0 ] || set -- --max-concurrency 16
ROUNDS=${ROUNDS:-3}
BASE=${LOGS:-$PEERS_DIR/serve-spec-logs}/$(date +%Y%m%d-%H%M%S)
export SPEC_CONFIG=${SPEC_CONFIG:-'{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'}

for round in $(seq 1 "$ROUNDS"); do
  order="pagedllm pagedllm-spec"
  [ $((round % 2)) -eq 0 ] && order="pagedllm-spec pagedllm"
  echo "=== round $round of $ROUNDS: $order"
  LOGS=$BASE/round$round SYSTEMS=$order bash "$HERE/serve_compare.sh" "$DTYPE" "$@"
done

echo "=== pagedllm without and with --speculative-config '$SPEC_CONFIG', client: $*"
python3 - "$BASE" "$ROUNDS" <<'EOF'
import statistics
import sys
from pathlib import Path

base, rounds = Path(sys.argv[1]), int(sys.argv[2])
metrics = ["Successful requests", "Output token throughput (tok/s)", "Total token throughput (tok/s)",
           "Median TTFT (ms)", "Median TPOT (ms)", "Mean TPOT (ms)"]
values = {"pagedllm": {}, "pagedllm-spec": {}}
for round_dir in sorted(base.glob("round*")):
    for system in values:
        path = round_dir / f"{system}.result"
        if not path.exists():
            print(f"{round_dir.name}: {system} has no result (see {round_dir}/{system}.log)")
            continue
        for line in path.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in metrics:
                values[system].setdefault(key.strip(), []).append(float(value))
print(f"{'':34} {'pagedllm':>28} {'pagedllm-spec':>28}   spec / none (medians)")
for metric in metrics:
    none, spec = values["pagedllm"].get(metric, []), values["pagedllm-spec"].get(metric, [])
    if not none or not spec:
        continue
    shown = [" ".join(f"{v:.1f}" for v in vs) for vs in (none, spec)]
    ratio = statistics.median(spec) / statistics.median(none) if statistics.median(none) else float("nan")
    print(f"{metric:34} {shown[0]:>28} {shown[1]:>28}   {ratio:.3f}")
print(f"({rounds} rounds; throughput: higher is better; TTFT / TPOT: lower is better)")
for round_dir in sorted(base.glob("round*")):
    path = round_dir / "pagedllm-spec.spec_metrics"
    counts = dict(line.split() for line in path.read_text().splitlines()) if path.exists() else {}
    drafts = float(counts.get("vllm:spec_decode_num_draft_tokens_total", 0))
    accepted = float(counts.get("vllm:spec_decode_num_accepted_tokens_total", 0))
    print(f"{round_dir.name} pagedllm-spec: {float(counts.get('vllm:spec_decode_num_drafts_total', 0)):.0f} drafts, "
          f"{drafts:.0f} draft tokens, {accepted:.0f} accepted"
          + (f" (acceptance rate {accepted / drafts:.2f})" if drafts else " (speculation never proposed)"))
EOF
