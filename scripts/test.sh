#!/usr/bin/env bash
# Set up (scripts/setup.sh), run the code checks (scripts/lint.sh), then the whole
# test suite. Extra args go to pytest.
#
#   scripts/test.sh            what CI runs (.ci/run): set-up, lint, every tier
#   scripts/test.sh --unit     the fast loop: tests/unit only, no lint; set-up only when
#                              pyproject.toml or scripts/setup.sh changed since the last one
#
# Both run pytest on SPECD_TEST_WORKERS worker processes (pytest-xdist; default 2, 0: one
# process, no workers), each test file whole on one worker (--dist loadfile), so a module's
# fixtures (its cluster) are still built once. The tiers' CPU time is mostly imports and
# services waiting on each other; two workers keep both cores busy.
set -euo pipefail
cd "$(dirname "$0")/.."

STAMP=.venv/.specd-setup-stamp  # hash of the set-up's inputs at the last complete set-up
setup_inputs() { cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1; }
set_up() {
  bash scripts/setup.sh
  setup_inputs >"$STAMP"
}

WORKERS=${SPECD_TEST_WORKERS:-2}

run_pytest() {
  set +e
  .venv/bin/python -m pytest -n "$WORKERS" --dist loadfile "$@"
  local status=$?
  set -e
  if [ "$status" -eq 5 ]; then
    echo "test.sh: pytest collected no tests; that is a failure" >&2
    return 1
  fi
  return "$status"
}

if [ "${1:-}" = "--unit" ]; then
  shift
  if [ ! -x .venv/bin/python ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$(setup_inputs)" ]; then
    set_up
  fi
  run_pytest -q -ra --durations=10 -m unit tests/unit "$@"
  exit
fi

set_up
bash scripts/lint.sh
run_pytest -q -ra --durations=15 "$@"
