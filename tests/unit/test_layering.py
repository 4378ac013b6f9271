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


def module_files() -> dict[str, Path]:
    """baton.* module name -> its file, for every module of the project."""
    out = {}
    for folder in ("common", "services", "benchmarks", "lang"):
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out["baton." + ".".join(parts)] = path
    return out


def every_import(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `module` imports anywhere: at the top, inside functions and under
    TYPE_CHECKING alike (`from pkg import sub` counts sub when it is a module)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m in known and m != module}


def test_no_import_circles() -> None:
    """No module reaches itself through imports, counting those inside functions and under
    TYPE_CHECKING: a circle is a circle whether or not Python resolves it lazily."""
    known = module_files()
    graph = {m: every_import(m, p, known) for m, p in known.items()}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in graph[v]:
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    assert not circles, "import circles:\n" + "\n".join(", ".join(c) for c in circles)
