#!/usr/bin/env bash
# Set up, then run the main job: the three services on the demo pair
# (`specd up`) and one Generate call (`specd generate`), then stop them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/specd prepare
PORT=${SPECD_PORT:-50051}
LOG=$(mktemp -t specd-up.XXXXXX)
.venv/bin/specd up --port "$PORT" >"$LOG" 2>&1 &
UP=$!
trap 'kill -TERM $UP 2>/dev/null; wait $UP 2>/dev/null; rm -f "$LOG"' EXIT
for _ in $(seq 600); do
  grep -q "coordinator listening on" "$LOG" && break
  kill -0 $UP 2>/dev/null || { cat "$LOG"; echo "demo: specd up failed" >&2; exit 1; }
  sleep 1
done
grep "coordinator listening on" "$LOG"
PROMPT=${1:-"Write a haiku about speculative decoding."}
echo "> $PROMPT"
.venv/bin/specd generate --address "127.0.0.1:$PORT" --chat --temperature 0 --max-new-tokens 64 --stream "$PROMPT"
.venv/bin/specd generate --address "127.0.0.1:$PORT" --chat --temperature 0 --max-new-tokens 64 --json "$PROMPT"
