#!/usr/bin/env bash
# The main job: a local prefill/decode cluster with the built-in tiny model.
# Extra arguments go to `baton up` (e.g. scripts/up.sh --prefill 1 --decode 2 --port 8080).
set -euo pipefail
# shellcheck source=scripts/setup.sh
. "$(dirname "$0")/setup.sh" test
exec baton up "$@"
