"""PD on GPUs: a real 1P1D cluster whose KV pages move GPU to GPU (`auto` picks ipc
between the two processes) gives the aggregated engine's greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from baton.common.engine import Engine
from baton.common.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.integration.cluster import cluster

MAX_NEW = 16


@pytest.fixture(scope="module")
def gpu_model(model_factory):  # type: ignore[no-untyped-def]
    return model_factory("llama", hidden=256, heads=4, kv_heads=2)


COMMON = ["--device", "cuda", "--attention-backend", "triton", "--page-size", "16"]


def aggregated_greedy(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)
    with Engine(
        model, device="cuda", attention_backend="triton", page_size=16, disable_cuda_graph=True
    ) as engine:
        return [o.output_ids for o in engine.generate(prompts, params)]


def assert_greedy(c, prompts: list[list[int]], expected: list[list[int]]) -> None:  # type: ignore[no-untyped-def]
    for prompt, want in zip(prompts, expected, strict=True):
        status, body = c.post(
            "/generate",
            {
                "input_ids": prompt,
                "sampling_params": {
                    "temperature": 0,
                    "max_new_tokens": MAX_NEW,
                    "ignore_eos": True,
                },
            },
        )
        assert status == 200, body
        assert body["output_ids"] == want


@pytest.mark.timeout(400)
def test_1p1d_over_ipc_equals_aggregated(tmp_path: Path, gpu_model) -> None:  # type: ignore[no-untyped-def]
    prompts = random_prompts([5, 60, 300, 700], vocab=2000, seed=11)
    expected = aggregated_greedy(gpu_model, prompts)
    gpus = "0,1" if torch.cuda.device_count() > 1 else "0"
    args = ["--prefill", "1", "--decode", "1", "--gpus", gpus, *COMMON]
    with cluster(tmp_path, *args, model=str(gpu_model), timeout=300) as c:
        assert_greedy(c, prompts, expected)
        prefill_log = "".join(p.read_text() for p in c.log_dir.glob("prefill-*.log"))
        assert "kv auto: using ipc" in prefill_log, c.logs()
        c.wait_idle()  # every worker back at zero held pages


@pytest.mark.timeout(500)
@pytest.mark.parametrize(
    "tp_args", [["--prefill-tp", "2"], ["--decode-tp", "2"]], ids=["P-tp2-D-tp1", "P-tp1-D-tp2"]
)
def test_heterogeneous_tp_on_gpus_equals_aggregated(tmp_path: Path, gpu_model, tp_args) -> None:  # type: ignore[no-untyped-def]
    """P and D at different TP sizes on their own GPUs (NCCL between a worker's ranks):
    P's rank 0 gathers full-head pages, D's rank 0 scatters them; greedy tokens equal the
    aggregated engine's."""
    if torch.cuda.device_count() < 3:
        pytest.skip("needs 3 GPUs: one worker at TP 2, the other at TP 1")
    prompts = random_prompts([5, 60, 300, 700], vocab=2000, seed=12)
    expected = aggregated_greedy(gpu_model, prompts)
    args = ["--prefill", "1", "--decode", "1", "--gpus", "0,1,2", *tp_args, *COMMON]
    with cluster(tmp_path, *args, model=str(gpu_model), timeout=400) as c:
        assert_greedy(c, prompts, expected)
        c.wait_idle()
