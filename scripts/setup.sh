# Sourced by scripts/test.sh and scripts/up.sh: make (or reuse) the virtual environment and
# install the project into it. Torch goes first: on this kind of machine
# `pip install torch==2.13.0` takes the CPU build already on disk; elsewhere an installed
# torch is kept (set BATON_TORCH_SPEC to choose another, e.g. a CUDA build).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${BATON_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV"
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c "import torch" >/dev/null 2>&1; then
  echo "== installing torch (${BATON_TORCH_SPEC:-torch==2.13.0})"
  python -m pip install -q "${BATON_TORCH_SPEC:-torch==2.13.0}"
fi
EXTRAS="${1:-test}"
STAMP="$VENV/.baton-installed-$EXTRAS"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  echo "== installing baton[$EXTRAS]"
  python -m pip install -q -e ".[$EXTRAS]"
  touch "$STAMP"
fi
SGLANG_VERSION=0.5.23
if [[ ",$EXTRAS," == *",test,"* ]] &&
  [ "$(python -c 'import importlib.metadata as m; print(m.version("sglang"))' 2>/dev/null)" != "$SGLANG_VERSION" ]; then
  # SGLang's frontend, which the tests run against the router: the package alone, since its
  # dependencies are its GPU server's (torch 2.14, CUDA kernels); what `import sglang`
  # needs comes with baton[test].
  echo "== installing sglang $SGLANG_VERSION (frontend only, no dependencies)"
  python -m pip install -q --no-deps "sglang==$SGLANG_VERSION"
fi
