#!/usr/bin/env bash
# One device run: install carried wheels, run the GPU tests and the GPU benchmark.
# Usage (on the GPU machine, from the repo root): bash benchmarks/gpu_run.sh [bench args...]
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site
for d in .wheels/gpu .wheels/fi .wheels/ucx; do
  [ -d "$d" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$d"/*.whl
done
export PYTHONPATH=/tmp/site:$PWD/.gpu_pkg:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
# the package is imported as baton.*: map the repository folders like an install would
mkdir -p .gpu_pkg/baton
ln -sfn "$PWD/common" .gpu_pkg/baton/common
ln -sfn "$PWD/services" .gpu_pkg/baton/services
ln -sfn "$PWD/benchmarks" .gpu_pkg/baton/benchmarks
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 400 python3 -m pytest -q --maxfail=6 -p no:cacheprovider tests/gpu ${GPU_TEST_K:+-k "$GPU_TEST_K"} 2>&1 | tee "$OUT/gpu_tests.log"
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 -m baton.benchmarks.gpu_engine --out "$OUT/gpu_engine.json" "$@" 2>&1 | tee "$OUT/gpu_engine.log"
fi
