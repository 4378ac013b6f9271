#!/usr/bin/env bash
# Prepare, on a machine with PyPI access, what a GPU machine without network needs for
# benchmarks/gpu_session.sh: wheels for Python 3.12 (flashinfer and the serving stack the
# GPU image lacks, uvloop and httptools for uvicorn's fast paths, py-spy to profile a
# process) in .wheels/, and a Llama-3.1-8B-shaped model folder without weights in
# .gpu_model/llama8b (served with --load-format dummy). Both folders are ignored by git:
# hand them to the GPU machine with the working tree (the device tool's `carry`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
P="--only-binary=:all: --no-deps --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_34_x86_64"
# flashinfer imports cuDNN's frontend only where it is installed: left out, as the device
# carries 64 MiB of working tree and wheels together
# shellcheck disable=SC2086
$PY -m pip download -q $P -d .wheels/fi flashinfer-python==0.5.3 apache-tvm-ffi==0.1.3
# pydantic pins its pydantic-core; protobuf must be at least the stubs' generator version
# shellcheck disable=SC2086
$PY -m pip download -q $P -d .wheels/srv msgspec pyzmq fastapi starlette pydantic pydantic-core \
  annotated-types annotated-doc typing-inspection typing-extensions uvicorn opentelemetry-api \
  h11 click anyio sniffio idna uvloop httptools py-spy grpcio==1.85.1 protobuf==7.35.1 \
  aiohttp multidict yarl frozenlist aiosignal propcache aiohappyeyeballs attrs
# made again each time (seconds): a folder from an older tree keeps that tree's tokenizer
rm -rf .gpu_model/llama8b
baton make-model .gpu_model/llama8b --vocab 32000
rm -f .gpu_model/llama8b/*.safetensors
$PY - <<'PYEOF'
import json, pathlib
p = pathlib.Path(".gpu_model/llama8b/config.json")
c = json.loads(p.read_text())
c.update(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
         num_key_value_heads=8, head_dim=128, torch_dtype="bfloat16", max_position_embeddings=32768)
c.pop("dtype", None)
p.write_text(json.dumps(c, indent=1))
PYEOF
# the Mooncake trace for the mooncake stage (outside the repository: carried, not committed)
mkdir -p .traces && cp -f "${MOONCAKE_SRC:-../shared/workloads/mooncake/conversation_trace.jsonl}" .traces/ 2>/dev/null ||
  echo "no Mooncake trace at ${MOONCAKE_SRC:-../shared/workloads/mooncake/}: the mooncake stage needs one"
# The tree, .wheels/ and these two folders unpacked pass a call's 64 MiB (s38: 68 MB):
# packed (0.3 MB: the tokenizer's JSON compresses well) in .snap/, which gpu_session.sh
# unpacks where they are missing. Carry [".wheels", ".snap"].
mkdir -p .snap && tar cJf .snap/data.tar.xz .gpu_model .traces
du -sh .wheels .gpu_model .traces .snap/data.tar.xz
