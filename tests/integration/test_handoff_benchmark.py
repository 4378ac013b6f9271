"""The handoff benchmark on the CPU (the ipc backend's memfd path, two processes): every
byte arrives and the report says where the time went, stage by stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from baton.benchmarks.lab import gpu_pd


@pytest.mark.timeout(120)
def test_a_cpu_handoff_reports_its_bytes_and_its_stages(tmp_path: Path) -> None:
    out = tmp_path / "handoff.json"
    args = ["--backend", "ipc", "--devices", "cpu", "--tokens", "40", "--rounds", "3"]
    assert gpu_pd.main([*args, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["checksum_ok"] and result["device"] == "cpu (memfd)"
    stages = result["breakdown_ms_median"]
    # D's doorbells: the final status leaves before the copies end (see transfer/doorbell)
    assert result["belled_rounds"] >= 2  # every round but perhaps the first (its lane connects)
    assert list(stages) == list(gpu_pd.BELL_STAGES)
    # stamps of two processes on one monotonic clock: a stage of a few microseconds may
    # come out slightly negative, the whole handoff not
    assert sum(stages.values()) > 0 and all(ms > -1.0 for ms in stages.values())
