#!/usr/bin/env bash
# Serve benchmark at concurrency 1, 4 and 16 against our server (and any extra URLs given).
# Usage: benchmarks/serve_compare.sh [--dtype bfloat16] [EXTRA_URL...]
# e.g. a llama-server built from source in /tmp: benchmarks/serve_compare.sh http://127.0.0.1:8080
set -euo pipefail
cd "$(dirname "$0")/.."
DTYPE=float32
if [[ "${1:-}" == "--dtype" ]]; then DTYPE=$2; shift 2; fi
PORT=${PORT:-8123}
.venv/bin/dsinfer serve --port "$PORT" --dtype "$DTYPE" --max-num-seqs 32 > /tmp/dsinfer-bench-serve.log 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do sleep 1; done
for URL in "http://127.0.0.1:$PORT" "$@"; do
  for C in 1 4 16; do
    N=$(( C < 4 ? 16 : C * 4 ))
    echo "== $URL concurrency $C"
    .venv/bin/dsinfer bench serve --url "$URL" --concurrency "$C" --num-requests "$N" \
      --input-len 128 --output-len 128 --json "/tmp/bench-serve-c$C-$(echo "$URL" | tr -c 'a-z0-9' _).json"
  done
done
