"""Role blocks as text, from the model's own chat template.

A program's text is the concatenation of what it appended, so each role block needs its
text before and after the content. These come from the model's Jinja chat template by
rendering conversations whose contents are unique markers and cutting between them:

    render([system A, user B, assistant C, user D, assistant E]):
      <start[system]> A <suffix[system] prefix[user]> B <suffix[user] prefix[assistant]>
      C <suffix[assistant] prefix[user]> D <suffix[user] prefix[assistant]> E <suffix[...]>

A conversation's first block opens with `start[role]` (the template's preamble, e.g. a BOS
or a default system prompt, then the role's prefix); later blocks with `prefix[role]`.
The cut is checked by rendering again from the pieces; a template that does not split this
way is refused with a clear error (pass a `ChatTemplate` of your own to the endpoint).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

Render = Callable[[list[dict[str, str]], bool], str]

_MARK = "BATONMARK{}X"


@dataclass(frozen=True)
class ChatTemplate:
    prefix: Mapping[str, str]
    suffix: Mapping[str, str]
    start: Mapping[str, str] = field(default_factory=dict)  # default: the prefix

    def opening(self, role: str, first: bool) -> str:
        """The text before a `role` message's content; `first`: the conversation's first."""
        if role not in self.prefix:
            raise ValueError(f"the model's chat template has no {role!r} role")
        return self.start.get(role, self.prefix[role]) if first else self.prefix[role]

    def closing(self, role: str) -> str:
        return self.suffix[role]

    def without_leading(self, text: str) -> ChatTemplate:
        """The same template with `text` (a BOS the server's tokenizer adds by itself)
        removed from the start of conversations."""
        start = {r: s.removeprefix(text) for r, s in self.start.items()}
        return replace(self, start=start)

    @classmethod
    def from_jinja(cls, source: str, variables: Mapping[str, Any] | None = None) -> ChatTemplate:
        """Split a Hugging Face chat template (Jinja) into role blocks. `variables` are the
        template's globals (bos_token, eos_token, ...)."""
        render = jinja_renderer(source, variables or {})
        try:
            return _derive(render, with_system=True)
        except Exception as first:
            try:  # templates that refuse a system role (they raise on it)
                return _derive(render, with_system=False)
            except Exception:
                raise ValueError(
                    f"the chat template cannot be split into role blocks: {first}"
                ) from first


def jinja_renderer(source: str, variables: Mapping[str, Any]) -> Render:
    """A renderer of `source` with the sandbox and helpers Hugging Face templates expect."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"the chat template refused the messages: {message}")

    def tojson(value: Any, indent: int | None = None, **kw: Any) -> str:
        return json.dumps(value, ensure_ascii=False, indent=indent, **kw)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    template = env.from_string(source)

    def render(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )

    return render


def _pieces(render: Render, roles: list[str]) -> list[str]:
    """The text around each marked message: len(roles) + 1 pieces."""
    marks = [_MARK.format(i) for i in range(len(roles))]
    text = render([{"role": r, "content": m} for r, m in zip(roles, marks, strict=True)], False)
    pieces = []
    for mark in marks:
        before, found, text = text.partition(mark)
        if not found or mark in text:
            raise ValueError("the template does not render each message's content once")
        pieces.append(before)
    return [*pieces, text]


def _cut(text: str, head: str = "", tail: str = "") -> str:
    if not (text.startswith(head) and text.endswith(tail)) or len(head) + len(tail) > len(text):
        raise ValueError(f"role text {text!r} is not {head!r} + ... + {tail!r}")
    return text[len(head) : len(text) - len(tail)]


def _derive(render: Render, with_system: bool) -> ChatTemplate:
    head = ["system"] if with_system else []
    roles = [*head, "user", "assistant", "user", "assistant"]
    gaps = _pieces(render, roles)
    k = len(head)  # gaps[k] opens the first user message
    suffix = {"assistant": gaps[-1], "user": _pieces(render, [*head, "user"])[-1]}
    prefix = {
        "user": _cut(gaps[k + 2], head=suffix["assistant"]),
        "assistant": _cut(gaps[k + 1], head=suffix["user"]),
    }
    start = {"user": _pieces(render, ["user", "assistant"])[0]}
    preamble = start["user"].removesuffix(prefix["user"])
    start["assistant"] = preamble + prefix["assistant"]
    if with_system:
        start["system"] = gaps[0]
        suffix["system"] = _cut(gaps[1], tail=prefix["user"])
        prefix["system"] = (
            gaps[0][len(preamble) :] if preamble and gaps[0].startswith(preamble) else gaps[0]
        )
    template = ChatTemplate(prefix, suffix, start)
    _check(template, render, roles)
    _check(template, render, ["user", "assistant"])
    return template


def _check(template: ChatTemplate, render: Render, roles: list[str]) -> None:
    """The pieces, put together, render `roles` as the template itself does."""
    marks = [_MARK.format(i) for i in range(len(roles))]
    ours = "".join(
        template.opening(r, i == 0) + m + template.closing(r)
        for i, (r, m) in enumerate(zip(roles, marks, strict=True))
    )
    theirs = render([{"role": r, "content": m} for r, m in zip(roles, marks, strict=True)], False)
    if ours != theirs:
        raise ValueError(f"role blocks render {ours!r}, the template {theirs!r}")
