"""A program's state: its text, variables and messages, and the thread that runs them.

`s += expr` queues a statement and returns at once; the state's own thread runs its
statements in order against the backend. Reading a result (`s["name"]`, `s.text()`)
waits for what it needs. So a program's forks, each a state with its own thread, send
their requests at the same time. After a statement fails, the state runs no more: the
failure (a `ProgramError` naming the statement) is raised by the program's next use of
the state, and by `run`.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from baton.lang.backend import Backend
from baton.lang.errors import ProgramError
from baton.lang.expr import Concat, Expr, Gen, Role, RoleBegin, RoleEnd, Select, Text, to_expr


@dataclass
class RunContext:
    """What every state of one program run shares."""

    label: str  # the program's name in errors, e.g. "qa" or "qa[3]" in a batch
    backend: Backend
    defaults: dict[str, Any]  # sampling params for gen statements that do not set them
    stream: bool = False
    program_thread: int | None = None  # the thread running the program's function
    failure: BaseException | None = None  # why the program's function stopped, if it failed


@dataclass(frozen=True)
class _CachePrefix(Expr):
    """fork's first step: the shared prefix computed once, before the branches extend it."""

    size: int

    def describe(self) -> str:
        return f"fork({self.size})"


class ProgramState:
    def __init__(self, run: RunContext, label: str | None = None) -> None:
        self._run = run
        self._label = label or run.label
        self._cond = threading.Condition()
        self._text = ""
        self._vars: dict[str, Any] = {}
        self._meta: dict[str, dict[str, Any]] = {}
        self._messages: list[dict[str, str]] = []
        self._open_role: tuple[str, int] | None = None  # role, where its content starts
        self._conversation_started = False  # the first role block opens with the preamble
        self._chunks: list[tuple[str | None, str]] = []  # (variable, text) as appended
        self._pending = 0
        self._error: ProgramError | None = None
        self._finished = False
        self._queue: queue.SimpleQueue[tuple[Expr, str] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._children: list[ProgramState] = []

    # -- what a program does -----------------------------------------------------------------

    def __iadd__(self, expr: Expr | str) -> ProgramState:
        self.submit(to_expr(expr), _location())
        return self

    def fork(self, size: int = 1) -> ProgramStateGroup:
        """`size` branches that continue from here, each running on its own; the text so
        far is computed once for all of them (the server's prefix cache)."""
        if size < 1:
            raise ValueError("fork needs at least one branch")
        location = _location()
        if size > 1:
            self.submit(_CachePrefix(size), location)
        self.sync()
        with self._cond:
            branches = [self._branch(i) for i in range(size)]
            self._children.extend(branches)
        return ProgramStateGroup(self, branches)

    # -- what a program reads ----------------------------------------------------------------

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def get_var(self, name: str) -> Any:
        """The value of variable `name`, once the statement that sets it has run."""
        with self._cond:
            self._wait_for_var(name)
            return self._vars[name]

    def get_meta_info(self, name: str) -> dict[str, Any]:
        """What the server said about the statement that set `name` (for gen: its
        meta_info: prompt_tokens, cached_tokens, finish_reason...; for select: scores)."""
        with self._cond:
            self._wait_for_var(name)
            return dict(self._meta.get(name, {}))

    def text(self) -> str:
        """The whole text so far (from outside a streamed run: once the program ended)."""
        with self._cond:
            self._cond.wait_for(self._settled)
            self._raise_failure()
            return self._text

    def messages(self) -> list[dict[str, str]]:
        """The role blocks so far, as chat messages."""
        with self._cond:
            self._cond.wait_for(self._settled)
            self._raise_failure()
            return [dict(m) for m in self._messages]

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The text as it is appended (with `stream=True`, while it is generated), until
        the program ends; `var_name`: only that variable's text."""
        seen = 0
        while True:
            with self._cond:
                while len(self._chunks) == seen and not self._finished:
                    self._cond.wait()
                new, seen = self._chunks[seen:], len(self._chunks)
                over = self._finished
            for name, piece in new:
                if var_name is None or name == var_name:
                    yield piece
            if over:
                break
        self._raise_failure()

    def sync(self) -> None:
        """Wait until every statement queued so far has run; raise if one failed."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending == 0)
            self._raise_failure()

    def __repr__(self) -> str:
        return f"ProgramState({self._label!r}, variables={sorted(self._vars)})"

    # -- running statements ------------------------------------------------------------------

    def submit(self, expr: Expr, location: str) -> None:
        with self._cond:
            self._raise_failure()
            if self._finished:
                raise RuntimeError(f"{self._label}: the program has ended; its state is final")
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._work, name=f"baton-lang {self._label}", daemon=True
                )
                self._thread.start()
        self._queue.put((expr, location))

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            expr, location = item
            if self._error is None:
                try:
                    self._execute(expr)
                except Exception as e:
                    error = ProgramError(self._label, expr.describe(), location, e)
                    error.__cause__ = e
                    with self._cond:
                        self._error = error
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()

    def _execute(self, expr: Expr) -> None:
        backend = self._run.backend
        if isinstance(expr, Text):
            self._append(expr.text)
        elif isinstance(expr, Concat):
            for part in expr.parts:
                self._execute(part)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            logprobs = backend.choice_logprobs(self._text, expr.choices)
            decision = expr.method(logprobs)
            meta = {"scores": decision.scores, "token_logprobs": logprobs}
            self._append(expr.choices[decision.index], expr.name, meta)
        elif isinstance(expr, Role):
            self._begin(expr.role)
            self._execute(expr.body)
            self._end(expr.role)
        elif isinstance(expr, RoleBegin):
            self._begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self._end(expr.role)
        elif isinstance(expr, _CachePrefix):
            backend.cache_prefix(self._text)
        else:
            raise TypeError(f"not a statement: {expr!r}")

    def _gen(self, expr: Gen) -> None:
        sampling = {**self._run.defaults, **expr.params}
        if not self._run.stream:
            result = self._run.backend.generate(self._text, sampling)
            self._append(result.text, expr.name, result.meta_info)
            return
        start = len(self._text)
        result = self._run.backend.generate(
            self._text, sampling, lambda piece: self._append(piece, expr.name)
        )
        self._append("", expr.name, result.meta_info, value=self._text[start:])

    def _begin(self, role: str) -> None:
        if self._open_role is not None:
            raise ValueError(f"a {role} block cannot start inside the open {self._open_role[0]}")
        opening = self._run.backend.chat_template().opening(role, not self._conversation_started)
        self._append(opening)
        self._conversation_started = True
        self._open_role = (role, len(self._text))

    def _end(self, role: str) -> None:
        if self._open_role is None or self._open_role[0] != role:
            raise ValueError(f"no open {role} block to end")
        content = self._text[self._open_role[1] :]
        self._append(self._run.backend.chat_template().closing(role))
        with self._cond:
            self._messages.append({"role": role, "content": content})
            self._open_role = None

    def _append(
        self,
        text: str,
        name: str | None = None,
        meta: dict[str, Any] | None = None,
        value: str | None = None,
    ) -> None:
        """Append `text`; with `meta`, also set variable `name` (to `value`, by default
        the text)."""
        with self._cond:
            self._text += text
            if text:
                self._chunks.append((name, text))
            if meta is not None and name is not None:
                self._vars[name] = text if value is None else value
                self._meta[name] = meta
            self._cond.notify_all()

    # -- waiting -----------------------------------------------------------------------------

    def _wait_for_var(self, name: str) -> None:
        self._cond.wait_for(
            lambda: name in self._vars or self._error is not None or self._settled()
        )
        self._raise_failure()
        if name not in self._vars:
            raise KeyError(f"{self._label}: no variable {name!r} (have {sorted(self._vars)})")

    def _settled(self) -> bool:
        """Nothing queued is left to run, and (read from outside a streamed run, whose
        program is still adding statements) the program has ended."""
        if self._pending:
            return False
        outside = self._run.stream and threading.get_ident() != self._run.program_thread
        return self._finished or not outside

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise self._error
        if self._finished and self._run.failure is not None:
            raise self._run.failure

    # -- forks and the end of a run ----------------------------------------------------------

    def _branch(self, index: int) -> ProgramState:
        branch = ProgramState(self._run, f"{self._label} fork[{index}]")
        branch._text = self._text
        branch._vars = dict(self._vars)
        branch._meta = dict(self._meta)
        branch._messages = [dict(m) for m in self._messages]
        branch._open_role = self._open_role
        branch._conversation_started = self._conversation_started
        return branch

    def sync_all(self) -> None:
        """Sync this state and every branch forked from it."""
        self.sync()
        for child in list(self._children):
            child.sync_all()

    def finish(self) -> None:
        """No more statements: stop the thread (after what is queued) and let stream
        readers end. Branches too."""
        with self._cond:
            self._finished = True
            self._cond.notify_all()
        self._queue.put(None)
        for child in list(self._children):
            child.finish()


class ProgramStateGroup(Sequence[ProgramState]):
    """The branches of one fork. `+=` appends to every branch."""

    def __init__(self, parent: ProgramState, branches: list[ProgramState]) -> None:
        self._parent = parent
        self._branches = branches
        self._base_vars = dict(parent._vars)
        self._base_len = len(parent._text)

    def __getitem__(self, index: int) -> ProgramState:  # type: ignore[override]
        return self._branches[index]

    def __len__(self) -> int:
        return len(self._branches)

    def __iadd__(self, expr: Expr | str) -> ProgramStateGroup:
        location = _location()
        for branch in self._branches:
            branch.submit(to_expr(expr), location)
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch. `gather_variable`: each variable the branches set
        becomes, in the parent, the list of their values; `concate_and_append`: the
        branches' new text, concatenated, is appended to the parent."""
        if mode not in _JOIN_MODES:
            raise ValueError(f"join mode must be one of {sorted(_JOIN_MODES)}, not {mode!r}")
        for branch in self._branches:
            branch.sync_all()
        self._parent.sync()
        _JOIN_MODES[mode](self)
        for branch in self._branches:
            branch.finish()

    def _gather_variables(self) -> None:
        names = {
            name
            for b in self._branches
            for name, value in b._vars.items()
            if name not in self._base_vars or value is not self._base_vars[name]
        }
        parent = self._parent
        with parent._cond:
            for name in sorted(names):
                parent._vars[name] = [b._vars.get(name) for b in self._branches]
                parent._meta[name] = {"branches": [b._meta.get(name, {}) for b in self._branches]}

    def _concatenate(self) -> None:
        for b in self._branches:
            self._parent._append(b._text[self._base_len :])


_JOIN_MODES: dict[str, Callable[[ProgramStateGroup], None]] = {
    "gather_variable": ProgramStateGroup._gather_variables,
    "concate_and_append": ProgramStateGroup._concatenate,
}


def _location() -> str:
    """Where the program wrote the statement: the caller of our caller."""
    frame = sys._getframe(2)
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
