#!/usr/bin/env bash
# Set up the environment, then lint, type-check and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
scripts/setup-test-tools.sh
# shellcheck disable=SC1091
. .venv/bin/activate
# Never let the repository root onto sys.path implicitly (operator/ must not shadow `operator`).
export PYTHONSAFEPATH=1
# The tests' external tools were installed just above: a missing one fails, never skips silently.
export KVASIR_REQUIRE_TOOLS=1

ruff check .
ruff format --check .
mypy

# pytest exits 5 when it collects no tests; that must fail, not pass silently.
set +e
python -m pytest "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$status"
