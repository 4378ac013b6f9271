"""flashinfer's modules compile side by side in one ninja process beside the load, leave a
build log that flashinfer's own later builds agree with, and a failed or missing module is
named rather than fatal (`common/attention/prebuild.py`)."""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from baton.common.attention.prebuild import (
    Buildable,
    Prebuild,
    start_flashinfer_prebuild,
)

needs_ninja = pytest.mark.skipif(shutil.which("ninja") is None, reason="no ninja binary")
BUILD_SECONDS = 0.5


class Module:
    """A flashinfer-like module: its own ninja file, outputs named relative to the JIT
    folder, and the same rule name as every other module's (as flashinfer writes them)."""

    def __init__(self, jit_dir: Path, name: str) -> None:
        self.name = name
        self.ninja_path = jit_dir / name / "build.ninja"
        self.lock_path = jit_dir / f"{name}.lock"
        self.jit_dir = jit_dir

    def write_ninja(self) -> None:
        self.ninja_path.parent.mkdir(parents=True, exist_ok=True)
        self.ninja_path.write_text(
            f"name = {self.name}\n"
            "rule link\n"  # deps like flashinfer's nvcc rule: a depfile in ninja's deps log
            f"  command = sleep {BUILD_SECONDS} && echo '$out: {self.ninja_path}' > $out.d"
            " && touch $out\n"
            "  depfile = $out.d\n"
            "  deps = gcc\n"
            "build $name/$name.so: link\n"
            "default $name/$name.so\n"
        )

    @property
    def library(self) -> Path:
        return self.jit_dir / self.name / f"{self.name}.so"

    def build_alone(self) -> float:
        """What flashinfer does at first use: its own ninja in the shared folder."""
        start = time.monotonic()
        subprocess.run(
            ["ninja", "-C", str(self.jit_dir), "-f", str(self.ninja_path)],
            check=True,
            capture_output=True,
        )
        return time.monotonic() - start


@needs_ninja
def test_modules_build_at_once_and_flashinfers_own_build_then_has_nothing_to_do(
    tmp_path: Path,
) -> None:
    modules = [Module(tmp_path, f"module_{i}") for i in range(3)]
    start = time.monotonic()
    prebuild = Prebuild(modules, tmp_path).start()
    assert time.monotonic() - start < 0.3  # the load goes on meanwhile
    prebuild.wait()
    assert prebuild.error is None
    assert time.monotonic() - start < 2 * BUILD_SECONDS  # side by side, not one by one
    assert prebuild.compiled() == {"module_0", "module_1", "module_2"}
    built_at = {m.name: m.library.stat().st_mtime_ns for m in modules}
    for m in modules:  # the warm-up's first use of each: no rebuild
        assert m.build_alone() < BUILD_SECONDS
        assert m.library.stat().st_mtime_ns == built_at[m.name]


@needs_ninja
def test_workers_starting_together_build_each_module_once(tmp_path: Path) -> None:
    """Four workers of one machine prebuild at once. Two ninja processes in one folder at
    once lose each other's deps-log entries, and every later build there starts over."""
    workers = [[Module(tmp_path, f"module_{i}") for i in range(2)] for _ in range(4)]
    prebuilds = [Prebuild(modules, tmp_path).start() for modules in workers]
    for p in prebuilds:
        p.wait()
    assert all(p.error is None for p in prebuilds)
    for m in workers[0]:
        assert m.build_alone() < BUILD_SECONDS


def test_a_failed_build_is_logged_and_left_to_first_use(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def nvcc_fails(build_dir: Path, specs: Sequence[Buildable]) -> None:
        raise RuntimeError("ninja exited with 1: nvcc fatal")

    with caplog.at_level(logging.WARNING, logger="baton.scheduler"):
        prebuild = Prebuild([Module(tmp_path, "bad")], tmp_path, build=nvcc_fails).start()
        prebuild.wait()
    assert "building its modules failed (RuntimeError: ninja exited with 1: nvcc fatal)" in (
        caplog.text
    )


def test_a_module_compiled_later_that_was_not_prebuilt_is_named(tmp_path: Path) -> None:
    def touch(build_dir: Path, specs: Sequence[Buildable]) -> None:
        for spec in specs:
            spec.ninja_path.parent.mkdir(parents=True, exist_ok=True)
            (spec.ninja_path.parent / f"{spec.name}.so").touch()

    prebuild = Prebuild([Module(tmp_path, "single_prefill")], tmp_path, build=touch).start()
    prebuild.wait()
    built = prebuild.compiled()
    touch(tmp_path, [Module(tmp_path, "batch_decode")])  # what a warm-up compiled itself
    assert prebuild.unexpected(built) == ["batch_decode"]


def test_modules_that_cannot_be_named_leave_the_warm_up_to_compile(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def moved(head_dim: int, dtype: object, device: object) -> list[Buildable]:
        raise ImportError("cannot import name 'gen_batch_prefill_module'")

    with caplog.at_level(logging.WARNING, logger="baton.scheduler"):
        assert start_flashinfer_prebuild(128, "bfloat16", "cuda", specs=moved) is None
    assert "cannot name its kernel modules" in caplog.text
