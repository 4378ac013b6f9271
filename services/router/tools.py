"""Tools on the chat endpoint: what the chat template sees, what the grammar enforces, and
how the answer is read back.

    tool_choice  template sees tools   grammar                              answer read by
    none         no                    (response_format, if any)            -
    auto         yes                   (response_format, if any)            the family's parser
    required     yes                   [{"name": f, "parameters": {...}}]+  JSON array
    named f      yes                   f's parameters schema                the arguments as is

`required` and a named function are enforced with a grammar, so their calls always parse
against the functions' parameters; they cannot be combined with another constraint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from baton.common.sampling import GrammarSpec
from baton.services.router.errors import bad_request
from baton.services.router.schemas import ChatCompletionRequest, ChatMessage, Tool
from baton.services.router.structured import json_schema_spec
from baton.services.router.tool_parsers import ToolParser

ToolMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolPlan:
    mode: ToolMode
    template_tools: list[dict[str, Any]] | None  # what the chat template is given
    grammar: GrammarSpec | None  # the constraint `required` / named impose
    function: str | None = None  # the named function
    parser: ToolParser | None = None  # auto: reads calls out of the text
    parallel: bool = True

    @property
    def reads_calls(self) -> bool:
        return self.mode != "none"


NO_TOOLS = ToolPlan("none", None, None)


def plan_tools(body: ChatCompletionRequest, parser: ToolParser) -> ToolPlan:
    tools = body.tools or []
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise bad_request("tool_choice needs tools", param="tool_choice")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", param="tools")
    if choice == "none":
        return NO_TOOLS
    template_tools = [t.model_dump(exclude_none=True) for t in tools]
    parallel = body.parallel_tool_calls is not False
    if choice == "auto":
        return ToolPlan("auto", template_tools, None, parser=parser, parallel=parallel)
    if choice == "required":
        schema = _required_schema(tools, parallel)
        return ToolPlan("required", template_tools, json_schema_spec(schema, "tools"))
    name = choice.function.name
    tool = next((t for t in tools if t.function.name == name), None)
    if tool is None:
        raise bad_request(
            f"tool_choice names {name!r}, which is not among the tools", param="tool_choice"
        )
    spec = json_schema_spec(_parameters(tool), f"tools[{names.index(name)}].function.parameters")
    return ToolPlan("named", template_tools, spec, function=name)


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _required_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    "parameters": _parameters(t),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in tools
        ]
    }
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: text parts only, and the arguments of
    earlier tool calls as objects (templates render them as JSON)."""
    out = []
    for i, message in enumerate(messages):
        item = message.model_dump(exclude_none=True)
        content = message.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    where = f"messages[{i}].content[{j}]"
                    raise bad_request(
                        f"{where}: only text parts are supported (got type {part.get('type')!r})",
                        param=f"{where}.type",
                    )
        item["content"] = content if content is not None else ""
        for call in item.get("tool_calls", []):
            arguments = call["function"].get("arguments")
            if isinstance(arguments, str):
                try:
                    call["function"]["arguments"] = json.loads(arguments) if arguments else {}
                except ValueError as e:
                    raise bad_request(
                        f"messages[{i}].tool_calls: arguments are not valid JSON: {e}",
                        param=f"messages[{i}].tool_calls",
                    ) from e
        out.append(item)
    return out


def parse_required(text: str) -> list[tuple[str, str]]:
    """(name, arguments JSON) of each complete call in a `required` answer. An answer cut
    short by max_tokens keeps the calls it finished, as vLLM's does; the one it was writing
    is dropped (its arguments would not parse), and so is anything the array never held."""
    decoder = json.JSONDecoder()
    i = _skip_space(text, 0)
    if not text.startswith("[", i):
        return []
    calls: list[tuple[str, str]] = []
    i += 1
    while True:
        i = _skip_space(text, i)
        try:
            item, i = decoder.raw_decode(text, i)
        except ValueError:
            return calls  # cut inside this call, or the array is empty
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return calls
        calls.append((item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False)))
        i = _skip_space(text, i)
        if not text.startswith(",", i):
            return calls  # the array's end, or the answer's
        i += 1


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\n\r":
        i += 1
    return i
