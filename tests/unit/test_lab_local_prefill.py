"""The local-prefill benchmark (`benchmarks/lab/gpu_local_prefill.py`) runs end to end on a
CPU with a tiny model: a decode worker with requests decoding computes prompts handed to
it in steps beside them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from baton.benchmarks.lab import gpu_local_prefill


@pytest.mark.timeout(120)
def test_a_decode_worker_computes_prompts_beside_its_running_requests(
    tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "local_prefill.json"
    argv = ["--device", "cpu", "--model", str(tiny_model), "--backend", "torch"]
    argv += ["--batches", "3", "--context", "32", "--prompt-len", "100", "--seconds", "1"]
    argv += ["--pool-tokens", "8192", "--tpot-slo", "0.5", "--out", str(out)]
    assert gpu_local_prefill.main(argv) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["mode"] == "eager" and row["batch"] == 3  # (no piecewise graphs on a CPU)
    assert row["prompts"] >= 2 and row["prompt_tok_s"] > 0
    assert 0 < row["mixed_share"] <= 1 and row["tpot_ms"] > 0
