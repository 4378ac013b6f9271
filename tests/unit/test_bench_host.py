"""A recorded benchmark names the GPUs it ran on, not only the host's CPUs."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton.benchmarks.presence import host_description


def test_the_host_line_counts_the_gpus_nvidia_smi_lists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf 'NVIDIA H100 80GB HBM3\\nNVIDIA H100 80GB HBM3\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert host_description().endswith("; GPUs: 2x NVIDIA H100 80GB HBM3)")
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert "GPUs" not in host_description()
