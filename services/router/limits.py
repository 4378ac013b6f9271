"""Limits on what one HTTP request may cost the router before it is even parsed.

`BodyLimitMiddleware` refuses a body larger than `max_bytes` with 413 (at once when its
Content-Length says so, else as soon as the bytes read pass the limit) and one that does
not arrive within `read_timeout` seconds with 408, so that one large or slow upload can
neither exhaust memory nor hold the event loop. `PromptLimit` refuses a text prompt that
must exceed the context by its size in bytes alone, before it is tokenized.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from baton.services.router.errors import APIError


def body_too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is larger than this server's limit of {limit} bytes",
        code="request_too_large",
    )


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout: float) -> None:
        self._app = app
        self._max = max_bytes
        self._timeout = read_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self._max):
            await body_too_large(self._max).response()(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        received = 0
        body_done = False

        async def limited_receive() -> Message:
            nonlocal received, body_done
            if body_done:  # after the body, only a disconnect comes: no deadline
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise HTTPException(
                    408, f"the request body did not arrive within {self._timeout:g}s"
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self._max:
                    raise HTTPException(413, body_too_large(self._max).message)
                body_done = not message.get("more_body", False)
            return message

        await self._app(scope, limited_receive, send)


class PromptLimit:
    """The longest text (in UTF-8 bytes) that could fit `context_len` tokens: no token of
    the vocabulary spells more than `max_token_bytes` bytes, so a longer text has more
    tokens than the context holds, whatever it says."""

    def __init__(self, context_len: int, token_texts: Iterable[str]) -> None:
        longest = max((len(t.encode("utf-8", "surrogatepass")) for t in token_texts), default=1)
        self.max_bytes = context_len * max(longest, 1)

    def too_long(self, text: str) -> bool:
        # len(text) <= its UTF-8 size <= 4 * len(text): most texts are decided unencoded.
        if len(text) <= self.max_bytes // 4:
            return False
        return len(text.encode("utf-8", "surrogatepass")) > self.max_bytes
