#!/usr/bin/env bash
# The test command: installs what it needs, then lint, format check, types, and the suite.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/unit -x).
set -euo pipefail
# shellcheck source=scripts/setup.sh
. "$(dirname "$0")/setup.sh" test
echo "== ruff"
ruff check .
ruff format --check .
echo "== mypy"; mypy
echo "== pytest"
set +e
python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing loudly" >&2
  exit 1
fi
exit "$rc"
