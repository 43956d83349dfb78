#!/usr/bin/env bash
# The code checks (configured in pyproject.toml): ruff lint, ruff format, mypy, and
# lint-imports (the layer contracts). Needs .venv (scripts/setup.sh); scripts/test.sh
# runs this before pytest. One line per check with its result; a failing check's
# output follows its line. Exits 1 if any check fails.
set -uo pipefail
cd "$(dirname "$0")/.."

failed=0
# check NAME SUMMARY COMMAND...: run COMMAND; print NAME, ok or FAILED, the seconds it took and
# its summary (the last output line matching the SUMMARY pattern, else its last line).
check() {
  local name=$1 summary=$2 out status started=$SECONDS line
  shift 2
  out=$("$@" 2>&1)
  status=$?
  line=$(printf '%s\n' "$out" | grep -E "$summary" | tail -n 1)
  [ -n "$line" ] || line=$(printf '%s\n' "$out" | sed '/^[[:space:]]*$/d' | tail -n 1)
  if [ "$status" -eq 0 ]; then
    printf 'lint: %-20s ok      %3ds  %s\n' "$name" $((SECONDS - started)) "$line"
  else
    printf 'lint: %-20s FAILED  %3ds  %s\n' "$name" $((SECONDS - started)) "$line"
    printf '%s\n' "$out" | sed 's/^/    /'
    failed=1
  fi
}

check "ruff check" '^(All checks passed|Found [0-9]+ error)' .venv/bin/ruff check .
check "ruff format --check" 'files? (already formatted|would be reformatted)' .venv/bin/ruff format --check .
check "mypy" '^(Success|Found [0-9]+ error)' .venv/bin/mypy
check "lint-imports" '^Contracts: ' .venv/bin/lint-imports
exit "$failed"
