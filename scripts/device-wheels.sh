#!/usr/bin/env bash
# Build .whl/ (git-ignored): wheels of what specd needs at run time that the device machine
# lacks, for its Python 3.12 on x86-64 Linux, so `run` can carry them (docs/gpu.md).
#
#   scripts/device-wheels.sh     needs .venv (scripts/setup.sh): the versions carried are its versions
#
# What is carried: specd's runtime requirements and theirs, walked in .venv's metadata, without
# descending into what the device already has (its package list, tool library KINDS.md, is
# DEVICE_HAS below: torch 2.11, transformers 5.17 and their dependencies among them). grpcio
# and protobuf are there too, but in versions nobody has read, and specd's generated code
# refuses older ones than it was generated with (grpcio >= 1.85.1, protobuf >= 7.35.1), so
# they are carried as well. The whole working tree that travels (tracked and untracked files
# plus .whl) must stay under 64 MiB: the script prints the total and fails over it.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "device-wheels: run scripts/setup.sh first (the versions come from .venv)" >&2; exit 1; }

DEST=.whl
LIMIT=$((64 * 1024 * 1024))
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

# NAME==VERSION per line: the packages to carry.
mapfile -t wanted < <(.venv/bin/python - <<'EOF'
import importlib.metadata as md
import re

from packaging.requirements import Requirement

DEVICE_HAS = """
accelerate certifi charset-normalizer click filelock fsspec hf-xet huggingface-hub idna jinja2 markupsafe
mpmath networkx numpy packaging prometheus-client psutil pyyaml regex requests rich safetensors setuptools
sympy tokenizers torch tqdm transformers triton typing-extensions urllib3 uvloop wrapt zipp typer
shellingham markdown-it-py mdurl pygments anyio h11 httpcore httpx annotated-doc
""".split()
ALWAYS = {"grpcio", "protobuf"}  # there, but maybe older than the generated code accepts


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def applies(req: Requirement) -> bool:
    env = {"extra": "", "python_version": "3.12", "sys_platform": "linux", "platform_system": "Linux"}
    return req.marker is None or req.marker.evaluate(env)


have = {norm(n) for n in DEVICE_HAS} - ALWAYS
carry: dict[str, str] = {}
todo = [Requirement(r) for r in md.requires("specd") or []]
while todo:
    req = todo.pop()
    name = norm(req.name)
    if name in carry or name in have or not applies(req):
        continue
    dist = md.distribution(req.name)
    carry[name] = dist.version
    todo += [Requirement(r) for r in dist.requires or []]
for name, version in sorted(carry.items()):
    print(f"{name}=={version}")
EOF
)

rm -rf "$DEST"
mkdir -p "$DEST"
platform_args=()
for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
echo "device-wheels: ${#wanted[@]} packages: ${wanted[*]}"
.venv/bin/python -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp "${platform_args[@]}" -d "$DEST" "${wanted[@]}" 2>&1 |
  grep -v "is ignored: it is neither" || true
got=$(find "$DEST" -type f -name '*.whl' | wc -l)
[ "$got" -eq "${#wanted[@]}" ] || { echo "device-wheels: got $got wheels for ${#wanted[@]} packages" >&2; exit 1; }

wheels=$(du -cb "$DEST"/*.whl | tail -n 1 | cut -f1)
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
total=$((wheels + tree))
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
echo "device-wheels: $got wheels, $(mib "$wheels"); working tree $(mib "$tree"); together $(mib "$total") of the 64 MiB that may travel"
if [ "$total" -gt "$LIMIT" ]; then
  echo "device-wheels: over the limit by $(mib $((total - LIMIT)))" >&2
  exit 1
fi
