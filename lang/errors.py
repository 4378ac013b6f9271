"""What a program raises when something fails.

`EndpointError`: one request to the server failed; it carries the server's own message
(and its OpenAI-style `type`, `param`, `code`) or says why no answer came.
`ProgramError`: a statement of a program failed; it names the program, the statement and
where the program wrote it, and chains the cause (usually an `EndpointError`).
"""

from __future__ import annotations

from typing import Any


class EndpointError(Exception):
    """A request the server refused or could not answer. `status` is None when no answer
    came at all (connection refused, timeout)."""

    def __init__(
        self,
        request: str,
        message: str,
        status: int | None = None,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | int | None = None,
    ) -> None:
        self.request = request
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        # no status: no answer came, or a stream that had started reported the error
        what = f"{status} {type or 'error'}" if status is not None else type or "no answer"
        where = f" (param {param})" if param else ""
        super().__init__(f"{request}: {what}{where}: {message}")

    @classmethod
    def from_body(cls, request: str, status: int | None, body: Any, text: str) -> EndpointError:
        """From an OpenAI-style error body {"error": {"message", "type", "param", "code"}};
        any other body is quoted as text."""
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return cls(
                request,
                error["message"],
                status,
                type=error.get("type"),
                param=error.get("param"),
                code=error.get("code"),
            )
        if isinstance(error, str):
            return cls(request, error, status)
        return cls(request, text.strip()[:500] or "(empty answer)", status)


class ProgramError(Exception):
    """A program's statement failed. `statement` is how the program wrote it (e.g.
    "gen('answer', max_tokens=16)"), `location` the file and line that added it."""

    def __init__(self, program: str, statement: str, location: str, cause: BaseException):
        self.program = program
        self.statement = statement
        self.location = location
        self.cause = cause
        super().__init__(f"{program}: {statement} at {location} failed: {cause}")
