"""tests/gpu needs CUDA; on a machine without it every test here is skipped.

With GPU_TEST_FAILURES=FILE each failure's traceback is appended to FILE as it happens (a
run cut by its time limit keeps them; pytest prints them only at its end)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (tests/gpu runs on the GPU machine)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get("GPU_TEST_FAILURES")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


@pytest.fixture(autouse=True)
def no_cuda_error_left_behind() -> Iterator[None]:
    """A failed CUDA call whose error stays the thread's last one makes torch's next kernel
    on that thread fail with it, in whichever test runs next: blame the test that left it."""
    yield
    if torch.cuda.is_available():
        from baton.common.devices import take_cuda_error

        left = take_cuda_error()
        assert not left, f"the test left CUDA error {left} as the thread's last error"
