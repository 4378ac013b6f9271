"""flashinfer's modules compile in a child process while the worker starts, all in one ninja
process that leaves a build log flashinfer's own later builds agree with; a failed or
missing module is named rather than fatal (`common/attention/prebuild.py`)."""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from baton.common.attention.prebuild import (
    Prebuild,
    build_missing,
    compiled,
    run_one_ninja,
    start_flashinfer_prebuild,
)

needs_ninja = pytest.mark.skipif(shutil.which("ninja") is None, reason="no ninja binary")
BUILD_SECONDS = 0.5


class Module:
    """A flashinfer-like module: its own ninja file, outputs named relative to the JIT
    folder, and the same rule name as every other module's (as flashinfer writes them)."""

    def __init__(self, jit_dir: Path, name: str, is_aot: bool = False) -> None:
        self.name = name
        self.is_aot = is_aot
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
    run_one_ninja(tmp_path, modules)
    assert time.monotonic() - start < 2 * BUILD_SECONDS  # side by side, not one by one
    assert compiled(tmp_path) == {"module_0", "module_1", "module_2"}
    built_at = {m.name: m.library.stat().st_mtime_ns for m in modules}
    for m in modules:  # the warm-up's first use of each: no rebuild
        assert m.build_alone() < BUILD_SECONDS
        assert m.library.stat().st_mtime_ns == built_at[m.name]


@needs_ninja
def test_workers_starting_together_build_each_module_once(tmp_path: Path) -> None:
    """Four workers of one machine build at once. Two ninja processes in one folder at
    once lose each other's deps-log entries, and every later build there starts over."""
    workers = [[Module(tmp_path, f"module_{i}") for i in range(2)] for _ in range(4)]
    threads = [threading.Thread(target=run_one_ninja, args=(tmp_path, w)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for m in workers[0]:
        assert m.build_alone() < BUILD_SECONDS


@needs_ninja
def test_a_module_built_ahead_of_time_is_not_built_again(tmp_path: Path) -> None:
    """With flashinfer-jit-cache installed (or modules in flashinfer's AOT folder) the
    child built them anyway, and each worker waited a minute per module for nothing."""
    shipped, missing = Module(tmp_path, "shipped", is_aot=True), Module(tmp_path, "missing")
    report = build_missing(tmp_path, [shipped, missing])
    assert compiled(tmp_path) == {"missing"}
    assert report == {
        "names": ["shipped", "missing"],
        "build_dir": str(tmp_path),
        "fresh": 1,
        "prebuilt": 1,
    }
    start = time.monotonic()
    assert build_missing(tmp_path, [shipped])["fresh"] == 0
    assert time.monotonic() - start < BUILD_SECONDS  # no ninja at all


def child(script: str) -> list[str]:
    return [sys.executable, "-c", f"import json, sys, time\n{script}"]


def test_the_worker_goes_on_while_the_child_builds_and_learns_what_it_built(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    report = {"names": ["single_prefill"], "build_dir": str(tmp_path), "fresh": 1}
    start = time.monotonic()
    prebuild = Prebuild(child(f"time.sleep(1.0); print({json.dumps(report)!r})"))
    assert time.monotonic() - start < 0.5  # the load goes on meanwhile
    with caplog.at_level(logging.INFO, logger="baton.scheduler"):
        assert prebuild.wait() > 0
    assert prebuild.names == ["single_prefill"]
    assert "1 kernel modules ready" in caplog.text
    before = prebuild.compiled()
    for name in ("single_prefill", "batch_decode"):  # the child's, then the warm-up's own
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{name}.so").touch()
    assert prebuild.unexpected(before) == ["batch_decode"]


def test_a_failed_build_is_logged_and_left_to_first_use(caplog: pytest.LogCaptureFixture) -> None:
    prebuild = Prebuild(
        child("print('ninja exited with 1: nvcc fatal', file=sys.stderr); sys.exit(1)")
    )
    with caplog.at_level(logging.WARNING, logger="baton.scheduler"):
        prebuild.wait()
    assert "the kernel build beside the start failed (exit 1: ninja exited with 1: nvcc fatal)" in (
        caplog.text
    )
    assert prebuild.compiled() == set()


def test_a_worker_that_fails_to_start_ends_the_child() -> None:
    prebuild = Prebuild(child("time.sleep(60)"))
    start = time.monotonic()
    prebuild.stop()
    assert time.monotonic() - start < 5
    assert prebuild._child.poll() is not None


def test_without_flashinfer_the_real_child_says_why(caplog: pytest.LogCaptureFixture) -> None:
    """The command the scheduler process runs, end to end; this machine has no flashinfer
    (on a GPU machine the cluster tests run it for real)."""
    if importlib.util.find_spec("flashinfer") is not None:
        pytest.skip("flashinfer is installed here: the child would build for real")
    with caplog.at_level(logging.WARNING, logger="baton.scheduler"):
        start_flashinfer_prebuild(64, "float32", "cpu").wait()
    assert "ModuleNotFoundError" in caplog.text and "flashinfer" in caplog.text
