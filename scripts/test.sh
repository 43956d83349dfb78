#!/usr/bin/env bash
# Set up (scripts/setup.sh), run the code checks (scripts/lint.sh), then the whole
# test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/lint.sh
set +e
.venv/bin/python -m pytest -q -ra --durations=15 "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit "$status"
