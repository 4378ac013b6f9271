"""`@function`: a Python function over a state becomes a program that runs against a
backend, once (`run`), for many inputs at once (`run_batch`), or streamed.

    @function
    def qa(s, question):
        s += user(question)
        s += assistant(gen("answer", max_tokens=64))

    state = qa.run(question="...")          # blocks until the program ends
    state["answer"], state.text()
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from baton.lang.backend import Backend
from baton.lang.state import ProgramState, RunContext

DEFAULT_MAX_NEW_TOKENS = 128
MAX_BATCH_THREADS = 64

_default_backend: Backend | None = None


def set_default_backend(backend: Backend | None) -> None:
    """The backend programs run against when `run` is given none."""
    global _default_backend
    _default_backend = backend


def _backend(given: Backend | None) -> Backend:
    backend = given or _default_backend
    if backend is None:
        raise RuntimeError(
            "no backend: call set_default_backend(RuntimeEndpoint(url)) or pass backend=..."
        )
    return backend


class Program:
    """A program: `func(s, **arguments)` appends to its state `s`."""

    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func
        self.name = func.__name__
        self._signature = inspect.signature(func)
        if not self._signature.parameters:
            raise TypeError(f"{self.name}: a program's first parameter is its state")
        self.__doc__ = func.__doc__

    def __repr__(self) -> str:
        return f"<program {self.name}>"

    def run(
        self,
        *args: Any,
        backend: Backend | None = None,
        stream: bool = False,
        **arguments: Any,
    ) -> ProgramState:
        """Run the program with `arguments`. Arguments named like `sampling_defaults`'
        parameters (max_new_tokens, temperature, stop, ...) are defaults for the program's
        `gen` statements. Without `stream`, returns when the program has ended (a failed
        statement raises its `ProgramError`); with `stream=True`, returns at once: read the
        text as it comes with `state.text_iter()`."""
        return self._start(self.name, backend, stream, args, arguments)

    def run_batch(
        self,
        batch_arguments: Sequence[Mapping[str, Any]],
        *,
        backend: Backend | None = None,
        num_threads: int | str = "auto",
        **defaults: Any,
    ) -> list[ProgramState]:
        """Run the program once per mapping of arguments, `num_threads` runs at a time
        (their requests run concurrently); the states come back in input order. `defaults`
        are sampling defaults for every run. A failed run raises its error, naming its
        input as `name[index]`."""
        if num_threads == "auto":
            threads = max(min(len(batch_arguments), MAX_BATCH_THREADS), 1)
        elif isinstance(num_threads, int) and not isinstance(num_threads, bool) and num_threads > 0:
            threads = num_threads
        else:
            raise ValueError(f"num_threads must be 'auto' or a positive int, not {num_threads!r}")
        with ThreadPoolExecutor(threads, thread_name_prefix=f"baton-lang {self.name}") as pool:
            futures = [
                pool.submit(
                    self._start, f"{self.name}[{i}]", backend, False, (), {**defaults, **arguments}
                )
                for i, arguments in enumerate(batch_arguments)
            ]
        return [f.result() for f in futures]

    def _start(
        self,
        label: str,
        backend: Backend | None,
        stream: bool,
        args: tuple[Any, ...],
        arguments: dict[str, Any],
    ) -> ProgramState:
        defaults = sampling_defaults(**{k: v for k, v in arguments.items() if k in _SAMPLING})
        arguments = {k: v for k, v in arguments.items() if k not in _SAMPLING}
        bound = self._signature.bind(None, *args, **arguments)  # a missing argument: now
        state = ProgramState(RunContext(label, _backend(backend), defaults, stream))
        if not stream:
            self._drive(state, bound)
            return state
        thread = threading.Thread(
            target=self._drive, args=(state, bound), name=f"baton-lang {label}", daemon=True
        )
        thread.start()
        return state

    def _drive(self, state: ProgramState, bound: inspect.BoundArguments) -> None:
        run = state._run
        run.program_thread = threading.get_ident()
        try:
            self.func(state, *bound.args[1:], **bound.kwargs)
            state.sync_all()
        except BaseException as e:
            run.failure = e
            if not run.stream:
                raise
        finally:
            state.finish()


def sampling_defaults(
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    stop: str | Sequence[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
) -> dict[str, Any]:
    """The `/generate` sampling params a run gives `gen` statements that do not set them
    (unset ones: the server's defaults)."""
    given = {
        "max_new_tokens": max_new_tokens,
        "stop": [stop] if isinstance(stop, str) else list(stop) if stop else None,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "frequency_penalty": frequency_penalty,
        "presence_penalty": presence_penalty,
        "ignore_eos": ignore_eos,
    }
    return {k: v for k, v in given.items() if v is not None}


_SAMPLING = frozenset(inspect.signature(sampling_defaults).parameters)


def function(func: Callable[..., Any]) -> Program:
    """Make `func(s, ...)` a program (SGLang's `@function`)."""
    return Program(func)
