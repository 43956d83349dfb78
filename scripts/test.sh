#!/usr/bin/env bash
# Set up (scripts/setup.sh), then the code checks (scripts/lint.sh) and the whole test
# suite. Extra args go to pytest.
#
#   scripts/test.sh            what CI runs (.ci/run): set-up, then every tier (the tests marked
#                              `alone` last, by themselves) with lint running beside them
#   scripts/test.sh --unit     the fast loop: tests/unit only (its `alone` tests last, by
#                              themselves), no lint; set-up only when pyproject.toml or
#                              scripts/setup.sh changed since the last one
#
# Both run pytest on SPECD_TEST_WORKERS worker processes (pytest-xdist; default 2, 0: one
# process, no workers), each test file whole on one worker (--dist loadfile), so a module's
# fixtures (its cluster) are still built once. The tiers' CPU time is mostly imports and
# services waiting on each other; two workers keep both cores busy. The files go out in the
# collection's order (--no-loadscope-reorder: tiers lightest first, tests/conftest.py), not
# most tests first, which would leave the few-test, long service files (scale-out, the GPU
# check's dry run) for last, one worker idle meanwhile.
set -euo pipefail
cd "$(dirname "$0")/.."

STAMP=.venv/.specd-setup-stamp  # hash of the set-up's inputs at the last complete set-up
setup_inputs() { cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1; }
set_up() {
  bash scripts/setup.sh
  setup_inputs >"$STAMP"
}

WORKERS=${SPECD_TEST_WORKERS:-2}

# The project's own bytecode, once (well under a second): these machines set PYTHONDONTWRITEBYTECODE,
# so without it every process the tests start (about a hundred services, the workers) compiles
# specd's sources again on import (0.3-0.4 CPU-s each). A stale file is recompiled in memory, as now.
compile_sources() { .venv/bin/python -m compileall -q -j 0 specd coordinator draft_service target_service tests >/dev/null; }
# And the tests may write bytecode: pytest then keeps each test module's assertion-rewritten code in
# __pycache__ instead of rewriting it in every pytest process (its collection of the suite takes
# 6.5 s rewriting, 2.5 s with the cache).
unset PYTHONDONTWRITEBYTECODE

# The code checks when they run beside the tests (lint_pid set): wait for them, print their report, note a failure.
lint_pid="" lint_log="" lint_status=0
finish_lint() {
  [ -n "$lint_pid" ] || return 0
  wait "$lint_pid" || lint_status=$?
  lint_pid=""
  echo "test.sh: the code checks (scripts/lint.sh), run beside the tests' shared pass:"
  cat "$lint_log"
  rm -f "$lint_log"
}

# Two passes over the tests that marker expression $1 selects ("" for all; the rest of the
# arguments go to pytest): all but those marked `alone` on the workers, then those in one process
# with nothing beside them (their assertions are about how their own load spreads; a neighbour's
# load on the same two cores skews that). One pass may select nothing, not both.
run_passes() {
  local only=${1:+($1) and } shared=0 alone=0 pass
  shift
  .venv/bin/python -m pytest -n "$WORKERS" --dist loadfile --no-loadscope-reorder -q -ra --durations=15 \
    -m "${only}not alone" "$@" || shared=$?
  finish_lint
  .venv/bin/python -m pytest -q -ra --durations=5 -m "${only}alone" "$@" || alone=$?
  if [ "$shared" -eq 5 ] && [ "$alone" -eq 5 ]; then
    echo "test.sh: pytest collected no tests; that is a failure" >&2
    return 1
  fi
  for pass in "$shared" "$alone"; do
    if [ "$pass" -ne 0 ] && [ "$pass" -ne 5 ]; then return "$pass"; fi
  done
}

if [ "${1:-}" = "--unit" ]; then
  shift
  if [ ! -x .venv/bin/python ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$(setup_inputs)" ]; then
    set_up
  fi
  compile_sources
  run_passes unit tests/unit "$@"
  exit
fi

started=$SECONDS
set_up
compile_sources
echo "test.sh: set-up done in $((SECONDS - started)) s"
# The code checks run beside the tests' shared pass, their report printed when both are done: the pass
# leaves a core idle about a seventh of its time (services waiting on each other), mypy on a clean clone
# is 40 CPU-s, and run first it held the whole run up by that long.
# The `alone` pass starts after them.
lint_log=$(mktemp -t specd-lint.XXXXXX)
bash scripts/lint.sh >"$lint_log" 2>&1 &
lint_pid=$!
trap '[ -z "$lint_pid" ] || kill "$lint_pid" 2>/dev/null; rm -f "$lint_log"' EXIT  # an interrupted run leaves no lint behind
status=0
run_passes "" "$@" || status=$?
finish_lint
[ "$status" -ne 0 ] || status=$lint_status
echo "test.sh: done in $((SECONDS - started)) s"
exit "$status"
