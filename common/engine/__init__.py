"""The engine: requests, scheduler, model runner, and the offline `Engine`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from baton.common.engine.engine import Engine


def __getattr__(name: str):
    if name == "Engine":
        from baton.common.engine.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine"]
