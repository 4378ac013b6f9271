#!/usr/bin/env bash
# The test command: installs what it needs, then lint, format check, types, and the suite.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/unit -x).
set -euo pipefail
# shellcheck source=scripts/setup.sh
. "$(dirname "$0")/setup.sh" test
# Real servers some tests run, from Debian's packages; without them those tests skip,
# saying why: etcd (etcd-server) for the registry tests; Prometheus for the dashboard's
# and, with its promtool, for the lint of /metrics (test_metrics_promtool.py).
install_debian() {  # <command> <package> <tests that need it>
  command -v "$1" >/dev/null 2>&1 && return
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "== installing $2 (apt-get)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends "$2"; } >/dev/null 2>&1 ||
      echo "   apt-get could not install $2: the $3 tests will skip"
  else
    echo "== $1 not found and apt-get unusable here (needs root): the $3 tests will skip"
  fi
}
install_debian etcd etcd-server etcd
install_debian prometheus prometheus dashboard
install_debian promtool prometheus promtool
echo "== ruff"
ruff check .
ruff format --check .
echo "== mypy"; bash "$(dirname "$0")/typecheck.sh"
echo "== pytest"
pytest_run() {  # pytest's status, with "collected nothing" (5) a failure
  local rc=0
  python -m pytest -q -p no:cacheprovider "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: failing loudly" >&2
    rc=1
  fi
  return "$rc"
}
if [ "$#" -gt 0 ]; then
  pytest_run --durations=25 "$@"
  exit
fi
# The unit tests, in-process and CPU-bound, in two processes (pytest-xdist): 2.3 minutes
# where one took 4 on the 2-core CI machine. The integration tests run real clusters of
# several processes each and time them against that machine: one at a time, as before
# (in two processes, two of them lost their timing: 2026-11-29).
unit_rc=0
pytest_run --durations=10 -n 2 --dist worksteal tests/unit || unit_rc=$?
rest_rc=0
pytest_run --durations=25 tests/integration tests/gpu || rest_rc=$?
echo "== pytest: unit tests exit ${unit_rc}, integration and GPU tests exit ${rest_rc}"
if [ "$unit_rc" -ne 0 ] || [ "$rest_rc" -ne 0 ]; then
  exit 1
fi
