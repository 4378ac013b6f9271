"""KV pages handed from one process's GPU pool to another's through the `ipc` backend
arrive intact: on one GPU, and across two GPUs through a peer mapping of D's pool; from
the second room on, the sending thread launches the copies and the copy stream rings D's
doorbell behind them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from baton.benchmarks.lab import gpu_pd


@pytest.mark.timeout(300)
@pytest.mark.parametrize("devices", ["0", "0,1"])
def test_ipc_handoff_delivers_every_byte(tmp_path: Path, devices: str) -> None:
    if "," in devices and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    out = tmp_path / "handoff.json"
    args = ["--backend", "ipc", "--devices", devices, "--tokens", "300", "--rounds", "3"]
    assert gpu_pd.main([*args, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["checksum_ok"], result  # every round's pages, each round from zeros
    assert len(result["handoff_ms_all"]) == 3
    # After the first room connected, P's thread queued the copies itself, sent the final
    # status at once, and queued the doorbell behind the copies on the GPU.
    assert result["launched_rounds"] == 2, result
    assert result["bells_launched"] >= 2 and result["belled_rounds"] >= 2, result
