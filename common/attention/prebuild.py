"""flashinfer's JIT kernels, compiled side by side while the worker loads its model.

On a fresh machine flashinfer compiles each attention module the first time it is used. A
worker's warm-up spent 52 s in its first wave (the single-prompt kernel) and 60 s in its
second (the batch prefill kernel, paged and ragged), one after the other, after 66 s of
loading and capturing (4x H100, results/gpu_2026-11-28_s20). Here both start compiling as
soon as the scheduler process knows the model's head size and dtype, in one background
thread, beside the load; the warm-up then finds them built.

One ninja process builds every module (a file of `subninja` lines), in flashinfer's JIT
folder and under each module's flashinfer file lock. Two ninja processes in one folder
share its build log: run side by side, they left it inconsistent, and every later ninja
there rebuilt the modules from scratch, minutes per worker (4x H100, 2026-11-28, s21). The
thread only compiles: nothing off the main thread touches a CUDA stream, so the decode
graphs captured meanwhile are undisturbed. The modules are named the way flashinfer's own
calls name them (`flashinfer_specs`); a module the warm-up still compiles is a naming
mismatch, and the scheduler process says which.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

log = logging.getLogger("baton.scheduler")


class Buildable(Protocol):
    """What a flashinfer `JitSpec` offers: its name, its ninja file (written on demand)
    and the file lock flashinfer holds while it builds or loads it."""

    @property
    def name(self) -> str: ...

    @property
    def ninja_path(self) -> Path: ...

    @property
    def lock_path(self) -> Path: ...

    def write_ninja(self) -> None: ...


def run_one_ninja(build_dir: Path, specs: Sequence[Buildable]) -> None:
    """Build every module of `specs` with one ninja process in `build_dir`, flashinfer's
    JIT folder (its ninja files name their outputs relative to it), holding each module's
    lock: no other ninja runs on these modules meanwhile, in this process or another."""
    from filelock import FileLock

    with ExitStack() as locks:
        for spec in sorted(specs, key=lambda s: s.name):  # one order: no deadlock
            locks.enter_context(FileLock(spec.lock_path, thread_local=False))
        for spec in specs:
            if not spec.ninja_path.exists():
                spec.write_ninja()
        combined = build_dir / f"baton_prebuild_{os.getpid()}.ninja"
        combined.write_text(
            "".join(f"subninja {spec.ninja_path.relative_to(build_dir)}\n" for spec in specs)
        )
        try:
            targets = [f"{spec.name}/{spec.name}.so" for spec in specs]
            subprocess.run(
                ["ninja", "-C", str(build_dir), "-f", combined.name, *targets],
                check=True,
                capture_output=True,
                text=True,
            )
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"ninja exited with {e.returncode}: {e.stdout[-2000:]}") from e
        finally:
            combined.unlink(missing_ok=True)


@dataclass
class Prebuild:
    """Modules being compiled in a background thread; `wait` waits for them."""

    specs: Sequence[Buildable]
    build_dir: Path  # flashinfer's JIT folder
    build: Callable[[Path, Sequence[Buildable]], None] = run_one_ninja
    started: float = field(default_factory=time.monotonic)
    error: str | None = None
    _thread: threading.Thread | None = None
    _before: set[str] = field(default_factory=set)

    def start(self) -> Prebuild:
        self._before = self.compiled()
        self._thread = threading.Thread(target=self._build, name="prebuild", daemon=True)
        self._thread.start()
        return self

    def _build(self) -> None:
        try:
            self.build(self.build_dir, self.specs)
        except Exception as e:  # the warm-up compiles them again, and says why if it fails
            self.error = f"{type(e).__name__}: {e}"

    def wait(self) -> float:
        """Seconds this waited for the build (0 when it was done already)."""
        start = time.monotonic()
        if self._thread is not None:
            self._thread.join()
        waited = time.monotonic() - start
        names = [s.name for s in self.specs]
        log.info(
            "flashinfer: %d kernel modules ready %.1f s after the start (%d compiled here or "
            "by a worker beside this one; waited %.1f s for them): %s",
            len(names),
            time.monotonic() - self.started,
            len([n for n in names if n not in self._before]),
            waited,
            ", ".join(names),
        )
        if self.error is not None:
            log.warning(
                "flashinfer: building its modules failed (%s); first use builds them", self.error
            )
        return waited

    def compiled(self) -> set[str]:
        """Names of the modules whose library is in the JIT folder."""
        if not self.build_dir.is_dir():
            return set()
        return {p.parent.name for p in self.build_dir.glob("*/*.so")}

    def unexpected(self, before: Iterable[str]) -> list[str]:
        """Modules compiled since `before` that this prebuild did not name."""
        named = {s.name for s in self.specs}
        return sorted(self.compiled() - set(before) - named)


def flashinfer_specs(head_dim: int, dtype: object, device: object) -> list[Buildable]:
    """The modules baton's flashinfer backend uses at this head size and dtype, named as
    flashinfer names them at their first use: the single-prompt kernel
    (`single_prefill_with_kv_cache`) and the batch prefill kernel that both the paged and
    the ragged wrappers plan (`get_batch_prefill_module`), on the backend flashinfer picks
    for this device (fa3 on an H100)."""
    import torch
    from flashinfer.jit import gen_batch_prefill_module, gen_single_prefill_module
    from flashinfer.utils import determine_attention_backend

    pos_encoding_none, no_fp16_reduction, no_custom_mask = 0, False, False
    backend = determine_attention_backend(
        device, pos_encoding_none, no_fp16_reduction, no_custom_mask, dtype, dtype
    )
    shape = (head_dim, head_dim, pos_encoding_none, False, False, no_fp16_reduction)
    return [
        gen_single_prefill_module(backend, dtype, dtype, dtype, *shape),
        gen_batch_prefill_module(backend, dtype, dtype, dtype, torch.int32, *shape),
    ]


def start_flashinfer_prebuild(
    head_dim: int,
    dtype: object,
    device: object,
    specs: Callable[[int, object, object], list[Buildable]] = flashinfer_specs,
) -> Prebuild | None:
    """Start compiling; None (and a log line) where the modules cannot be named, as with
    a flashinfer whose internals moved: then the warm-up compiles as it always did."""
    try:
        from flashinfer.jit import env as jit_env

        build_dir = Path(jit_env.FLASHINFER_JIT_DIR)
        named = specs(head_dim, dtype, device)
    except Exception as e:
        log.warning("flashinfer: cannot name its kernel modules (%s); the warm-up compiles them", e)
        return None
    return Prebuild(named, build_dir).start()
