"""The host-hit benchmark (`benchmarks/lab/gpu_host_hit.py`) runs end to end on a CPU with
a tiny model: the device arm finds its prefix on the device, the host arm finds it only
on the host tier and loads it back, the plain arm finds nothing, and no page leaks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from baton.benchmarks.lab import gpu_host_hit


@pytest.mark.timeout(120)
def test_each_arm_finds_its_prefix_where_it_was_put(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "host_hit.json"
    argv = ["--device", "cpu", "--model", str(tiny_model), "--prefixes", "32,48"]
    argv += ["--suffixes", "8", "--runs", "2", "--out", str(out)]
    assert gpu_host_hit.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["prefix"], r["suffix"]) for r in rows] == [(32, 8), (48, 8)]
    for row in rows:
        prefix = row["prefix"]
        assert row["cached_device"] >= prefix and row["cached_host"] >= prefix
        assert row["loaded_mib"] > 0  # the host arm's prefix came back from the host
        assert row["none_ms"] > 0 and row["device_ms"] > 0 and row["host_ms"] > 0
