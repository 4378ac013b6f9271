"""The thread that owns a ucx backend's UCX worker (`transfer/ucx.py`).

Every UCX call of a backend happens on this one thread, in blocking progress mode: it runs
the commands other threads hand it in order, progresses the worker, calls each watched
request's callback when the request completes, and sleeps on the worker's epoll
descriptor (or a wake-up socket) when nothing happens.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

Done = Callable[[Exception | None], None]


def import_ucxx() -> Any:
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    try:
        import ucxx._lib.libucxx as ucx_api
    except Exception as exc:  # ImportError, or a broken libucx underneath
        raise RuntimeError(
            f"the ucx transfer backend needs ucxx (pip install ucxx-cu12): {exc}"
        ) from exc
    return ucx_api


def ucx_array(tensor: torch.Tensor) -> Any:
    """What ucxx can send from / receive into: numpy for host memory, CUDA tensors as-is."""
    from ucxx._lib.arr import Array

    return Array(tensor if tensor.is_cuda else tensor.numpy())


class UcxThread:
    """Owns one UCX context and worker; runs commands and request callbacks in order."""

    def __init__(self, ucx: Any, device: torch.device | None):
        self.ucx = ucx
        self._device = device
        self._commands: deque[Callable[[], None]] = deque()
        self._pending: list[tuple[Any, Done, object]] = []
        self._fresh = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._stopping = False
        self._ready = threading.Event()
        self._error: Exception | None = None
        self.worker: Any = None
        self.address = b""  # the worker's UCX address
        self._thread = threading.Thread(target=self._run, name="kv-ucx", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"ucx backend failed to start: {self._error}") from self._error

    def call(self, command: Callable[[], None]) -> None:
        """Run ``command`` on the UCX thread (soon, in submission order)."""
        self._commands.append(command)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def watch(self, request: Any, done: Done, keep: object = None) -> None:
        """UCX thread only: call ``done(error or None)`` when ``request`` completes; ``keep``
        (the request's buffer) stays referenced until then."""
        self._pending.append((request, done, keep))
        self._fresh = True  # it may have completed already, as it was posted

    def stop(self) -> None:
        self._stopping = True
        self.call(lambda: None)
        self._thread.join(timeout=5)
        self._wake_w.close()

    def _run(self) -> None:
        try:
            if self._device is not None:
                torch.cuda.set_device(self._device)
                torch.empty(1, device=self._device)  # UCX needs a current CUDA context here
            ucx = self.ucx
            context = ucx.UCXContext({}, feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
            self.worker = ucx.UCXWorker(context)
            self.worker.init_blocking_progress_mode()
            self.address = self.worker.address.tobytes()
        except Exception as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        epoll = select.epoll()
        epoll.register(self.worker.epoll_file_descriptor, select.EPOLLIN)
        epoll.register(self._wake_r.fileno(), select.EPOLLIN)
        try:
            while not self._stopping:
                self._loop_once(epoll)
        finally:
            epoll.close()
            self._wake_r.close()
            self._pending.clear()
            self._commands.clear()
            self.worker.cancel_inflight_requests()
            self.worker = None

    def _loop_once(self, epoll: select.epoll) -> None:
        acted, self._fresh = self._fresh or bool(self._commands), False
        while self._commands:
            self._guarded(self._commands.popleft())
        for _ in range(64):  # bounded, so commands and completions get their turn
            if not self.worker.progress_once():
                break
            acted = True
        if not acted:  # nothing happened: nothing can have completed
            self._sleep(epoll)
            return
        finished: list[tuple[Any, Done, object]] = []
        pending: list[tuple[Any, Done, object]] = []
        for entry in self._pending:
            (finished if entry[0].completed else pending).append(entry)
        self._pending = pending
        for request, done, _ in finished:
            error: Exception | None = None
            try:
                request.check_error()
            except Exception as exc:
                error = exc
            self._guarded(done, error)

    def _sleep(self, epoll: select.epoll) -> None:
        if self._commands or not self.worker.arm():
            return
        # Armed: UCX will signal its descriptor on any event. Sleep until then, or a command.
        for fd, _ in epoll.poll(0.1 if not self._pending else 0.01):
            if fd == self._wake_r.fileno():
                with contextlib.suppress(BlockingIOError):
                    self._wake_r.recv(4096)

    @staticmethod
    def _guarded(fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except Exception:
            logger.exception("kv ucx: callback failed")
