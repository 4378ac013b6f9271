"""The import layering of docs/ARCHITECTURE.md holds: each package imports (at run time)
only the layers its row of the "Layering rules" table names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def layering_section() -> str:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    return text.split("### Layering rules", 1)[1].split("\n## ", 1)[0]


# the modules the doc's "*types* stands for ..." sentence names
TYPES = set(
    re.findall(
        r"`(common\.\w+)`", layering_section().split("*types* stands for", 1)[1].split(".\n")[0]
    )
)


def rules() -> dict[str, set[str]]:
    """{package: packages it may import} from the table in docs/ARCHITECTURE.md."""
    section = layering_section()
    out: dict[str, set[str]] = {}
    for row in re.findall(r"^\| `([\w.]+)` \| (.+?) \|$", section, re.M):
        package, allowed = row
        names: set[str] = set()
        for part in allowed.split(","):
            part = part.strip()
            if part == "nothing":
                continue
            if part == "types":
                names |= TYPES
            elif part == "anything in `common`":
                names.add("common")
            elif part == "anything in `common` and `services`":
                names |= {"common", "services"}
            else:
                names.add(part.strip("`"))
        out[package] = names
    return out


def unit(module: str) -> str:
    """baton.common.engine.scheduler -> common.engine; baton.services.router.x -> services."""
    parts = module.split(".")[1:]
    if parts[0] == "common" and len(parts) > 1:
        return f"common.{parts[1]}"
    return parts[0]


def runtime_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return {m for m in found if m.startswith("baton.")}


# the upward lookups the doc names (registries' names, inside a function)
EXCEPTIONS = {
    ("common.config", "baton.common.transfer.registry"),
    ("common.config", "baton.common.attention"),
}


def allowed(target: str, rule: set[str]) -> bool:
    return target in rule or target.split(".")[0] in rule


def test_rules_cover_every_package() -> None:
    table = rules()
    packages = {
        f"common.{p.name}"
        for p in (ROOT / "common").iterdir()
        if p.is_dir() and (p / "__init__.py").exists()
    }
    assert packages - TYPES <= set(table), (
        f"packages without a rule: {packages - TYPES - set(table)}"
    )
    assert {"services", "benchmarks", "lang"} <= set(table)


def test_every_import_follows_the_layering() -> None:
    table = rules()
    broken = []
    for folder in ("common", "services", "benchmarks", "lang"):
        for path in (ROOT / folder).rglob("*.py"):
            if "_pb2" in path.name:
                continue
            rel = path.relative_to(ROOT).with_suffix("")
            if rel.parts[-1] == "__init__" and len(rel.parts) == 2 and rel.parts[0] != "lang":
                continue  # the package roots (common/, services/) import nothing
            here = unit("baton." + ".".join(rel.parts))
            rule = TYPES if here in TYPES else table.get(here)
            assert rule is not None, f"{rel}: no layering rule for {here}"
            for module in runtime_imports(path):
                target = unit(module)
                if (here, module) in EXCEPTIONS:
                    continue
                if target != here and not allowed(target, rule):
                    broken.append(f"{rel}: imports {module} ({here} may not import {target})")
    assert not broken, "\n".join(broken)
