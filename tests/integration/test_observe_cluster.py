"""Seeing a running 1P1D cluster: `baton top`'s text against it.

One cluster serves every test of the module (starting one takes most of a test's time on
two cores); each test sends the traffic it reads back.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.cluster import Cluster, cluster

SNAPSHOTS = Path(__file__).parent / "snapshots"


@pytest.fixture(scope="module")
def pd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(tmp_path_factory.mktemp("observe"), "--prefill", "1", "--decode", "1") as c:
        yield c


def _complete(c: Cluster, prompt: str, max_tokens: int = 8) -> dict[str, object]:
    status, body = c.post(
        "/v1/completions",
        {"model": c.model_name, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True},
    )
    assert status == 200, body
    return body


def _masked(text: str) -> str:
    """`text` with what changes from run to run masked: launch ids, numbers, padding."""
    text = re.sub(r"-[0-9a-f]{8}\b", "-<launch>", text)
    text = re.sub(r"(?<!p)\b\d+(\.\d+)?", "#", text)  # not p50, p99
    return "\n".join(re.sub(r" +", " ", line).strip() for line in text.splitlines()) + "\n"


@pytest.mark.timeout(60)
def test_top_once_shows_each_worker_and_the_cluster_latency(pd_cluster: Cluster) -> None:
    for i in range(3):
        _complete(pd_cluster, f"a prompt for top {i}")
    done = subprocess.run(
        [sys.executable, "-m", "baton.services.cli", "top", "--once", "--url", pd_cluster.url],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert _masked(done.stdout) == (SNAPSHOTS / "top_1p1d.txt").read_text()
    # The requests above were served: their latency shows, it is no placeholder.
    assert "TTFT p50 -" not in done.stdout and "TPOT p50 -" not in done.stdout
