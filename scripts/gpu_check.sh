#!/usr/bin/env bash
# The one prepared device check (docs/gpu.md): everything it writes goes under $OUT.
#
#   OUT=DIR scripts/gpu_check.sh             on the GPU machine (under 10 minutes on an H200)
#   OUT=DIR scripts/gpu_check.sh --dry-run   every step on the CPU at tiny sizes (CI runs this)
#
# Steps, each timed, each run even when an earlier one failed (the exit status says if any did):
#   1. versions   torch / CUDA / transformers, and what differs from the pinned CPU versions
#   2. tests      the `device`-marked tests with SPECD_TEST_DEVICE=cuda: runner vs a full forward and
#                 vs the CPU (logits, KV crop/rollback, batched verify), sampler and rejection on
#                 CUDA tensors, chi-square cells, greedy parity through the three services (--device cuda)
#   3. measure    T(n)/T(1), n = 1..64, batch 1/8/32, of random-weight 8B-shape (bf16) and 1B-shape
#                 Llamas through specd's runner; its decode step against transformers' generate step
#   4. distill    `specd distill` against a random-weight model of the demo target's shape for
#                 GPU_CHECK_DISTILL_MINUTES (default 2) minutes; held-out top-1 agreement
#   5. summary    OUT/summary.json and OUT/h200-measured.json (the fitted sim profile)
# OUT then holds at most 7 files: gpu-check.log, summary.json, h200-measured.json, tests.xml,
# distill-summary.json, and the draft's non-embedding weights (draft-weights.safetensors,
# draft.json) when they fit the 16 MiB a file may have.
#
# A .whl folder (scripts/device-wheels.sh) is installed into /tmp/site first when specd's
# imports are missing (the device machine has no registry).
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: OUT=DIR scripts/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac
: "${OUT:?set OUT to the folder the results go to}"
mkdir -p "$OUT"
if [ -x .venv/bin/python ]; then PY=${PYTHON:-.venv/bin/python}; else PY=${PYTHON:-python3}; fi
WORK=$(mktemp -d -t gpu-check.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
exec > >(tee -a "$OUT/gpu-check.log") 2>&1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ "$DRY" = 1 ]; then DEVICE=cpu; FLAG=--dry-run; else DEVICE=cuda; FLAG=; fi

started=$SECONDS
failed=()
step() {  # step NAME TIMEOUT_S COMMAND...: run it, print its status and seconds
  local name=$1 limit=$2 t0=$SECONDS status
  shift 2
  echo "gpu_check: == $name"
  timeout --kill-after=10 "$limit" "$@"
  status=$?
  echo "gpu_check: $name: exit $status, $((SECONDS - t0)) s"
  [ "$status" -eq 0 ] || failed+=("$name")
}

if [ -d .whl ] && ! "$PY" -c "import gguf, opentelemetry.sdk, grpc_health, grpc_reflection" 2>/dev/null; then
  echo "gpu_check: installing the carried wheels (.whl) into /tmp/site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
    { echo "gpu_check: the carried wheels did not install" >&2; exit 1; }
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

step versions 60 "$PY" -c "
import torch, transformers
print('gpu_check: torch', torch.__version__, 'CUDA', torch.version.cuda, 'available', torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else '')
print('gpu_check: transformers', transformers.__version__, '(specd is tested on torch 2.13 / transformers 5.24 and 2.11 / 5.17;',
      'what differs: the forward cache argument and the LM head row mask, see specd/core/model/runner.py)')"

# The dry run takes the unit tier only (79 device-marked tests): on the CPU every device-marked
# test is the suite's own, which CI runs anyway; the dry run checks that this step runs and reports.
# Only the files that hold device-marked tests are collected: other test modules import dev-only
# packages (openai, cryptography) the device machine lacks, and one collection error stops pytest
# (the first GPU run, 2026-12-04, lost its tests step that way).
if [ "$DRY" = 1 ]; then TEST_LIMIT=300; TEST_ROOT=tests/unit; else TEST_LIMIT=240; TEST_ROOT=tests; fi
mapfile -t TEST_DIRS < <(grep -rlE --include='test_*.py' '^ *@pytest\.mark\.device|^pytestmark.*device' "$TEST_ROOT" | sort)
step tests "$TEST_LIMIT" env SPECD_TEST_DEVICE="$DEVICE" "$PY" -m pytest -q -m device -p no:cacheprovider \
  --junitxml="$WORK/tests.xml" -o junit_family=xunit1 \
  "${TEST_DIRS[@]}"

step measure 240 "$PY" -m specd.tools.gpu_check measure --work "$WORK" $FLAG

MINUTES=${GPU_CHECK_DISTILL_MINUTES:-2}
if [ "$DRY" = 1 ]; then
  DISTILL=(--device cpu --threads 1 --layers 1 --corpus-tokens 3000 --seq-len 64 --batch-size 4 --steps 6
    --eval-every 3 --checkpoint-every 1000 --warmup 2)
else
  DISTILL=(--device cuda --layers 2 --corpus-tokens 400000 --seq-len 256 --batch-size 32 --steps 1000000
    --train-minutes "$MINUTES" --eval-every 200 --checkpoint-every 1000000 --teacher-dtype bfloat16)
fi
step distill-target 120 "$PY" -m specd.tools.gpu_check distill-target --folder "$WORK/demo-shape-target" $FLAG
step distill $((120 + ${MINUTES%.*} * 60 + 60)) "$PY" -m specd.tools.entry distill --target "$WORK/demo-shape-target" \
  --out "$WORK/draft" --source stdlib --vocab 0 --no-progress "${DISTILL[@]}"

step summary 60 "$PY" -m specd.tools.gpu_check summary --work "$WORK" --out "$OUT" $FLAG
for f in "$WORK/tests.xml" "$WORK/draft/distill-summary.json"; do
  [ -f "$f" ] && cp "$f" "$OUT/"
done
LIMIT=$((16 * 1024 * 1024))  # bytes a file may have to come back from the device
for f in "$WORK/draft/compact/draft-weights.safetensors" "$WORK/draft/compact/draft.json"; do
  [ -f "$f" ] || continue
  size=$(stat -c %s "$f")
  if [ "$size" -le "$LIMIT" ]; then cp "$f" "$OUT/"; else echo "gpu_check: $(basename "$f") is $size bytes, over the 16 MiB a file may have: not brought back"; fi
done

if [ "${#failed[@]}" -eq 0 ]; then
  echo "gpu_check: ok in $((SECONDS - started)) s; results in $OUT"
else
  echo "gpu_check: FAILED steps: ${failed[*]} ($((SECONDS - started)) s); results so far in $OUT" >&2
  exit 1
fi
