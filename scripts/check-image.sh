#!/usr/bin/env bash
# Build the CPU image and run the real thing from it: the three services as the
# image's own user (10001), one Generate call with speculation, and greedy
# parity with target-only. Exits non-zero when any step fails.
#
#   bash scripts/check-image.sh            # build, then run
#   SPECD_SKIP_BUILD=1 bash scripts/check-image.sh   # run the image already built
#
# Needs root with podman, buildah and debootstrap (Debian packages:
# apt-get install podman buildah debootstrap). Works without a container
# registry: the base image is a Debian bookworm made by debootstrap and
# imported, and torch comes from a local package index (PEP 503) served on
# 127.0.0.1 from the wheel pip picks here. Not part of the test suite (it
# takes tens of minutes the first time).
#
# The services run with `buildah run --isolation chroot --network host`,
# because `podman run` cannot set rlimits on some machines (this one).
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${SPECD_IMAGE:-localhost/specd:check-cpu}
BASE=${SPECD_BASE_IMAGE:-localhost/bookworm:base}
WORK=${SPECD_CHECK_DIR:-/var/tmp/specd-check-image}
MIRROR=${SPECD_DEBIAN_MIRROR:-http://deb.debian.org/debian}
TORCH_VERSION=${SPECD_TORCH_VERSION:-2.13.0}
CA_BUNDLE=${SPECD_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
PYTHON=${PYTHON:-python3}
READY_S=${SPECD_READY_S:-600}
PROMPT=${SPECD_PROMPT:-"Write a haiku about speculative decoding."}
TOKENS=${SPECD_TOKENS:-24}

say() { printf 'check-image: %s\n' "$*"; }
fail() { printf 'check-image: FAIL: %s\n' "$*" >&2; exit 1; }

for tool in podman buildah; do
  command -v "$tool" >/dev/null || fail "$tool is missing (apt-get install podman buildah debootstrap)"
done
mkdir -p "$WORK"

# ---- 1. base image: Debian bookworm from debootstrap ------------------------------------------
if ! podman image exists "$BASE"; then
  command -v debootstrap >/dev/null || fail "debootstrap is missing (apt-get install debootstrap)"
  say "making the base image $BASE with debootstrap from $MIRROR"
  rm -rf "$WORK/rootfs"
  debootstrap --variant=minbase bookworm "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
    || fail "debootstrap failed; see $WORK/debootstrap.log"
  tar -C "$WORK/rootfs" -c . | podman import - "$BASE" >/dev/null
  rm -rf "$WORK/rootfs"
fi

# ---- 2. the image --------------------------------------------------------------------------
INDEX_PID=""
CONTAINER=""
PIDS=()
descendants() { # pid: its child processes, recursively (only what this script started)
  local child
  for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do
    echo "$child"
    descendants "$child"
  done
}
cleanup() {
  local pid
  for pid in "${PIDS[@]}"; do # the services first (tini forwards SIGTERM), then buildah
    kill -TERM $(descendants "$pid") "$pid" 2>/dev/null || true
  done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  [ -n "$CONTAINER" ] && buildah rm "$CONTAINER" >/dev/null 2>&1 || true
  [ -n "$INDEX_PID" ] && kill "$INDEX_PID" 2>/dev/null || true
}
trap cleanup EXIT

if [ "${SPECD_SKIP_BUILD:-0}" != 1 ]; then
  # torch and its dependencies as a PEP 503 index: simple/<normalised name>/<wheel>
  WHEELS="$WORK/torch-index"
  if [ ! -d "$WHEELS/simple" ]; then
    say "collecting torch==$TORCH_VERSION and its dependencies into a local index"
    rm -rf "$WHEELS"
    # The image's Python is Debian bookworm's 3.11: run this with a Python 3.11 (PYTHON=...).
    "$PYTHON" -m pip download -q "torch==$TORCH_VERSION" --only-binary=:all: -d "$WHEELS/flat" >"$WORK/pip-download.log" 2>&1 \
      || { tail -20 "$WORK/pip-download.log"; fail "pip download torch failed"; }
    "$PYTHON" - "$WHEELS" <<'EOF'
import re, shutil, sys
from pathlib import Path
root = Path(sys.argv[1])
for wheel in sorted((root / "flat").iterdir()):
    name = re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
    folder = root / "simple" / name
    folder.mkdir(parents=True, exist_ok=True)
    shutil.move(str(wheel), folder / wheel.name)
for folder in (root / "simple").iterdir():
    links = "".join(f'<a href="{w.name}">{w.name}</a><br>\n' for w in sorted(folder.iterdir()) if w.name != "index.html")
    (folder / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")
names = sorted(f.name for f in (root / "simple").iterdir() if f.is_dir())
(root / "simple" / "index.html").write_text(
    "<!DOCTYPE html><html><body>\n" + "".join(f'<a href="{n}/">{n}</a><br>\n' for n in names) + "</body></html>\n"
)
EOF
  fi
  INDEX_PORT=$("$PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  "$PYTHON" -m http.server --bind 127.0.0.1 --directory "$WHEELS" "$INDEX_PORT" >"$WORK/index.log" 2>&1 &
  INDEX_PID=$!
  say "building $IMAGE (VARIANT=cpu, base $BASE, torch from http://127.0.0.1:$INDEX_PORT/simple)"
  start=$(date +%s)
  podman build --isolation chroot --network host \
    -v "$CA_BUNDLE:/run/specd-ca.pem:ro" \
    --build-arg VARIANT=cpu \
    --build-arg CPU_BASE="$BASE" \
    --build-arg TORCH_INDEX_URL="http://127.0.0.1:$INDEX_PORT/simple" \
    --build-arg PIP_CERT=/run/specd-ca.pem \
    -t "$IMAGE" . >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; fail "podman build failed; see $WORK/build.log"; }
  say "built in $(($(date +%s) - start)) s"
  kill "$INDEX_PID" 2>/dev/null || true
  INDEX_PID=""
fi
podman image exists "$IMAGE" || fail "no image $IMAGE (build it: run without SPECD_SKIP_BUILD)"
say "image: $(podman image inspect --format '{{.Id}} {{.Size}}' "$IMAGE" | awk '{printf "%.12s, %.0f MB", $1, $2/1e6}')"

# ---- 3. the baked models are readable by the image's user ------------------------------------
CONTAINER=$(buildah from "$IMAGE")
as_user() { buildah run --isolation chroot --network host --user 10001:10001 "$CONTAINER" -- "$@"; }
say "user inside: $(as_user id)"
unreadable=$(as_user find /models ! -perm -o+r 2>&1 | head -5)
[ -z "$unreadable" ] || fail "files under /models that others cannot read: $unreadable"
say "every file under /models is readable by others"

# ---- 4. the three services, each from the image, as user 10001 -------------------------------
free_port() { "$PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
serve() { # name, args...: start one service in the background, logging to $WORK/NAME.log
  local name=$1
  shift
  buildah run --isolation chroot --network host --user 10001:10001 "$CONTAINER" -- \
    tini -s -- specd serve "$@" >"$WORK/$name.log" 2>&1 &
  PIDS+=($!)
}
wait_ready() { # name, pid: wait for the banner; fail at once when the service exits first
  local name=$1 pid=$2
  for _ in $(seq "$READY_S"); do
    grep -q "listening on" "$WORK/$name.log" && { say "$name: $(grep -m1 'listening on' "$WORK/$name.log")"; return 0; }
    kill -0 "$pid" 2>/dev/null || { tail -20 "$WORK/$name.log"; fail "$name exited before it was ready"; }
    sleep 1
  done
  tail -20 "$WORK/$name.log"
  fail "$name not ready after $READY_S s"
}
TARGET_PORT=$(free_port)
DRAFT_PORT=$(free_port)
COORD_PORT=$(free_port)
serve target target --model demo --host 127.0.0.1 --port "$TARGET_PORT"
TARGET_PID=${PIDS[-1]}
serve draft draft --model demo --target-model demo --host 127.0.0.1 --port "$DRAFT_PORT"
DRAFT_PID=${PIDS[-1]}
wait_ready target "$TARGET_PID"
wait_ready draft "$DRAFT_PID"
serve coordinator coordinator --host 127.0.0.1 --port "$COORD_PORT" \
  --target "127.0.0.1:$TARGET_PORT" --draft "127.0.0.1:$DRAFT_PORT" --tokenizer demo --draft-length 4
wait_ready coordinator "${PIDS[-1]}"

# ---- 5. Generate with speculation, and greedy parity with target-only ------------------------
generate() { as_user specd generate --address "127.0.0.1:$COORD_PORT" --chat --temperature 0 \
  --max-new-tokens "$TOKENS" --ignore-eos --json "$@" "$PROMPT"; }
SPEC=$(generate --draft-length 4) || fail "Generate with speculation failed"
PLAIN=$(generate --no-speculation) || fail "target-only Generate failed"
echo "speculative: $SPEC"
echo "target-only: $PLAIN"
"$PYTHON" - "$SPEC" "$PLAIN" <<'EOF' || fail "see above"
import json, sys
spec, plain = (json.loads(a) for a in sys.argv[1:3])
stats = spec["stats"]
problems = []
if stats["draft_tokens"] == 0:
    problems.append("the speculative call verified no draft tokens (the draft did not take part)")
if spec["token_ids"] != plain["token_ids"]:
    problems.append(f"greedy outputs differ:\n  speculative {spec['token_ids']}\n  target-only {plain['token_ids']}")
if problems:
    print("check-image: " + "\ncheck-image: ".join(problems), file=sys.stderr)
    sys.exit(1)
print(
    f"check-image: greedy parity: {len(spec['token_ids'])} tokens identical; speculative call: "
    f"{stats['rounds']} rounds, {stats['draft_tokens']} draft tokens, {stats['accepted_tokens']} accepted "
    f"(acceptance length {stats['acceptance_length']:.2f})"
)
EOF
say "PASS"
