#!/usr/bin/env bash
# The test command: installs what it needs, then lint, format check, types, and the suite.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/unit -x).
set -euo pipefail
# shellcheck source=scripts/setup.sh
. "$(dirname "$0")/setup.sh" test
# A real etcd for the registry tests (Debian's etcd-server); without it they skip, saying why.
if ! command -v etcd >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "== installing etcd-server (apt-get)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends etcd-server; } >/dev/null 2>&1 ||
      echo "   apt-get could not install etcd-server: the etcd tests will skip"
  else
    echo "== etcd not found and apt-get unusable here (needs root): the etcd tests will skip"
  fi
fi
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
