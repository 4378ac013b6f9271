"""Tool calls in generated text, in the formats of the model families baton serves.

    hermes      Qwen 2.5/3, Hermes, ChatML models:
                <tool_call>{"name": "f", "arguments": {...}}</tool_call>   (text around = content)
    llama3_json Llama 3.1+: the whole answer is {"name": "f", "parameters": {...}},
                optionally after <|python_tag|>, several separated by ";"
    mistral     [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]
                or (newer tokenizers) [TOOL_CALLS]f[ARGS]{...}, repeated

A parser splits a finished answer into content and calls; `ToolCallStream` feeds it a
stream, passing content through until a call may have started and holding the rest for
the end. Text that does not parse as the format's calls stays content: a model is never
made to have called a tool it did not call.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

PARSER_NAMES = ("auto", "hermes", "llama3_json", "mistral")


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object


class ToolParser(ABC):
    name = ""
    # Markers that open a tool-call section; special tokens must be kept in the text.
    markers: tuple[str, ...] = ()
    needs_special_tokens = False
    only_at_start = False  # the section can only open the answer

    @abstractmethod
    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        """(content, calls) of a whole answer; calls empty when there are none."""


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        calls = []
        for body in self._CALL.findall(text):
            call = _call(_load(body), "arguments")
            if call is None:
                return text, []
            calls.append(call)
        content = self._CALL.sub("", text) if calls else text
        return content.strip() if calls else content, calls


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = ("<|python_tag|>", "{")
    needs_special_tokens = True
    only_at_start = True

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        objects = _json_sequence(body, separators=";")
        calls = [_call(o, "parameters") or _call(o, "arguments") for o in objects or []]
        if not calls or any(c is None for c in calls):
            return text, []
        return "", [c for c in calls if c is not None]


class MistralParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    needs_special_tokens = True

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        content, marker, rest = text.partition("[TOOL_CALLS]")
        if not marker:
            return text, []
        rest = rest.strip()
        calls: list[ParsedCall | None]
        if rest.startswith("["):
            items = _load(rest)
            calls = [_call(o, "arguments") for o in items] if isinstance(items, list) else []
        else:
            calls = []
            for part in rest.split("[TOOL_CALLS]"):
                name, args_marker, args = part.partition("[ARGS]")
                loaded = _load(args) if args_marker else None
                ok = isinstance(loaded, dict) and name.strip()
                calls.append(ParsedCall(name.strip(), json.dumps(loaded)) if ok else None)
        if not calls or any(c is None for c in calls):
            return text, []
        return content.strip(), [c for c in calls if c is not None]


_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)
}


def make_parser(name: str, vocabulary: set[str]) -> ToolParser:
    """The parser called `name`; "auto" picks by the tokens the tokenizer has."""
    if name == "auto":
        if "[TOOL_CALLS]" in vocabulary:
            name = "mistral"
        elif "<|python_tag|>" in vocabulary:
            name = "llama3_json"
        else:
            name = "hermes"
    if name not in _PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; one of {', '.join(PARSER_NAMES)}")
    return _PARSERS[name]()


class ToolCallStream:
    """Streams an answer's content while holding back what may be tool calls.

    `add` returns the content that can be shown now; `finish` parses what was held and
    returns (the rest of the content, the calls)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._shown = ""  # content emitted so far
        self._held = ""
        self._capturing = False

    def add(self, text: str) -> str:
        if self._capturing:
            self._held += text
            return ""
        buffer = self._held + text
        if self.parser.only_at_start:
            stripped = buffer.lstrip()
            if not self._shown and any(
                stripped.startswith(m) or m.startswith(stripped) for m in self.parser.markers
            ):
                self._held = buffer
                self._capturing = bool(stripped) and any(
                    stripped.startswith(m) for m in self.parser.markers
                )
                return ""
            self._held = ""
            self._shown += buffer
            return buffer
        start = min((i for m in self.parser.markers if (i := buffer.find(m)) >= 0), default=-1)
        if start >= 0:
            self._capturing = True
            self._held = buffer[start:]
            return self._emit(buffer[:start])
        keep = _partial_marker_len(buffer, self.parser.markers)
        self._held = buffer[len(buffer) - keep :]
        return self._emit(buffer[: len(buffer) - keep])

    def finish(self) -> tuple[str, list[ParsedCall]]:
        held, self._held = self._held, ""
        if not self._capturing:
            return self._emit(held), []
        content, calls = self.parser.parse(held)
        return self._emit(content), calls

    def _emit(self, text: str) -> str:
        self._shown += text
        return text


def _partial_marker_len(buffer: str, markers: tuple[str, ...]) -> int:
    for n in range(min(len(buffer), max(len(m) for m in markers) - 1), 0, -1):
        if any(m.startswith(buffer[-n:]) for m in markers):
            return n
    return 0


def _load(text: str) -> Any:
    try:
        return json.loads(text.strip())
    except ValueError:
        return None


def _json_sequence(text: str, separators: str) -> list[Any] | None:
    """JSON values one after another, with `separators` or whitespace between them."""
    decoder = json.JSONDecoder()
    out, i = [], 0
    while i < len(text):
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        if i == len(text):
            break
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        out.append(value)
    return out


def _call(obj: Any, arguments_key: str) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        args = _load(args)
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))
