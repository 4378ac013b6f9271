"""Field docs and command-line metadata of the frozen config dataclasses.

A config field declared with `option(default, help, ...)` carries what the command line
needs: its help text, its topic (the `--help` group), its choices (a tuple, or a function
that asks a registry when the parser is built) and its flag, by default the field name
spelled `--foo-bar`. `flag=""` marks a field that is no flag of its own (a worker fills it
from another option, e.g. the transfer layer's bind host from the worker's `--host`).

`add_options(parser, Config)` declares the flags once, typed from the annotations (a bool
is a switch, `int | None` takes "none", a `Literal` gives the choices); `option_values`
reads them back by field name. A value a config refuses raises `ConfigError`, which
names the flag. Only the standard library is imported here, so the command line is fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

Choices = tuple[str, ...] | Callable[[], Iterable[str]] | None
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class Option:
    help: str
    group: str = "options"  # the `--help` section
    flag: str | None = None  # None: `--` + the field name with dashes; "": not a flag
    choices: Choices = None
    parse: Callable[[str], Any] | None = None  # text -> value, when the type is not enough

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
    group: str = "options",
    flag: str | None = None,
    choices: Choices = None,
    parse: Callable[[str], Any] | None = None,
    repr: bool = True,
) -> Any:
    """A dataclass field with its documentation and command-line metadata."""
    meta = Option(help, group, flag, choices, parse)
    return dataclasses.field(default=default, repr=repr, metadata={"option": meta})


_LIMIT = re.compile(r"^\s*(\w+)\s*[=:<]=?\s*([0-9]*\.?[0-9]+)\s*(ms|s)\s*$")


def parse_limits(text: str, names: Collection[str]) -> dict[str, float]:
    """Latency limits as flags spell them, `"ttft=200ms,tpot=50ms"` -> {"ttft": 0.2,
    "tpot": 0.05} (seconds); each name one of `names`. ValueError names the bad item."""
    limits: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        match = _LIMIT.match(item)
        if match is None:
            raise ValueError(f"SLO {item!r}: expected NAME=NUMBER(ms|s), e.g. ttft=200ms")
        name, number, unit = match.groups()
        if name not in names:
            raise ValueError(f"SLO {item!r}: metric must be one of {list(names)}")
        limits[name] = float(number) / (1000.0 if unit == "ms" else 1.0)
    return limits


def pool_size(text: str) -> int | None:
    """A KV pool size in tokens, or auto (also "none" or 0): sized from the GPU's memory."""
    return None if text.strip().lower() in ("", "auto", "none", "0") else int(text)


def token_budget(text: str) -> int | None:
    """A token budget where 0 or "none" means no budget."""
    return None if text.strip().lower() in ("", "none", "0") else int(text)


def secret(text: str) -> str | None:
    """A secret (cluster token, API key) from a flag or the environment: empty means none;
    printable ASCII only, since it travels in gRPC metadata and HTTP headers. The error
    never shows the value."""
    if not text:
        return None
    if not (text.isascii() and text.isprintable()) or text.strip() != text:
        raise argparse.ArgumentTypeError(
            "must be printable ASCII without surrounding spaces (value not shown)"
        )
    return text


def secret_option(help: str) -> Any:
    """A secret's field (cluster token, API key): none by default, parsed by `secret`,
    never in the config's repr."""
    return option(None, help, group="security", parse=secret, repr=False)


def log_level_option(help: str = "log level", group: str = "logging") -> Any:
    return option("info", help, group=group, choices=LOG_LEVELS, parse=str.lower)


def option_of(f: dataclasses.Field[Any]) -> Option | None:
    meta = f.metadata.get("option")
    return meta if isinstance(meta, Option) else None


class ConfigError(ValueError):
    """A value a config refuses; `flag` names its command-line flag, where it has one."""

    def __init__(self, config: object, name: str, why: str) -> None:
        self.field = name
        self.flag = flag_of(type(config), name)
        super().__init__(f"{name} {why} (got {getattr(config, name)!r})")


def flag_of(cls: type, name: str) -> str | None:
    f = next((f for f in dataclasses.fields(cls) if f.name == name), None)
    opt = option_of(f) if f is not None else None
    return opt.flag_for(name) if opt is not None else None


def flags(
    cls: type, *, only: Collection[str] | None = None, exclude: Collection[str] = ()
) -> Iterator[tuple[dataclasses.Field[Any], Option, str, str]]:
    """(field, its option, its flag, argparse dest) for each flag field of `cls`."""
    for f in dataclasses.fields(cls):
        opt = option_of(f)
        flag = opt.flag_for(f.name) if opt is not None else None
        if opt is None or flag is None or f.name in exclude or (only and f.name not in only):
            continue
        yield f, opt, flag, flag[2:].replace("-", "_")


def add_options(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    only: Collection[str] | None = None,
    exclude: Collection[str] = (),
) -> list[str]:
    """Declare the flags of `cls` in their topic groups; returns the argparse dests."""
    hints = typing.get_type_hints(cls)
    dests = []
    for f, opt, flag, dest in flags(cls, only=only, exclude=exclude):
        group = _group(parser, opt.group)
        group.add_argument(flag, dest=dest, **_argparse_kwargs(f, hints[f.name], opt))
        dests.append(dest)
    return dests


def option_values(
    cls: type,
    args: argparse.Namespace,
    *,
    only: Collection[str] | None = None,
    exclude: Collection[str] = (),
) -> dict[str, Any]:
    """The flag fields of `cls` found in `args`, by field name."""
    return {
        f.name: getattr(args, dest)
        for f, _, _, dest in flags(cls, only=only, exclude=exclude)
        if hasattr(args, dest)
    }


def default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _group(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def _argparse_kwargs(f: dataclasses.Field[Any], hint: Any, opt: Option) -> dict[str, Any]:
    default = default_of(f)
    kind, optional = _unwrap_optional(hint)
    choices = opt.allowed()
    if typing.get_origin(kind) is Literal:
        choices = choices or tuple(str(a) for a in typing.get_args(kind))
        kind = str
    help_text = opt.help
    if not (default is None or default is False or default == ""):
        help_text += f" (default: {default})"
    kwargs: dict[str, Any] = {"default": default, "help": help_text}
    if kind is bool:
        kwargs["action"] = "store_true" if not default else argparse.BooleanOptionalAction
        return kwargs
    parse = opt.parse or kind
    if optional and opt.parse is None:
        parse = _none_or(kind)
    kwargs["type"] = parse
    if choices:
        kwargs["choices"] = choices
    return kwargs


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return hint, False


def _none_or(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """Empty means unset; so does "none" for numbers (never for text: a key named "none"
    must not turn authentication off)."""
    unset = ("",) if kind is str else ("", "none")

    def parse(text: str) -> Any:
        return None if text.strip().lower() in unset else kind(text)

    parse.__name__ = getattr(kind, "__name__", "value")  # argparse names it in errors
    return parse


def config_argv(config: object, *, exclude: Collection[str] = ()) -> list[str]:
    """Flags that make `config` again when parsed: the inverse of `add_options` and
    `option_values`. Unset values are left out, and so is every field kept out of the
    repr (a secret travels in the environment, never on a command line)."""
    out: list[str] = []
    for f, _, flag, _ in flags(type(config), exclude=exclude):
        value = getattr(config, f.name)
        if not f.repr or value is None:
            continue
        if value is True or value is False:
            if value != bool(default_of(f)):
                out.append(flag if value else "--no-" + flag[2:])
            continue
        out += [flag, str(value)]
    return out
