"""HTTP connections that cannot be held open for free.

uvicorn closes a keep-alive connection that stays idle after a response
(`timeout_keep_alive`), but not one that never sends a request, nor one that sends its
headers a byte at a time: either holds a socket, and enough of them hold every socket.
`guarded_http_protocol(header_timeout)` is uvicorn's HTTP protocol with one more timer:
a connection must deliver a request's complete headers within `header_timeout` seconds of
opening, and of each response it got; otherwise it is closed. Bodies have their own
deadline (the router's `BodyLimitMiddleware`).

The subclass relies on two points of uvicorn's protocols (h11 and httptools alike): the
`cycle` attribute is set when a request's headers are complete, and
`on_response_complete()` runs after each response. tests/unit/test_httpguard.py checks
the behaviour against the installed uvicorn.
"""

from __future__ import annotations

import asyncio
from typing import Any

DEFAULT_HEADER_TIMEOUT_S = 10.0
KEEP_ALIVE_TIMEOUT_S = 5  # uvicorn's own default, stated: idle after a response


def guarded_http_protocol(header_timeout: float = DEFAULT_HEADER_TIMEOUT_S) -> type[Any]:
    from uvicorn.protocols.http.auto import AutoHTTPProtocol  # here: `--help` stays fast

    base: type[Any] = AutoHTTPProtocol

    class GuardedHTTPProtocol(base):
        _header_timer: asyncio.TimerHandle | None = None

        @property
        def cycle(self) -> Any:
            return self.__dict__.get("_cycle")

        @cycle.setter
        def cycle(self, value: Any) -> None:
            self.__dict__["_cycle"] = value
            if value is not None:  # a request's headers are complete
                self._disarm()

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            self._arm()  # before: a pipelined request started by super() disarms it
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            loop = asyncio.get_running_loop()
            self._header_timer = loop.call_later(header_timeout, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedHTTPProtocol
