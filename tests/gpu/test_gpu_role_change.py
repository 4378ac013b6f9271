"""A role changed in place on GPUs (issue 41 item 2): a decode worker of a 1P2D cluster
becomes a prefill worker and back while requests run; its scheduler keeps its CUDA pool
and graphs, a new KV manager maps its peers' pools (ipc), and every answer stays the
aggregated engine's greedy tokens. Passed on one H200 (the three workers sharing it),
2026-11-28; not yet run with a GPU per worker."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from tests.conftest import random_prompts
from tests.gpu.test_gpu_disagg import COMMON, aggregated_greedy, assert_greedy
from tests.integration.cluster import cluster

ADMIN = "admin-" + "gpu-role"
AUTH = {"authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def gpu_model(model_factory):  # type: ignore[no-untyped-def]
    return model_factory("llama", hidden=256, heads=4, kv_heads=2)


@pytest.mark.timeout(600)
def test_flip_a_decode_worker_to_prefill_and_back_on_gpus(tmp_path: Path, gpu_model) -> None:  # type: ignore[no-untyped-def]
    prompts = random_prompts([5, 60, 300, 700], vocab=2000, seed=13)
    expected = aggregated_greedy(gpu_model, prompts)
    gpus = ",".join(str(i) for i in range(min(3, torch.cuda.device_count())))
    args = ["--prefill", "1", "--decode", "2", "--gpus", gpus, *COMMON]
    env = {"BATON_ADMIN_API_KEY": ADMIN}
    with cluster(tmp_path, *args, model=str(gpu_model), timeout=400, env=env) as c:
        assert_greedy(c, prompts, expected)
        decode = sorted(w.worker_id for w in c.workers() if w.worker_id.startswith("decode"))[0]
        for role in ("prefill", "decode"):
            errors: list[BaseException] = []
            runner = threading.Thread(target=_stream, args=(c, prompts, expected, errors))
            runner.start()
            status, body = c.post(f"/admin/workers/{decode}/role", {"role": role}, 300, AUTH)
            runner.join(300)
            assert status == 200, body
            assert not errors, errors
            assert_greedy(c, prompts, expected)  # through the worker in its new role
        c.wait_idle()  # no page held on any worker, the flipped one included


def _stream(c, prompts, expected, errors: list[BaseException]) -> None:  # type: ignore[no-untyped-def]
    """The prompts while a role changes; what failed is kept for the test to report."""
    try:
        assert_greedy(c, prompts, expected)
    except BaseException as e:
        errors.append(e)
