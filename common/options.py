"""Field docs and command-line metadata of the frozen config dataclasses.

A config field declared with `option(default, help, ...)` carries what the command line
needs: its help text, its topic (the `--help` group), its choices (a tuple, or a function
that asks a registry when the parser is built) and its flag, by default the field name
spelled `--foo-bar`. `flag=""` marks a field that is no flag of its own (a worker fills it
from another option, e.g. the transfer layer's bind host from the worker's `--host`).

Only the standard library is imported here, so the command line stays fast.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

Choices = tuple[str, ...] | Callable[[], Iterable[str]] | None


@dataclass(frozen=True)
class Option:
    help: str
    group: str = ""  # the `--help` section; "" = the section of the dataclass
    flag: str | None = None  # None: `--` + the field name with dashes; "": not a flag
    choices: Choices = None
    parse: Callable[[str], Any] | None = None  # text -> value, when the type is not enough
    metavar: str | None = None

    def flag_for(self, name: str) -> str | None:
        if self.flag == "":
            return None
        return self.flag or "--" + name.replace("_", "-")

    def allowed(self) -> tuple[str, ...] | None:
        if self.choices is None:
            return None
        return tuple(self.choices() if callable(self.choices) else self.choices)


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    group: str = "",
    flag: str | None = None,
    choices: Choices = None,
    parse: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    repr: bool = True,
) -> Any:
    """A dataclass field with its documentation and command-line metadata."""
    meta = Option(help, group, flag, choices, parse, metavar)
    return dataclasses.field(default=default, repr=repr, metadata={"option": meta})


def option_of(f: dataclasses.Field[Any]) -> Option | None:
    meta = f.metadata.get("option")
    return meta if isinstance(meta, Option) else None
