"""The installed layout: every package folder ships, all under `baton.`."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
MAPPED = {
    "common": "baton.common",
    "services": "baton.services",
    "benchmarks": "baton.benchmarks",
    "lang": "baton.lang",
}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_folder_is_listed() -> None:
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = set()
    for folder, name in MAPPED.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
        for py in (ROOT / folder).rglob("*.py"):
            assert (py.parent / "__init__.py").exists(), f"{py.parent} has modules but no __init__"
    assert found == listed, f"missing: {sorted(found - listed)}; stale: {sorted(listed - found)}"


@pytest.mark.timeout(300)
def test_wheel_installs_under_baton_only(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("baton-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top <= {"baton", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    assert "baton/common/engine/scheduler.py" in names
    assert "baton/services/cli.py" in names
    assert "baton/lang/program.py" in names
    assert "baton/common/rpc/baton_pb2.py" in names
    assert any(n.startswith("baton/common/models/data/") and n.endswith(".txt") for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "baton = baton.services.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
