"""Triton kernels run by the interpreter for one test module, compiled ones for the rest.

Triton chooses the interpreter, from `TRITON_INTERPRET`, when a function is decorated with
`triton.jit`: its own helpers (`tl.sum`, `tl.cdiv`) when triton is first imported, a
module's kernels when that module is imported. So a test module that interprets kernels
imports triton through `import_triton()` before anything else imports it, and runs its
tests inside `interpreted(kernel_module, ...)`, which imports the kernel modules again with
the variable set, and again without it afterwards, so that GPU tests later in the same
pytest run get compiled kernels.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager


def _restore(previous: str | None) -> None:
    if previous is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = previous


def import_triton() -> str | None:
    """Import triton with the interpreter chosen, then put `TRITON_INTERPRET` back.
    None, or why triton cannot be imported."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
    except Exception as exc:  # any import failure means "no triton here"
        return str(exc)
    finally:
        _restore(previous)
    return None


@contextmanager
def interpreted(*modules: str) -> Iterator[None]:
    """Inside the block, the kernels of `modules` (and of modules first imported then) are
    interpreted. Modules are imported again in the order given: one that imports kernels
    from another comes after it."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    _reload(modules)
    try:
        yield
    finally:
        _restore(previous)
        if previous != "1":
            _reload(modules)


def _reload(modules: tuple[str, ...]) -> None:
    for module in modules:
        if module in sys.modules:
            importlib.reload(sys.modules[module])
