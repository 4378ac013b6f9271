"""One chat choice's answer read as content and tool calls, streamed or whole.

`add(text)` returns what can be sent now: content and tool-call deltas (OpenAI's
streaming shape: `{"index", "id", "type", "function": {"name", "arguments"}}` for a new
call, `{"index", "function": {"arguments"}}` for more of its arguments). `finish(reason)`
returns what was held back and the finish reason the client sees ("tool_calls" when the
model called tools on its own or because it had to).
"""

from __future__ import annotations

import uuid
from typing import Any

from baton.services.router.tool_parsers import ToolCallStream
from baton.services.router.tools import ToolPlan, parse_required

ToolDelta = dict[str, Any]


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def new_call(index: int, name: str, arguments: str) -> ToolDelta:
    return {
        "index": index,
        "id": call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


class ToolAnswer:
    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._stream = ToolCallStream(plan.parser) if plan.parser is not None else None
        self._held = ""
        self._named_open = False

    def add(self, text: str) -> tuple[str, list[ToolDelta]]:
        mode = self.plan.mode
        if mode == "none":
            return text, []
        if mode == "named":
            if not text:
                return "", []
            if self._named_open:
                return "", [{"index": 0, "function": {"arguments": text}}]
            self._named_open = True
            return "", [new_call(0, self.plan.function or "", text)]
        if mode == "required":
            self._held += text
            return "", []
        assert self._stream is not None
        return self._stream.add(text), []

    def finish(self, reason: str) -> tuple[str, list[ToolDelta], str]:
        mode = self.plan.mode
        if mode == "none":
            return "", [], reason
        if mode == "named":
            # OpenAI answers a forced function with finish_reason "stop".
            calls = [] if self._named_open else [new_call(0, self.plan.function or "", "")]
            self._named_open = True
            return "", calls, reason
        if mode == "required":
            # The array is never content, even cut short: its complete calls, or none.
            held, self._held = self._held, ""
            parsed = parse_required(held)
            return "", [new_call(i, n, a) for i, (n, a) in enumerate(parsed)], _called(reason)
        assert self._stream is not None
        content, found = self._stream.finish()
        if not self.plan.parallel:
            found = found[:1]
        deltas = [new_call(i, c.name, c.arguments) for i, c in enumerate(found)]
        return content, deltas, _called(reason) if deltas else reason


def _called(reason: str) -> str:
    return "tool_calls" if reason == "stop" else reason
