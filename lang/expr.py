"""The expressions a program appends to its state: text, `gen`, `select`, role blocks.

Expressions are immutable descriptions; nothing runs until a state executes them. They
concatenate with `+` (`"Q: " + gen("a")`) into one statement, run in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from baton.lang.choices import ChoicesMethod, token_length_normalized


class Expr:
    def __add__(self, other: Expr | str) -> Concat:
        return Concat((*_parts(self), *_parts(to_expr(other))))

    def __radd__(self, other: Expr | str) -> Concat:
        return Concat((*_parts(to_expr(other)), *_parts(self)))

    def describe(self) -> str:
        """How a program writes this expression (for error messages)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Text(Expr):
    text: str

    def describe(self) -> str:
        return _short(self.text)


@dataclass(frozen=True)
class Concat(Expr):
    parts: tuple[Expr, ...]

    def describe(self) -> str:
        return " + ".join(p.describe() for p in self.parts)


@dataclass(frozen=True)
class Gen(Expr):
    """Generate text and append it; `params` are `/generate` sampling params, only the
    ones the program set (the run's defaults fill in the rest)."""

    name: str | None
    params: dict[str, Any] = field(hash=False)

    def describe(self) -> str:
        return _call("gen", self.name, {_GEN_NAMES.get(k, k): v for k, v in self.params.items()})


@dataclass(frozen=True)
class Select(Expr):
    """Append the choice the model scores highest after the text so far."""

    name: str | None
    choices: tuple[str, ...]
    method: ChoicesMethod

    def describe(self) -> str:
        return _call("select", self.name, {"choices": list(self.choices)})


@dataclass(frozen=True)
class RoleBegin(Expr):
    role: str

    def describe(self) -> str:
        return f"{self.role}_begin()"


@dataclass(frozen=True)
class RoleEnd(Expr):
    role: str

    def describe(self) -> str:
        return f"{self.role}_end()"


@dataclass(frozen=True)
class Role(Expr):
    """A message of `role` whose content is `body`, rendered with the chat template."""

    role: str
    body: Expr

    def describe(self) -> str:
        return f"{self.role}({self.body.describe()})"


def to_expr(value: Expr | str) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    raise TypeError(f"a program appends text or expressions, not {type(value).__name__}")


# gen's public names where /generate spells them differently
_GEN_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


def gen(
    name: str | None = None,
    *,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    repetition_penalty: float | None = None,
    ignore_eos: bool | None = None,
    regex: str | None = None,
    json_schema: str | dict[str, Any] | None = None,
    choices: Sequence[str] | None = None,
    choices_method: ChoicesMethod = token_length_normalized,
) -> Expr:
    """Generate text into variable `name`. Unset parameters take the run's defaults (then
    the server's). `regex` or `json_schema` constrain the output; with `choices` this is
    `select(name, choices)`."""
    if choices is not None:
        return select(name, choices, choices_method=choices_method)
    given = {
        "max_new_tokens": max_tokens,
        "min_new_tokens": min_tokens,
        "stop": [stop] if isinstance(stop, str) else list(stop) if stop is not None else None,
        "stop_token_ids": list(stop_token_ids) if stop_token_ids is not None else None,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "frequency_penalty": frequency_penalty,
        "presence_penalty": presence_penalty,
        "repetition_penalty": repetition_penalty,
        "ignore_eos": ignore_eos,
        "regex": regex,
        "json_schema": json_schema,
    }
    return Gen(name, {k: v for k, v in given.items() if v is not None})


def select(
    name: str | None = None,
    choices: Sequence[str] = (),
    *,
    choices_method: ChoicesMethod = token_length_normalized,
) -> Expr:
    """Append whichever of `choices` the model scores highest after the text so far (by
    the logprobs of the choice's tokens; `choices_method` turns them into a decision)."""
    if isinstance(choices, str) or not choices:
        raise ValueError("select needs a non-empty list of choices")
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError("select's choices must be non-empty strings")
    return Select(name, tuple(choices), choices_method)


def _role(role: str) -> Callable[[Expr | str | None], Expr]:
    def block(expr: Expr | str | None = None) -> Expr:
        return Role(role, to_expr(expr if expr is not None else ""))

    block.__name__ = role
    block.__doc__ = f"A {role} message whose content is `expr`, in the model's chat template."
    return block


system = _role("system")
user = _role("user")
assistant = _role("assistant")


def system_begin() -> Expr:
    return RoleBegin("system")


def system_end() -> Expr:
    return RoleEnd("system")


def user_begin() -> Expr:
    return RoleBegin("user")


def user_end() -> Expr:
    return RoleEnd("user")


def assistant_begin() -> Expr:
    return RoleBegin("assistant")


def assistant_end() -> Expr:
    return RoleEnd("assistant")


def _parts(expr: Expr) -> tuple[Expr, ...]:
    return expr.parts if isinstance(expr, Concat) else (expr,)


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _call(fn: str, name: str | None, params: dict[str, Any]) -> str:
    args = [repr(name)] if name is not None else []
    args += [f"{k}={_short(v)}" for k, v in params.items()]
    return f"{fn}({', '.join(args)})"
