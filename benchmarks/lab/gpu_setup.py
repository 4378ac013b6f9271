"""The engine every GPU benchmark builds (`make_engine`): Llama-3.1-8B's shape with random
weights in bf16 (`load_format="dummy"`), pages of 16, the backend, CUDA graphs, overlap
and TP as the benchmark asks; the random prompts they feed it, how those sample
(`sampling_knobs`); the garbage collections during a timing are `GcPauses`, the
workers' own (`common/engine/process.py`)."""

from __future__ import annotations

import json
import platform
import random
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypedDict, cast

LLAMA_31_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 32768,  # as the served folder (gpu_prepare.sh): labs run 10k contexts
    "tie_word_embeddings": False,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}


def model_dir() -> str:
    d = Path(tempfile.mkdtemp(prefix="llama8b-"))
    (d / "config.json").write_text(json.dumps(LLAMA_31_8B))
    return str(d)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 120000) for _ in range(length)] for _ in range(n)]


def markdown_table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """`rows` as a Markdown table: one column per (header, row key, format spec), numbers
    right-aligned (a spec of "" leaves the value as it is, left-aligned)."""
    lines = [
        "| " + " | ".join(header for header, _, _ in columns) + " |",
        "|" + "|".join("---:" if spec else "---" for _, _, spec in columns) + "|",
    ]
    for r in rows:
        lines.append("| " + " | ".join(format(r[key], spec) for _, key, spec in columns) + " |")
    return "\n".join(lines)


def run_header(module: str) -> dict[str, Any]:
    """What every lab result records first: when, on what, by which command."""
    import torch

    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "host": platform.node(),
        "command": f"python -m baton.benchmarks.lab.{module} " + " ".join(sys.argv[1:]),
        "torch": torch.__version__,
    }


def make_engine(
    path: str,
    backend: str,
    max_tokens: int,
    max_running: int,
    graphs: bool,
    tp_size: int = 1,
    overlap: bool = True,
    prompt_graph_tokens: int | None = None,
    decode_backend: str | None = None,
    **options: Any,
):
    """`decode_backend`: decode's attention kernels, None for the engine's default;
    `options`: other engine options, over these (`host_kv_tokens`; `device="cpu"` with a
    small model folder, to try a benchmark without a GPU)."""
    from baton.common.engine import Engine
    from baton.common.engine.process import freeze_heap
    from baton.services.worker.scheduler_proc import GIL_SWITCH_INTERVAL_S

    # the scheduler and forward threads share the GIL as in a worker's scheduler process
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    settings: dict[str, Any] = dict(
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        attention_backend=backend,
        page_size=16,
        max_total_tokens=max_tokens,
        max_running_requests=max_running,
        disable_cuda_graph=not graphs,
        chunked_prefill_size=8192,
        max_prefill_tokens=16384,
        cuda_graph_max_bs=256,
        decode_reserve_tokens=256,
        tp_size=tp_size,
        disable_overlap=not overlap,
        **(
            {} if prompt_graph_tokens is None else {"prefill_graph_max_tokens": prompt_graph_tokens}
        ),
        decode_attention_backend=decode_backend,  # None: the engine's default
    )
    engine = Engine(path, **{**settings, **options})
    freeze_heap()  # as a worker's scheduler process does once its engine is up
    return engine


class SamplingKnobs(TypedDict, total=False):
    """The SamplingParams fields a decode step samples with, as keyword arguments."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float


SAMPLING_KNOBS = tuple(SamplingKnobs.__annotations__)


def sampling_knobs(text: str) -> SamplingKnobs:
    """'temperature=0.7,top_p=0.9' -> the SamplingParams fields a decode step samples with
    ('greedy' or '': temperature 0)."""
    if text in ("", "greedy"):
        return {"temperature": 0.0}
    knobs: dict[str, float] = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name not in SAMPLING_KNOBS:
            raise ValueError(f"--sampling: {name!r} is not one of {', '.join(SAMPLING_KNOBS)}")
        knobs[name] = int(value) if name in ("top_k", "seed") else float(value)
    return cast(SamplingKnobs, knobs)  # every name checked above, top_k and seed as int


class HostTimes:
    """The host's time in the runner's `prepare` (scheduler thread) and `execute` (the
    forward thread under overlap: it launches the step and, where it does, the sampler)
    while in the `with` block, per call. Neither waits for the GPU in a steady decode loop,
    so this is the host work a step costs, hidden behind the GPU while it is shorter."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.times: dict[str, list[float]] = {"prepare": [], "execute": []}

    def _wrap(self, name: str) -> None:
        inner = getattr(self.runner, name)
        times = self.times[name]

        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args)
            finally:
                times.append(time.perf_counter() - start)

        setattr(self.runner, name, timed)

    def __enter__(self) -> HostTimes:
        for name in self.times:
            self._wrap(name)
        return self

    def __exit__(self, *exc: object) -> None:
        for name in self.times:
            delattr(self.runner, name)  # the class's method again

    def medians_ms(self) -> dict[str, float]:
        return {
            name: round(statistics.median(t) * 1e3, 3) if t else 0.0
            for name, t in self.times.items()
        }
