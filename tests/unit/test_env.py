"""One registry of environment variables: nothing reads the environment behind its back."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from baton.common import env

ROOT = Path(__file__).resolve().parents[2]
# The registry itself, and the flags' own variables (BATON_<FLAG>, read by the CLI).
ALLOWED = {"common/env.py", "services/cli.py"}
READ = re.compile(r"os\.environ\.get\(|os\.getenv\(|os\.environ\[|environ\.pop\(")


def test_the_environment_is_read_only_through_the_registry() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for folder in ("common", "services", "benchmarks")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if str(path.relative_to(ROOT)) not in ALLOWED
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if READ.search(line)
    ]
    assert not offenders, "read the environment through baton.common.env:\n" + "\n".join(offenders)


def test_variables_are_typed_and_listed_in_help(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("BATON_UCX_ERROR_HANDLING", "yes")
    monkeypatch.setenv("BATON_CACHE_DIR", "")
    assert env.UCX_ERROR_HANDLING.get() is True
    assert env.CACHE_DIR.get() is None  # empty means unset
    assert len({v.name for v in env.ALL}) == len(env.ALL)
    out = subprocess.run(
        [sys.executable, "-m", "baton.services.cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for var in env.ALL:
        assert var.name in out
