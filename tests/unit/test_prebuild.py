"""Kernel modules compile side by side beside the load, and a failed or missing one is
named rather than fatal (`common/attention/prebuild.py`)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from baton.common.attention.prebuild import Prebuild, start_flashinfer_prebuild


class SlowSpec:
    def __init__(self, name: str, jit_dir: Path, seconds: float, fail: bool = False) -> None:
        self.name, self.jit_dir, self.seconds, self.fail = name, jit_dir, seconds, fail

    def build(self, verbose: bool) -> None:
        time.sleep(self.seconds)
        if self.fail:
            raise RuntimeError("nvcc exited with 1")
        (self.jit_dir / self.name).mkdir(parents=True, exist_ok=True)
        (self.jit_dir / self.name / f"{self.name}.so").write_bytes(b"")


def test_modules_compile_side_by_side_while_the_caller_goes_on(tmp_path: Path) -> None:
    specs = [SlowSpec(f"module_{i}", tmp_path, 0.4) for i in range(3)]
    start = time.monotonic()
    prebuild = Prebuild(specs, tmp_path).start()
    assert time.monotonic() - start < 0.2  # the load goes on meanwhile
    prebuild.wait()
    assert time.monotonic() - start < 1.0  # three 0.4 s builds at once, not 1.2 s in a row
    assert prebuild.compiled() == {"module_0", "module_1", "module_2"}


def test_a_failed_build_is_logged_and_left_to_first_use(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    specs = [SlowSpec("good", tmp_path, 0.0), SlowSpec("bad", tmp_path, 0.0, fail=True)]
    with caplog.at_level(logging.WARNING, logger="baton.scheduler"):
        Prebuild(specs, tmp_path).start().wait()
    assert "building bad failed (RuntimeError: nvcc exited with 1)" in caplog.text


def test_a_module_compiled_later_that_was_not_prebuilt_is_named(tmp_path: Path) -> None:
    prebuild = Prebuild([SlowSpec("single_prefill", tmp_path, 0.0)], tmp_path).start()
    prebuild.wait()
    built = prebuild.compiled()
    SlowSpec("batch_decode", tmp_path, 0.0).build(False)  # what a warm-up compiled itself
    assert prebuild.unexpected(built) == ["batch_decode"]


def test_specs_that_cannot_be_named_leave_the_warm_up_to_compile(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def moved(head_dim: int, dtype: object, device: object) -> list:
        raise ImportError("cannot import name 'gen_batch_prefill_module'")

    with caplog.at_level(logging.WARNING, logger="baton.scheduler"):
        assert start_flashinfer_prebuild(128, "bfloat16", "cuda", specs=moved) is None
    assert "cannot name its kernel modules" in caplog.text
