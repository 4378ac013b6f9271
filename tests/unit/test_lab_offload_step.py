"""The offload-step benchmark (`benchmarks/lab/gpu_offload_step.py`) runs end to end on a
CPU with a tiny model: every arm is timed, the offload arms evict pages at their rate and
move pages to the host tier through the engine's eviction (on demand and ahead of it), the
arm without offload moves none, and no page leaks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from baton.benchmarks.lab import gpu_offload_step


@pytest.mark.timeout(120)
def test_offload_arms_move_pages_and_the_plain_arm_moves_none(
    tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "offload.json"
    argv = ["--device", "cpu", "--model", str(tiny_model), "--batches", "1,4", "--ctx", "64"]
    argv += ["--rates", "growth,3", "--block", "3", "--rounds", "2", "--warmup", "1"]
    argv += ["--host-gib", "0.002", "--out", str(out)]
    assert gpu_offload_step.main(argv) == 0
    result = json.loads(out.read_text())
    rows = {(r["batch"], r["offload"]): r for r in result["rows"]}
    assert set(rows) == {(b, a) for b in (1, 4) for a in ("none", "growth", "3")}
    for (_, arm), row in rows.items():
        assert row["steps"] == 2 * 3
        assert row["median_ms"] > 0 and row["p90_ms"] >= row["median_ms"]
        if arm == "none":
            assert row["mib_per_step"] == 0 and row["median_ratio"] == 1.0
        else:
            rate = 3 if arm == "3" else 1  # growth: 1 or 4 requests need a page in 16 steps
            assert row["pages_per_step"] == rate
            # copied on demand or ahead (the stock mostly in the untimed steps that start a
            # block), each of a block's nodes (4 of stock, one inserted a step) at most once
            page_mib = result["page_bytes"] / 2**20
            copied = row["mib_per_step"] / page_mib * row["steps"]
            assert 0 < copied <= (row["steps"] + 2 * 4) * rate
    # the host tier was full while timed: each offload dropped its least recently used page
    assert result["tier_counters"]["dropped_pages"] > 0
