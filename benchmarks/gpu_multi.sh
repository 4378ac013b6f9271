#!/usr/bin/env bash
# Two-GPU runs (issue: PD across GPUs vs aggregated TP 2). On the GPU machine:
#   bash benchmarks/gpu_multi.sh engines   # carry .wheels/gpu .wheels/fi
#   bash benchmarks/gpu_multi.sh handoff   # carry .wheels/gpu .wheels/ucx
set -uo pipefail
OUT=${OUT:-/tmp/out}
SKIP_TESTS=1 SKIP_BENCH=1 bash "$(dirname "$0")/gpu_run.sh" >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/.gpu_pkg PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
case "${1:-engines}" in
  engines)
    # one GPU = what P (TTFT) and D (TPOT) each run in 1P1D; two GPUs = aggregated TP 2
    for tp in 1 2; do
      timeout 280 python3 -m baton.benchmarks.gpu_engine --sections decode,ttft \
        --batches 1,8,32 --tp $tp --out "$OUT/engine_tp$tp.json" 2>&1 | grep -E "^(decode|ttft|engine|bandwidth)|Error"
    done ;;
  handoff)
    nvidia-smi topo -m | head -5
    timeout 200 python3 -m baton.benchmarks.gpu_pd --devices 0,1 --rounds 8 \
      --out "$OUT/pd_cross_gpu.json" 2>&1 | tail -3 ;;
esac
