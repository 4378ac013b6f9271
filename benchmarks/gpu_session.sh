#!/usr/bin/env bash
# One GPU-machine session: install the carried wheels, then run the named stages.
# Usage (from the repo root on the GPU machine): bash benchmarks/gpu_session.sh STAGE...
#   tests    tests/gpu (backends, graphs, PD over ipc between processes)
#   engine   python -m baton.benchmarks.lab.gpu_engine $ENGINE_ARGS (decode vs memory floor, TTFT
#            vs FLOP floor, offline throughput vs transformers)
#   engines_tp  the same at TP 1 and TP 2 (what P and D run in 1P1D vs aggregated TP 2)
#   engine_ab   the engine stage for this tree and .baseline/ side by side (GPUs 0 and 1 at once)
#   engine_turns  the engine stage for this tree and each of $TREES (.baseline) in turn on one
#            GPU, $TURNS (2) times each, this tree first (drift of one GPU's clocks falls on all)
#   decode_backends  the engine stage with each of $DECODE_BACKENDS (flashinfer triton) as
#            decode's attention, in turn on one GPU, $TURNS (2) times
#   handoff  KV handoff of a 2,048-token Llama-8B prompt between two processes:
#            tcp and ipc on one GPU, ipc across two GPUs, against device copies; where
#            .baseline/ holds an older tree (common, services, benchmarks), it runs too,
#            side by side (same machine, same call); HANDOFF_ARGS go to gpu_pd
#   sweep    P:D sweep 1P1D vs agg2 (SWEEP_* variables below), 8B shape, flashinfer;
#            SWEEP_ARGS go to pd-sweep as they are (e.g. --dataset shared-prefix)
#   mooncake the Mooncake conversation trace by placement and shape (issue #40; PLACEMENTS,
#            MOONCAKE_SHAPES, MOONCAKE_SPEEDS, MOONCAKE_DURATION, MOONCAKE_MAX_IN,
#            MOONCAKE_SAMPLE: the share of conversations kept; MOONCAKE_REPEATS: every point
#            that many times, the placements in turn, in one sweep)
#   planner  issue #41: a mix that changes midway (PLANNER_PHASES, PLANNER_PHASE_S s each) on
#            PLANNER_SHAPES, one moved by `baton up --planner` (1P3D+planner); planner knobs
#            PLANNER_WINDOW, PLANNER_HOLD, PLANNER_COOLDOWN; SLO PLANNER_TTFT, PLANNER_TPOT
#   flips    issue #41: 1P3D at FLIPS_LOAD of its capacity (or FLIPS_RATE req/s), a decode
#            worker turned prefill and back at FLIPS_AT s (benchmarks/role_flips.py)
#   load     5 minutes at 1.5x measured capacity: one GPU (agg1) and a 1P1D pair on one GPU
#   server_step  issue #38: a server's steady decode step under a burst of $STEP_BS requests
#            against gpu_engine's at the same batch and context (lab/server_step.py)
#   host_profile  cProfile of steady decode steps at batch $PROFILE_BS (default 1), overlap off
#   kernels  the GPU's time by kernel: a decode step at batches $KERNELS_BS (1 32), a 2,048-token prefill
#            ($KERNELS_ARGS to gpu_profile, e.g. '--context 1460 --decode-backend triton'; files tagged $KERNELS_TAG)
#   linear   the projections at batches $LINEAR_BATCHES (1,8,32): cuBLAS against common/layers/skinny.py
#   gate_up  a prompt's gate/up GEMM with SiLU·mul fused (layers/gate_up.py) against cuBLAS
#            and the separate kernel, at $GATE_UP_ROWS (33 to 8192) rows
#   prompt_graphs  TTFT by prompt length with the prompt's CUDA graph and without ($PROMPT_LENS)
#   attention  flashinfer's decode and prefill kernels at the engine's shapes, variant against variant
#   ttft_gaps  where a 2,048-token prompt's time to first token goes: GPU busy, host-bound gaps
#   ttft_clocks  the prompt's phases (gpu_ttft) with the GPU idle before it and kept busy, SM
#            clock and power sampled every 20 ms (clocks.csv)
#   gaps     why the GPU idles in the overlapped decode loop, at batches $GAPS_BS (1 32)
#   offload_step  issue #43: a decode step with and without GPU->host offload of the host tier
#            (gpu_offload_step; batches 1,32,128, 4,096 tokens of context, 2,048 under 100 GB
#            of GPU memory; $OFFLOAD_ARGS go to it: the server's page of one token with
#            OFFLOAD_ARGS='--page-size 1 --rates growth,1024,8192')
#   host_tier  issue #43: the Mooncake trace on two one-GPU clusters at once, with the host
#            tier (GPU 0) and without (GPU 1), the same small pool; a side-by-side table
#            (HOST_TIER_POOL, HOST_TIER_TOKENS, HOST_TIER_SAMPLE, HOST_TIER_SCALE: below)
#   chunking the same replay, no tier: no prompt chunking (the default) against $CHUNKING_B
#   host_hit issue #43: a host-tier prefix hit's worth against a device hit (gpu_host_hit)
#   mixed    mixed steps split between prefill and decode kernels against unsplit, their GPU
#            tests, and agg1 default against --enable-mixed-chunk (one GPU; MIXED_SWEEPS=0 first
#            on a fresh machine, then the whole stage on the warm one)
#   mixed_spy  where a mixed step's 24-29 ms of launch go (s29: its kernels take 14.5-19.8):
#            py-spy of mixed steps alone at 128 rows and chunk 512, sampling wall time, then
#            the GIL's holder (--gil); summaries by lab/spy_summary
#   local_prefill  a decode worker computing prompts itself under its TPOT SLO, pieces
#            against eager (one GPU; lab/gpu_local_prefill.py, LOCAL_ARGS)
#   save_caches  Triton's kernel cache, flashinfer's JIT-built modules and tvm-ffi's torch
#            extension packed into $OUT (triton_cache.tgz, flashinfer_jit.tgz,
#            tvm_ffi_cache.tgz): carried in .snap/ ($TRITON_CACHE_TGZ, $FI_JIT_TGZ,
#            $TVM_FFI_TGZ), they are restored at install (flashinfer's as its AOT modules)
#   prefill_rate  issue #38: prompt tokens/s of one GPU, the engine alone (lab/gpu_prefill_rate)
#            and agg1 / 1P1D servers on GPU 0 in a closed loop ($PREFILL_*, below)
# Needs .wheels/ and a model folder in $MODEL (default .gpu_model/llama8b): both made by
# benchmarks/gpu_prepare.sh on a machine with PyPI access.
# Results go to $OUT (default /tmp/out); a short table is printed last. No stage: install only.
# Several sessions may run at once on disjoint GPUs (CUDA_VISIBLE_DEVICES, its own OUT):
# the wheels are installed once, and stage GPU ids index the visible GPUs.
set -uo pipefail
OUT=${OUT:-/tmp/out}
MODEL=${MODEL:-$PWD/.gpu_model/llama8b}
TRITON_CACHE=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
TRITON_CACHE_TGZ=${TRITON_CACHE_TGZ:-$PWD/.snap/triton_cache.tgz}
FI_CACHE=${FLASHINFER_WORKSPACE_BASE:-$HOME}/.cache/flashinfer
FI_JIT_TGZ=${FI_JIT_TGZ:-$PWD/.snap/flashinfer_jit.tgz}
TVM_FFI_CACHE=${TVM_FFI_CACHE_DIR:-$HOME/.cache/tvm-ffi}
TVM_FFI_TGZ=${TVM_FFI_TGZ:-$PWD/.snap/tvm_ffi_cache.tgz}
mkdir -p "$OUT" /tmp/site
# the model folder and the trace, packed by gpu_prepare.sh to fit a call's carry
if [ ! -d "$MODEL" ] && [ -f .snap/data.tar.xz ]; then
  tar xJf .snap/data.tar.xz && echo "unpacked .gpu_model/ and .traces/ from .snap/data.tar.xz"
fi
(
  flock 9
  [ -f /tmp/site/.installed ] && exit 0
  for d in .wheels/fi .wheels/srv .wheels/ucx; do
    [ -d "$d" ] && python3 -m pip install -q --no-index --no-deps --no-compile --upgrade \
      --target /tmp/site "$d"/*.whl
  done
  touch /tmp/site/.installed
  # Triton's kernel cache from an earlier machine (stage save_caches): on a fresh machine
  # the kernels' first builds took minutes of the session's 30 (s29: a test step cut at
  # 260 s, a py-spy run at 140 s, both still compiling)
  if [ -f "$TRITON_CACHE_TGZ" ]; then
    mkdir -p "$TRITON_CACHE" && tar xzf "$TRITON_CACHE_TGZ" -C "$TRITON_CACHE" &&
      echo "restored Triton's cache ($(du -sh "$TRITON_CACHE" | cut -f1)) from $TRITON_CACHE_TGZ"
  fi
  # flashinfer's JIT-built modules from an earlier machine (save_caches), as its AOT modules:
  # a fresh machine's first prompt and first cached-prefix prompt each waited a minute
  # for nvcc (s32: 54 s and 66 s of every worker's warm-up). Only those built by the
  # installed version for this GPU's architecture (VERSION/ARCH/cached_ops/NAME/NAME.so).
  if [ -f "$FI_JIT_TGZ" ]; then
    fi_version=$(ls .wheels/fi | sed -n 's/^flashinfer_python-\([^-]*\)-.*/\1/p' | head -1)
    arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
    tmp=$(mktemp -d) && tar xzf "$FI_JIT_TGZ" -C "$tmp" && n=0 &&
      for so in "$tmp/$fi_version/$arch"*/cached_ops/*/*.so; do
        [ -f "$so" ] || continue
        name=$(basename "$so" .so)
        mkdir -p "/tmp/site/flashinfer/data/aot/$name" && cp "$so" "/tmp/site/flashinfer/data/aot/$name/"
        n=$((n + 1))
      done
    echo "flashinfer: $n prebuilt modules for $fi_version on sm$arch from $FI_JIT_TGZ"
    rm -rf "$tmp"
  fi
  # tvm-ffi's torch extension (torch-c-dlpack-ext), which importing flashinfer JIT-compiles
  # once per machine: 26 s of each worker's cold start (s33). Its file name carries the
  # torch version and build, so one built for another torch is not loaded.
  if [ -f "$TVM_FFI_TGZ" ]; then
    mkdir -p "$TVM_FFI_CACHE" && tar xzf "$TVM_FFI_TGZ" -C "$TVM_FFI_CACHE" &&
      echo "tvm-ffi: restored $(ls "$TVM_FFI_CACHE" | tr '\n' ' ')from $TVM_FFI_TGZ"
  fi
) 9>/tmp/site.lock
package() {  # DIR TREE: DIR/baton.* imports TREE's folders, as an install would map them
  mkdir -p "$1/baton"
  for p in common services benchmarks; do ln -sfn "$2/$p" "$1/baton/$p"; done
}
package "$PWD/.gpu_pkg" "$PWD"
lab() {  # PACKAGE NAME: the module of a lab benchmark in that tree (older trees: no lab/)
  if [ -d "$1/baton/benchmarks/lab" ]; then echo "baton.benchmarks.lab.$2"; else echo "baton.benchmarks.$2"; fi
}
export PYTHONPATH=/tmp/site:$PWD/.gpu_pkg:$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  NGPU=$(tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c .)
else
  NGPU=$(nvidia-smi -L | wc -l)
fi
GPUS=$(seq -s, 0 $((NGPU - 1)))
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
# what a stage lists from its clusters' logs (failures, and steps that stalled every stream)
LOG_TROUBLE="internal error\|Traceback\|OutOfPages\|cannot go on\|every running stream waited"
UP="--device cuda --dtype bfloat16 --load-format dummy --attention-backend flashinfer"
UP="$UP --max-total-tokens ${POOL_TOKENS:-262144} --max-running-requests ${MAX_RUNNING:-256}"
summary() { echo "$*" >> "$OUT/summary.txt"; }

stage_tests() {
  # each failure's traceback as it happens (a run cut by the timeout keeps them)
  GPU_TEST_FAILURES="$OUT/gpu_failures.txt" timeout 420 python3 -m pytest -q -x -p no:cacheprovider \
    tests/gpu ${GPU_TEST_K:+-k "$GPU_TEST_K"} 2>&1 | tail -40 | tee "$OUT/gpu_tests.log"
  summary "tests: $(tail -1 "$OUT/gpu_tests.log")"
}

stage_engine() {
  # shellcheck disable=SC2086
  python3 -m baton.benchmarks.lab.gpu_engine --out "$OUT/gpu_engine.json" ${ENGINE_ARGS:-} 2>&1 \
    | tee "$OUT/gpu_engine.log"
  summary "$(grep -E '^(decode|ttft|offline)' "$OUT/gpu_engine.log")"
}

stage_engines_tp() {
  for tp in 1 2; do
    timeout 280 python3 -m baton.benchmarks.lab.gpu_engine --sections decode,ttft --batches 1,8,32 \
      --tp $tp --out "$OUT/engine_tp$tp.json" 2>&1 | grep -E "^(decode|ttft|engine|bandwidth)|Error" \
      | tee -a "$OUT/engines_tp.log"
  done
  summary "$(cat "$OUT/engines_tp.log")"
}

stage_handoff() {
  local runs=(${HANDOFF:-tcp:0 ipc:0})
  [ "$NGPU" -gt 1 ] && [ -z "${HANDOFF:-}" ] && runs+=("ipc:0,1")
  local trees=("this:$PWD/.gpu_pkg")
  if [ -d .baseline/common ]; then
    package "$PWD/.gpu_pkg_base" "$PWD/.baseline"
    trees+=("baseline:$PWD/.gpu_pkg_base")
  fi
  for r in "${runs[@]}"; do
    for t in "${trees[@]}"; do
      set -- ${r/:/ } ${t/:/ }
      echo "$3 tree:" >> "$OUT/handoff.log"
      PYTHONPATH=/tmp/site:$4:$PWD timeout 200 python3 -m "$(lab "$4" gpu_pd)" --backend "$1" \
        --devices "$2" --rounds 10 ${HANDOFF_ARGS:-} --out "$OUT/handoff_$3_$1_${2/,/-}.json" 2>&1 \
        | grep -v "^WARNING" | tail -3 | tee -a "$OUT/handoff.log"
    done
  done
  summary "$(grep -E '^(\| KV handoff|\| median|[a-z]+ tree:)' "$OUT/handoff.log")"
}

stage_engine_ab() {
  # the engine stage for this tree and the one in .baseline/, at once on the first two
  # visible GPUs (one after the other where there is one GPU); ENGINE_ARGS as for engine
  [ -d .baseline/common ] || { echo "engine_ab: no .baseline/ tree"; return 1; }
  package "$PWD/.gpu_pkg_base" "$PWD/.baseline"
  local vis; IFS=, read -ra vis <<< "${CUDA_VISIBLE_DEVICES:-$GPUS}"
  local args=${ENGINE_ARGS:---sections decode,ttft --batches 1,8,32,128}
  run_tree() {  # name package gpu
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=$3 PYTHONPATH=/tmp/site:$2:$PWD timeout "${ENGINE_TIMEOUT:-300}" \
      python3 -m "$(lab "$2" gpu_engine)" --out "$OUT/engine_$1.json" $args \
      > "$OUT/engine_$1.log" 2>&1
  }
  if [ "$NGPU" -gt 1 ]; then
    run_tree this "$PWD/.gpu_pkg" "${vis[0]}" &
    run_tree baseline "$PWD/.gpu_pkg_base" "${vis[1]}"
    wait
  else
    run_tree this "$PWD/.gpu_pkg" "${vis[0]}"
    run_tree baseline "$PWD/.gpu_pkg_base" "${vis[0]}"
  fi
  for t in this baseline; do
    summary "engine, $t tree:"
    summary "$(grep -E '^(decode|ttft|offline)|Error' "$OUT/engine_$t.log")"
  done
}

stage_engine_turns() {
  # $TREES (default .baseline): folders that each hold a tree (common, services, benchmarks)
  local trees=("this:$PWD/.gpu_pkg") d name
  for d in ${TREES:-.baseline}; do
    [ -d "$d/common" ] || { echo "engine_turns: no tree in $d/"; return 1; }
    name=$(basename "$d"); name=${name#.}
    package "$PWD/.gpu_pkg_$name" "$PWD/$d"
    trees+=("$name:$PWD/.gpu_pkg_$name")
  done
  local args=${ENGINE_ARGS:---sections decode,ttft --batches 1,8,32,128}
  for i in $(seq "${TURNS:-2}"); do
    for t in "${trees[@]}"; do
      # shellcheck disable=SC2086
      PYTHONPATH=/tmp/site:${t#*:}:$PWD timeout "${ENGINE_TIMEOUT:-300}" python3 -m \
        "$(lab "${t#*:}" gpu_engine)" --out "$OUT/turn${i}_${t%%:*}.json" $args \
        > "$OUT/turn${i}_${t%%:*}.log" 2>&1
      summary "turn $i, ${t%%:*} tree: $(grep -E '^(decode|ttft|offline)|Error' "$OUT/turn${i}_${t%%:*}.log")"
    done
  done
}

stage_decode_backends() {
  # the engine stage for this tree with each of $DECODE_BACKENDS (flashinfer triton) as
  # decode's attention, in turn on one GPU, $TURNS (2) times
  local args=${ENGINE_ARGS:---sections decode --batches 1,8,32,64,128}
  for i in $(seq "${TURNS:-2}"); do
    for d in ${DECODE_BACKENDS:-flashinfer triton}; do
      # shellcheck disable=SC2086
      timeout "${ENGINE_TIMEOUT:-300}" python3 -m baton.benchmarks.lab.gpu_engine \
        --out "$OUT/turn${i}_$d.json" $args --decode-backend "$d" > "$OUT/turn${i}_$d.log" 2>&1
      summary "turn $i, decode $d: $(grep -E '^(decode|ttft|offline)|Error' "$OUT/turn${i}_$d.log")"
    done
  done
}

stage_server_step() {
  # issue #38: the server's steady decode step against the engine's, one GPU: agg1 (or
  # STEP_SHAPE="--prefill 1 --decode 1", both on GPU 0) under one burst of $STEP_BS (200)
  # requests, $STEP_IN in / $STEP_OUT out (lab/server_step.py); then gpu_engine's decode
  # at that batch and the burst's mean context on the same GPU
  local bs=${STEP_BS:-200} in=${STEP_IN:-1330} out=${STEP_OUT:-768} name=${STEP_NAME:-agg1}
  local port=$((8100 + RANDOM % 800)) logs="$OUT/step-$name-logs"
  # shellcheck disable=SC2086
  python3 -m baton.services.cli up --port $port --model "$MODEL" $UP --gpus 0 \
    ${STEP_SHAPE:---workers 1} --log-dir "$logs" ${STEP_UP:-} > "$OUT/step-$name-up.log" 2>&1 &
  local up=$!
  for _ in $(seq 400); do curl -sf localhost:$port/health >/dev/null && break; sleep 1; done
  python3 -m baton.services.cli bench serve --base-url http://127.0.0.1:$port --num-requests 1 \
    --input-len 8 --output-len 8 --wait-for-workers 400 --no-progress > /dev/null 2>&1
  timeout 300 python3 -m baton.benchmarks.lab.server_step --base-url http://127.0.0.1:$port \
    --log-dir "$logs" --concurrency "$bs" --input-len "$in" --output-len "$out" \
    --out "$OUT/server_step_$name.json" > "$OUT/server_step_$name.txt" 2>&1
  kill -INT $up; wait $up
  summary "server step, $name: $(cat "$OUT/server_step_$name.txt")"
  for d in ${STEP_ENGINE_BACKENDS-triton}; do  # STEP_ENGINE_BACKENDS= : none
    timeout 300 python3 -m baton.benchmarks.lab.gpu_engine --sections decode --batches "$bs" \
      --context $((in + out / 2)) --decode-backend "$d" --out "$OUT/engine_step_$d.json" \
      > "$OUT/engine_step_$d.log" 2>&1
    summary "engine step, decode $d, context $((in + out / 2)): $(grep -E '^decode|Error' "$OUT/engine_step_$d.log")"
  done
}

stage_prefill_rate() {
  # issue #38: prompt tokens/s of one GPU: the engine alone at step budgets $PREFILL_BUDGETS
  # (lab/gpu_prefill_rate.py; empty: none), then servers on GPU 0 in a closed loop of
  # $PREFILL_CONC (128; at 48 the requests ran in waves, the GPU idle between them),
  # $PREFILL_N (1200) prompts of $PREFILL_IN (1330) tokens, 2 out: agg1, and 1P1D with both
  # workers on GPU 0 (D's share: one decode step a request)
  local in=${PREFILL_IN:-1330} budgets=${PREFILL_BUDGETS-8192,16384,32768}
  [ -n "$budgets" ] && timeout 400 python3 -m baton.benchmarks.lab.gpu_prefill_rate \
    --input-len "$in" --budgets "$budgets" --out "$OUT/prefill_rate.json" \
    > "$OUT/prefill_rate.txt" 2>&1
  [ -n "$budgets" ] && summary "engine prompt rate: $(grep -E '^budget|matmul|Error' "$OUT/prefill_rate.txt")"
  local shape
  for shape in "agg1:--workers 1" "1P1D:--prefill 1 --decode 1"; do
    local name=${shape%%:*} port=$((8100 + RANDOM % 800)) logs="$OUT/prefill-${shape%%:*}-logs"
    # shellcheck disable=SC2086
    python3 -m baton.services.cli up --port $port --model "$MODEL" $UP --gpus 0 ${shape#*:} \
      --log-dir "$logs" ${PREFILL_UP:-} > "$OUT/prefill-$name-up.log" 2>&1 &
    local up=$!
    for _ in $(seq 400); do curl -sf localhost:$port/health >/dev/null && break; sleep 1; done
    timeout 300 python3 -m baton.services.cli bench serve --base-url http://127.0.0.1:$port \
      --wait-for-workers 400 --warmup 48 --max-concurrency "${PREFILL_CONC:-128}" \
      --num-requests "${PREFILL_N:-1200}" --input-len "$in" --output-len 2 --ignore-eos \
      --no-progress --out "$OUT/prefill_$name.json" > "$OUT/prefill_$name.txt" 2>&1
    kill -INT $up; wait $up
    summary "server prompt rate, $name: $(python3 -c "import json;s=json.load(open('$OUT/prefill_$name.json'))['summary'];print(round(s['request_throughput']*$in), 'prompt tok/s;', s['request_throughput'], 'req/s; failed', s.get('failed'))" 2>&1)"
  done
}

stage_mixed() {
  # mixed steps (prompt chunks beside decode rows), one GPU: each step split between the
  # prefill and decode kernels against every row through the prompt kernel
  # (lab/gpu_mixed_step.py), the GPU tests of mixed steps and early draw graphs, then agg1
  # with the default scheduling against --enable-mixed-chunk --chunked-prefill-size
  # $MIXED_CHUNK (512) on #38's workload at rates $MIXED_RATES (10,12,14); MIXED_SWEEPS=0:
  # no sweeps (on a fresh machine the kernels' first builds leave no room for them)
  timeout 300 python3 -m baton.benchmarks.lab.gpu_mixed_step --out "$OUT/mixed_step.json" \
    > "$OUT/mixed_step.txt" 2>&1
  summary "$(sed -n '/^| batch/,$p' "$OUT/mixed_step.txt")"
  timeout 300 python3 -m pytest -q tests/gpu/test_gpu_backends.py -k "mixed or draw or piecewise" \
    > "$OUT/mixed_tests.txt" 2>&1
  summary "mixed-step GPU tests: $(tail -1 "$OUT/mixed_tests.txt")"
  [ "${MIXED_SWEEPS:-1}" = 0 ] && return  # (a fresh machine: the sweeps in a second call)
  local c="SWEEP_SHAPES=agg1 SWEEP_RATES=${MIXED_RATES:-10,12,14} SWEEP_IN=1330 SWEEP_OUT_LEN=256"
  c="$c SWEEP_SLO=ttft=1s,tpot=15ms SWEEP_DURATION=20 SWEEP_TIMEOUT=270"
  local up="--prefill-graph-max-tokens 0 --stream-interval 8"
  # shellcheck disable=SC2086
  (export $c SWEEP_NAME=agg1_default SWEEP_UP="$up" && stage_sweep)
  # shellcheck disable=SC2086
  (export $c SWEEP_NAME=agg1_mixed \
    SWEEP_UP="$up --enable-mixed-chunk --chunked-prefill-size ${MIXED_CHUNK:-512}" && stage_sweep)
}

stage_mixed_spy() {
  local spy=/tmp/site/bin/py-spy
  for how in wall gil; do
    local flag=""; [ "$how" = gil ] && flag="--gil"
    # shellcheck disable=SC2086
    timeout 300 "$spy" record -r 250 --threads $flag --format raw -o "$OUT/spy_$how.txt" -- \
      python3 -m baton.benchmarks.lab.gpu_mixed_step --batches 128 --chunks 512 \
      --mixed-prompts 0 --out "$OUT/spy_$how.json" > "$OUT/spy_${how}_run.txt" 2>&1
    python3 -m baton.benchmarks.lab.spy_summary "$OUT/spy_$how.txt" --within chunk_steps \
      > "$OUT/spy_${how}_main.md" 2>&1
    python3 -m baton.benchmarks.lab.spy_summary "$OUT/spy_$how.txt" --within ModelRunner.execute \
      > "$OUT/spy_${how}_forward.md" 2>&1
    summary "mixed steps under py-spy ($how): $(grep -m1 '^| 128' "$OUT/spy_${how}_run.txt")"
  done
  # the raw profiles in one archive: a device call brings back at most 8 files
  (cd "$OUT" && tar czf spy_raw.tgz --exclude='*.md' spy_wall* spy_gil* &&
    rm -f spy_wall.txt spy_gil.txt spy_*.json spy_*_run.txt)
}

stage_local_prefill() {
  # a decode worker computing prompts itself under its TPOT SLO, in pieces against eager
  # (lab/gpu_local_prefill.py; LOCAL_ARGS: e.g. --batches 128 --tpot-slo 0.02)
  # shellcheck disable=SC2086
  timeout 400 python3 -m baton.benchmarks.lab.gpu_local_prefill --out "$OUT/local_prefill.json" \
    ${LOCAL_ARGS:-} > "$OUT/local_prefill.txt" 2>&1
  summary "$(sed -n '/^| mode/,$p' "$OUT/local_prefill.txt")"
}

stage_save_caches() {
  # Triton's kernel cache into $OUT, to carry to the next fresh machine as
  # .snap/triton_cache.tgz (restored at install; the working tree and carried paths travel
  # in 64 MiB together). Only what Triton loads a kernel from (its metadata, cubin and
  # launcher .so): the intermediate stages (IR, PTX, source) are three quarters of it.
  tar czf "$OUT/triton_cache.tgz" -C "$TRITON_CACHE" --exclude='*.llir' --exclude='*.ttir' \
    --exclude='*.ttgir' --exclude='*.ptx' --exclude='*.source' . &&
    summary "Triton's cache: $(du -sh "$TRITON_CACHE" | cut -f1), $(du -h "$OUT/triton_cache.tgz" | cut -f1) packed"
  # flashinfer's JIT-built modules (the .so files alone: VERSION/ARCH/cached_ops/NAME/NAME.so),
  # to carry as .snap/flashinfer_jit.tgz ($FI_JIT_TGZ)
  (cd "$FI_CACHE" && find . -path '*/cached_ops/*' -name '*.so' | tar czf "$OUT/flashinfer_jit.tgz" -T -) &&
    summary "flashinfer's built modules: $(tar tzf "$OUT/flashinfer_jit.tgz" | wc -l), $(du -h "$OUT/flashinfer_jit.tgz" | cut -f1) packed"
  # tvm-ffi's torch extension, to carry as .snap/tvm_ffi_cache.tgz ($TVM_FFI_TGZ)
  (cd "$TVM_FFI_CACHE" && ls ./*.so 2>/dev/null | tar czf "$OUT/tvm_ffi_cache.tgz" -T -) &&
    summary "tvm-ffi's torch extension: $(tar tzf "$OUT/tvm_ffi_cache.tgz" | tr '\n' ' ')"
}

stage_host_profile() {
  # PROFILE_PREFILL=N: a prompt of N tokens instead of decode steps
  timeout 300 python3 -m baton.benchmarks.lab.gpu_host_profile --bs "${PROFILE_BS:-1}" \
    --prefill "${PROFILE_PREFILL:-0}" > "$OUT/host_profile.txt" 2>&1
  summary "host profile: $(grep -m1 'function calls' "$OUT/host_profile.txt")"
}

stage_kernels() {
  for bs in ${KERNELS_BS:-1 32}; do
    # shellcheck disable=SC2086
    timeout 200 python3 -m baton.benchmarks.lab.gpu_profile --bs "$bs" ${KERNELS_ARGS:-} \
      > "$OUT/kernels_bs$bs${KERNELS_TAG:-}.txt" 2>&1
  done
  summary "$(grep -h '^GPU time per' "$OUT"/kernels_bs*${KERNELS_TAG:-}.txt)"
}

stage_linear() {
  timeout 300 python3 -m baton.benchmarks.lab.gpu_linear --batches "${LINEAR_BATCHES:-1,8,32}" \
    --out "$OUT/gpu_linear.json" > "$OUT/gpu_linear.txt" 2>&1
  summary "$(grep -E 'best|failed|Error' "$OUT/gpu_linear.txt")"
}

stage_gate_up() {
  timeout 300 python3 -m baton.benchmarks.lab.gpu_gate_up --rows "${GATE_UP_ROWS:-33,64,128,256,512,2048,8192}" \
    --out "$OUT/gpu_gate_up.json" > "$OUT/gpu_gate_up.txt" 2>&1
  summary "$(grep -E '^best|failed|Error' "$OUT/gpu_gate_up.txt")"
}

stage_prompt_graphs() {
  timeout 400 python3 -m baton.benchmarks.lab.gpu_prompt_graphs --lens "${PROMPT_LENS:-16,128,512,1024,2048}" \
    ${PROMPT_GRAPH_TOKENS:+--graph-tokens $PROMPT_GRAPH_TOKENS} \
    --out "$OUT/gpu_prompt_graphs.json" 2>&1 | grep -v "^WARNING" > "$OUT/gpu_prompt_graphs.txt"
  summary "$(cat "$OUT/gpu_prompt_graphs.txt" | tail -14)"
}

stage_attention() {
  # shellcheck disable=SC2086
  timeout 300 python3 -m baton.benchmarks.lab.gpu_attention --out "$OUT/gpu_attention.json" ${ATTN_ARGS:-} \
    > "$OUT/gpu_attention.txt" 2>&1
  summary "$(cat "$OUT/gpu_attention.txt" | tail -25)"
}

stage_ttft_gaps() {
  timeout 300 python3 -m baton.benchmarks.lab.gpu_gaps --prefill 2048 --out "$OUT/gaps_ttft.json" ${GAPS_STACK:+--stack} \
    2>&1 | grep -v "^WARNING" | tail -25 | tee -a "$OUT/gaps_ttft.log"
  summary "$(grep -E '^(GPU busy|call)' "$OUT/gaps_ttft.log")"
}

stage_ttft_clocks() {
  # the prompt's phases with the GPU idle before it and kept busy, SM clock and power sampled
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu \
    --format=csv -lms 20 > "$OUT/clocks.csv" 2>&1 &
  local smi=$!
  timeout 240 python3 -m baton.benchmarks.lab.gpu_ttft --runs 8 --warm-ms "${TTFT_WARM_MS:-0,40}" \
    2>&1 | grep -v "^WARNING" > "$OUT/ttft_clocks.txt"
  kill $smi
  summary "$(grep -E '^(device|GPU forward|generate)' "$OUT/ttft_clocks.txt")"
}

stage_gaps() {
  for bs in ${GAPS_BS:-1 32}; do
    timeout 300 python3 -m baton.benchmarks.lab.gpu_gaps --bs "$bs" --out "$OUT/gaps_bs$bs.json" \
      2>&1 | grep -v "^WARNING" | tail -25 | tee -a "$OUT/gaps.log"
  done
  summary "$(grep '^GPU busy' "$OUT/gaps.log")"
}

cpu_sampler() {  # FILE: every 5 s, the busiest baton processes' CPU (top's, since the last sample)
  top -b -d 5 -c -w 200 2>/dev/null | grep --line-buffered -E "^top -|baton|bench" \
    | grep --line-buffered -v grep | cut -c1-200 > "$1" &
}

stage_sweep() {
  local name=${SWEEP_NAME:-sweep}
  cpu_sampler "$OUT/$name.cpu.log"
  timeout ${SWEEP_TIMEOUT:-560} python3 -m baton.services.cli bench pd-sweep \
    --shapes "${SWEEP_SHAPES:-1P1D,agg2}" --rates "${SWEEP_RATES:-4,8,12,16}" \
    --duration "${SWEEP_DURATION:-20}" --warmup "${SWEEP_WARMUP:-0}" --input-len "${SWEEP_IN:-800}" --output-len "${SWEEP_OUT_LEN:-256}" \
    --slo "${SWEEP_SLO:-ttft=500ms,tpot=50ms}" --model "$MODEL" --out-dir "$OUT/$name" --no-progress \
    ${SWEEP_ARGS:-} \
    --startup-timeout 300 --up-args "$UP --gpus $GPUS ${SWEEP_UP:-}" 2>&1 | tail -60 > "$OUT/$name.log"
  pkill -f "^top -b -d 5 -c -w 200"
  summary "$(sed -n '/## All runs/,/Latencies/p' "$OUT/$name/report.md" 2>/dev/null)"
  grep -h "$LOG_TROUBLE" "$OUT/$name"/logs/*.log 2>/dev/null | head -20 > "$OUT/${name}_errors.txt"
}

stage_mooncake() {
  # issue #40's replay: the Mooncake conversation trace ($MOONCAKE, carried in .traces/ by
  # gpu_prepare.sh) at the speed-ups $MOONCAKE_SPEEDS, each placement of $PLACEMENTS on
  # $MOONCAKE_SHAPES ($MOONCAKE_AGG, agg4, once, with always-disagg); SLO ttft 2 s, tpot 20 ms. Inputs cut at
  # $MOONCAKE_MAX_IN tokens (default 30,000: with the trace's largest output, 2,000, within
  # 32,768 positions). $MOONCAKE_SAMPLE keeps that share of the conversations, so that at a
  # speed-up of 1/share a window spans more of the trace and turns come back in it (the trace's
  # turns return minutes apart: a minute from its start reuses 6% of prompt tokens, a
  # 1/8 sample at x9.6 28%). One placement at a time
  # fits a call: PLACEMENTS=cost MOONCAKE_SHAPES=2P2D ...
  # MOONCAKE_REPEATS=N: one sweep instead, every placement a shape (1P1D@cost) beside the
  # aggregated one, each point N times on fresh clusters, the shapes in turn (pd-sweep
  # --repeats): at x8 on 2x H200 one run of a placement ranged 1.21-1.88 req/s (s38)
  local trace=${MOONCAKE:-$PWD/.traces/conversation_trace.jsonl}
  local pl shapes shape run runs=() agg=${MOONCAKE_AGG:-agg4}
  [ -n "${MOONCAKE_NO_AGG:-}" ] && agg=""
  for pl in ${PLACEMENTS:-always-disagg threshold cost}; do
    shapes=""
    [ "$pl" = always-disagg ] && shapes=$agg  # (aggregated: placed by no rule, run once)
    for shape in $(tr ',' ' ' <<< "${MOONCAKE_SHAPES:-2P2D,1P3D}"); do
      shapes="${shapes:+$shapes,}$shape@$pl"
    done
    runs+=("$pl:$shapes")
  done
  if [ -n "${MOONCAKE_REPEATS:-}" ]; then  # one sweep of them all
    shapes=$(printf '%s\n' "${runs[@]}" | sed 's/^[^:]*://' | paste -sd,)
    runs=("repeats:$shapes")
  fi
  for run in "${runs[@]}"; do
    pl=${run%%:*} shapes=${run#*:}
    # shellcheck disable=SC2086
    timeout ${MOONCAKE_TIMEOUT:-560} python3 -m baton.services.cli bench pd-sweep \
      --shapes "$shapes" --rates "${MOONCAKE_SPEEDS:-4,8}" --dataset mooncake \
      --dataset-path "$trace" --max-input-len "${MOONCAKE_MAX_IN:-30000}" \
      --conversation-sample "${MOONCAKE_SAMPLE:-1}" --repeats "${MOONCAKE_REPEATS:-1}" \
      --duration "${MOONCAKE_DURATION:-60}" --warmup 0 --slo ttft=2s,tpot=20ms --model "$MODEL" \
      --out-dir "$OUT/mooncake-$pl" --no-progress --startup-timeout 300 \
      --up-args "$UP --gpus $GPUS --decode-radix-cache --tpot-slo 0.02 ${SWEEP_UP:-}" \
      2>&1 | tail -60 > "$OUT/mooncake-$pl.log"
    summary "$pl: $(sed -n '/## Repeats/,/## All runs/p;/## All runs/,/Latencies/p' "$OUT/mooncake-$pl/report.md" 2>/dev/null)"
  done
}

stage_planner() {
  # issue #41's target: a mix that changes midway ($PLANNER_PHASES, IN:OUT@RATE: 400-token
  # prompts with 600 out, then 6,000 with 100 out; $PLANNER_PHASE_S s each) on the shapes
  # $PLANNER_SHAPES, the first started as 1P3D and moved by the planner (first, so that a call
  # that runs out of time keeps it). One SLO for the bench, the router's placement and the
  # planner: TTFT $PLANNER_TTFT s, TPOT $PLANNER_TPOT s. The planner reads a window every
  # $PLANNER_WINDOW s, flips once a proposal held $PLANNER_HOLD windows, none within
  # $PLANNER_COOLDOWN windows of the last. ~3 minutes a shape (a warm start, ~10 s of prompts,
  # the phases, a tail of at most 30 s: --timeout): three shapes fit a call once the kernels
  # are built (on a fresh machine, two); more in another call, e.g. PLANNER_SHAPES=3P1D,agg4.
  # $PLANNER_UP (default --stream-interval 4: the router relays ~7k messages/s) goes to baton up
  local phases=${PLANNER_PHASES:-400:600@20,6000:100@8} phase_s=${PLANNER_PHASE_S:-60}
  local ttft=${PLANNER_TTFT:-2} tpot=${PLANNER_TPOT:-0.05} extra=${PLANNER_UP---stream-interval 4} n
  n=$(tr ',' '\n' <<< "$phases" | grep -c .)
  # shellcheck disable=SC2086
  BATON_WINDOW=${PLANNER_WINDOW:-5} BATON_HOLD_WINDOWS=${PLANNER_HOLD:-2} \
    BATON_COOLDOWN_WINDOWS=${PLANNER_COOLDOWN:-3} BATON_MIN_REQUESTS=${PLANNER_MIN_REQUESTS:-10} \
    timeout ${PLANNER_TIMEOUT:-560} python3 -m baton.services.cli bench pd-sweep \
    --shapes "${PLANNER_SHAPES:-1P3D+planner,2P2D,1P3D}" --rates 1 --phases "$phases" \
    --duration $((phase_s * n)) --timeout 30 --slo "ttft=${ttft}s,tpot=${tpot}s" \
    --model "$MODEL" --out-dir "$OUT/planner" --no-progress --startup-timeout 300 \
    --up-args "$UP --gpus $GPUS --ttft-slo $ttft --tpot-slo $tpot $extra" \
    2>&1 | tail -60 > "$OUT/planner.log"
  summary "planner: $(sed -n '/## Goodput by phase/,/^### /p' "$OUT/planner/report.md" 2>/dev/null)"
  grep -rh "$LOG_TROUBLE" "$OUT/planner/logs" 2>/dev/null \
    | head -20 > "$OUT/planner_errors.txt"
}

stage_flips() {
  # issue #41's role flips under load: 1P3D at $FLIPS_LOAD of the capacity it measures
  # closed-loop for $FLIPS_CAPACITY_S s (or at $FLIPS_RATE req/s), $FLIPS_DURATION s of open
  # loop, $FLIPS_IN-token prompts with $FLIPS_OUT_LEN out; the busiest decode worker turns
  # prefill at the first of $FLIPS_AT s and back at the second. Targets: 0 failed, the longest
  # stall of a migrated stream <= 200 ms, 0 tokens recomputed. ~4 minutes. $FLIPS_UP
  # (default --stream-interval 4) goes to baton up.
  # shellcheck disable=SC2086
  timeout ${FLIPS_TIMEOUT:-560} python3 -m baton.benchmarks.role_flips --model "$MODEL" \
    --shape 1P3D --load "${FLIPS_LOAD:-0.8}" ${FLIPS_RATE:+--request-rate "$FLIPS_RATE"} \
    --capacity-s "${FLIPS_CAPACITY_S:-30}" --duration "${FLIPS_DURATION:-120}" \
    --flip-at "${FLIPS_AT:-40,80}" --input-len "${FLIPS_IN:-800}" \
    --output-len "${FLIPS_OUT_LEN:-256}" --timeout 60 --no-progress --out "$OUT/flips.json" \
    --log-dir "$OUT/flips-logs" --startup-timeout 300 \
    --up-args "$UP --gpus $GPUS ${FLIPS_UP---stream-interval 4}" \
    2>&1 | tail -40 > "$OUT/flips.log"
  summary "flips: $(sed -n '/role flips under load/,$p' "$OUT/flips.log")"
  grep -rh "$LOG_TROUBLE" "$OUT/flips-logs" 2>/dev/null \
    | head -20 > "$OUT/flips_errors.txt"
}

stage_load() {
  # capacity: closed loop at high concurrency for LOAD_CAPACITY_S (40) s (or LOAD_CAPACITY_<run>, req/s,
  # measured before on the same GPU kind); then 1.5x of it, open loop, 300 s. Budget ~10 minutes: start ~2 min, the run,
  # then the backlog drains (up to the router's 60 s queue timeout, then the running batch).
  # One GPU (agg1, GPU 0) and a 1P1D pair sharing GPU 1, at the same time (LOAD_RUNS picks;
  # on a machine of one GPU they run one after the other).
  local dur=${LOAD_DURATION:-300}
  echo "| run | capacity req/s | offered req/s | requests | completed | 429 | 5xx | other failed | held pages after | longest gap between tokens s | stalled > 30 s |" > "$OUT/load_summary.txt"
  echo "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|" >> "$OUT/load_summary.txt"
  run_load() {  # name gpus pool-tokens baton-up-args...
    local name=$1 gpus=$2 pool=$3; shift 3
    local port=$((8100 + RANDOM % 800)) logs="$OUT/$name-logs"
    python3 -m baton.services.cli up --port $port --model "$MODEL" $UP --max-total-tokens "$pool" \
      --gpus "$gpus" --log-dir "$logs" "$@" > "$OUT/$name-up.log" 2>&1 &
    local up=$!
    for _ in $(seq 400); do curl -sf localhost:$port/health >/dev/null && break; sleep 1; done
    local b="python3 -m baton.services.cli bench serve --base-url http://127.0.0.1:$port"
    b="$b --input-len 800 --output-len 256 --no-progress --timeout 600"
    local known="LOAD_CAPACITY_${name//-/_}"  # e.g. LOAD_CAPACITY_agg1=17.04: skips a minute
    local cap=${!known:-}
    if [ -z "$cap" ]; then
      $b --max-concurrency 256 --duration "${LOAD_CAPACITY_S:-40}" --num-requests 4000 --out "$OUT/$name-capacity.json" > "$OUT/$name-capacity.log" 2>&1
      cap=$(python3 -c "import json;print(json.load(open('$OUT/$name-capacity.json'))['summary']['request_throughput'])")
    fi
    local rate; rate=$(python3 -c "print(round(1.5*$cap, 2))")
    $b --request-rate "$rate" --duration "$dur" --out "$OUT/$name-load.json" > "$OUT/$name-load.log" 2>&1
    python3 -m baton.benchmarks.load_report "$OUT/$name-load.json" --capacity "$cap" --rate "$rate" \
      --log-dir "$logs" --name "$name" >> "$OUT/load_summary.txt" 2>>"$OUT/load_errors.txt"
    kill -INT $up; wait $up
  }
  local runs=${LOAD_RUNS:-agg1 pd-1gpu}
  [[ " $runs " == *" agg1 "* ]] && run_load agg1 0 262144 --workers 1 &
  if [[ " $runs " == *" pd-1gpu "* ]]; then
    if [ "$NGPU" -gt 1 ]; then run_load pd-1gpu 1 120000 --prefill 1 --decode 1 &
    else wait; run_load pd-1gpu 0 120000 --prefill 1 --decode 1; fi  # one GPU: one after the other
  fi
  wait
  summary "$(cat "$OUT/load_summary.txt")"
}

stage_offload_step() {
  local mem args=${OFFLOAD_ARGS:-}
  mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0)
  [ -z "$args" ] && [ "${mem:-0}" -lt 100000 ] && args="--ctx 2048"  # an 80 GB GPU
  # shellcheck disable=SC2086
  timeout 480 python3 -m baton.benchmarks.lab.gpu_offload_step --out "$OUT/offload_step.json" \
    $args 2>&1 | grep -v "^WARNING" > "$OUT/offload_step.txt"
  summary "$(grep -E '^(\||engine:|host tier)|Error' "$OUT/offload_step.txt")"
}

replay_pair() {
  # The Mooncake replay of stage host_tier on two one-GPU aggregated clusters at once, each
  # its own `baton up` args: DIR NAME_A "ARGS_A" NAME_B "ARGS_B" (GPUs 0 and
  # $HOST_TIER_PLAIN_GPU, 1); then DIR/report.md, their side-by-side table
  local dir=$1 base=${HOST_TIER_BASE_UP:-$UP}
  [ "$NGPU" -ge 2 ] || [ -n "${HOST_TIER_BASE_UP:-}" ] || { echo "replay: needs 2 GPUs"; return 1; }
  local trace=${MOONCAKE:-$PWD/.traces/conversation_trace.jsonl} pool=${HOST_TIER_POOL:-131072}
  replay_on() {  # name gpu port baton-up-args...
    local name=$1 gpu=$2 port=$3 report="python3 -m baton.benchmarks.host_tier_report"; shift 3
    local d="$dir/$name"; mkdir -p "$d"
    # shellcheck disable=SC2086
    python3 -m baton.services.cli up --port "$port" --model "$MODEL" $base \
      --max-total-tokens "$pool" --gpus "$gpu" --workers 1 --log-dir "$d/logs" "$@" \
      > "$d/up.log" 2>&1 &
    local up=$!
    for _ in $(seq 400); do  # (a cluster that exits, e.g. refused its tier, is not waited for)
      curl -sf "localhost:$port/health" >/dev/null || ! kill -0 $up 2>/dev/null && break; sleep 1
    done
    $report scrape "$d/logs" "$d/metrics_before.json"
    # shellcheck disable=SC2086
    timeout -s INT "${HOST_TIER_TIMEOUT:-300}" python3 -m baton.services.cli bench serve \
      --base-url "http://127.0.0.1:$port" --dataset mooncake --dataset-path "$trace" \
      --conversation-sample "${HOST_TIER_SAMPLE:-0.02}" --time-scale "${HOST_TIER_SCALE:-0.035}" \
      --max-input-len "${HOST_TIER_MAX_IN:-30000}" --no-progress --timeout 120 \
      --out "$d/bench.json" ${HOST_TIER_BENCH:-} > "$d/bench.log" 2>&1
    $report scrape "$d/logs" "$d/metrics_after.json"
    kill -INT $up; wait $up
  }
  # shellcheck disable=SC2086
  replay_on "$2" 0 $((8100 + RANDOM % 400)) $3 ${HOST_TIER_UP:-} &
  # shellcheck disable=SC2086
  replay_on "$4" "${HOST_TIER_PLAIN_GPU:-1}" $((8500 + RANDOM % 400)) $5 ${HOST_TIER_UP:-}
  wait
  python3 -m baton.benchmarks.host_tier_report table "$2=$dir/$2" "$4=$dir/$4" \
    --pool "$pool" --out "$dir/figures.json" > "$dir/report.md" 2>&1
  grep -h "$LOG_TROUBLE" "$dir"/*/logs/*.log 2>/dev/null \
    | head -20 > "$dir/errors.txt" || true  # (none found: grep fails)
}

stage_host_tier() {
  # issue #43's replay: $HOST_TIER_SAMPLE (0.02) of the Mooncake trace's conversations, its
  # 59 minutes at x$HOST_TIER_SCALE (0.035: in 2.1 minutes; about 190 requests, 13,000 prompt
  # tokens/s offered, a quarter of them reusable: near an 8B GPU's prefill rate, where the
  # tokens the tier saves shorten the queue), inputs cut at 30,000 tokens, on two
  # one-GPU aggregated clusters at once: GPU 0 with --host-kv-tokens $HOST_TIER_TOKENS
  # (524,288: 64 GiB pinned), GPU 1 without, both with a pool of $HOST_TIER_POOL (131,072)
  # tokens, which the window's working set (~1.2M tokens) exceeds ~9x. The table
  # (host_tier/report.md) reads the bench results and the workers' /metrics before and after.
  # Needs 2 GPUs and ~80 GiB of free host memory; ~8 minutes (start, the replay, at most
  # $HOST_TIER_TIMEOUT s with the drain). HOST_TIER_BASE_UP replaces $UP (a CPU try:
  # '--device cpu' with MODEL a tiny model, HOST_TIER_PLAIN_GPU=0).
  local dir="$OUT/host_tier${HOST_TIER_SCALE:+_x$HOST_TIER_SCALE}"
  replay_pair "$dir" tier "--host-kv-tokens ${HOST_TIER_TOKENS:-524288}" plain "" || return 1
  summary "host_tier: pool ${HOST_TIER_POOL:-131072} tokens, $(cat "$dir/report.md")"
}

stage_chunking() {
  # the same replay on two one-GPU clusters without a host tier: the server's default (no
  # prompt chunking: up to 16,384 tokens a step) against $CHUNKING_B ('--chunked-prefill-size
  # 4096'): whether a request that arrives during a long prompt step (baton_timings'
  # `ingress`) waits less, and what smaller steps cost the long prompts
  local dir="$OUT/chunking"
  replay_pair "$dir" default "" chunked "${CHUNKING_B:---chunked-prefill-size 4096}" || return 1
  summary "chunking (${CHUNKING_B:---chunked-prefill-size 4096}): $(cat "$dir/report.md")"
}

stage_host_hit() {
  # issue #43: what a host-tier prefix hit is worth against a device hit, on GPU 0
  # (gpu_host_hit on $MODEL, whose context holds its 14k-token prompts; $HOST_HIT_ARGS go to it)
  # shellcheck disable=SC2086
  timeout 400 python3 -m baton.benchmarks.lab.gpu_host_hit --out "$OUT/host_hit.json" \
    --model "$MODEL" ${HOST_HIT_ARGS:-} 2>&1 | grep -v "^WARNING" > "$OUT/host_hit.txt"
  summary "$(grep -E '^(\||engine:|host hit value)|Error' "$OUT/host_hit.txt")"
}

for stage in "$@"; do
  echo "== $stage $(date +%T)"
  "stage_$stage"
done
echo "== summary"; cat "$OUT/summary.txt" 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$OUT" --exclude=logs.tgz . 2>/dev/null
