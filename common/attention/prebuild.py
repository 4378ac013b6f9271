"""flashinfer's JIT kernels, compiled side by side while the worker loads its model.

On a fresh machine flashinfer compiles each attention module the first time it is used. A
worker's warm-up spent 52 s in its first wave (the single-prompt kernel) and 60 s in its
second (the batch prefill kernel, paged and ragged), one after the other, after 66 s of
loading and capturing (4x H100, results/gpu_2026-11-28_s20). Here both start compiling as
soon as the scheduler process knows the model's head size and dtype, each in its own
thread, beside the load; the warm-up then finds them built.

The threads only compile: ninja runs in a subprocess under flashinfer's per-module file
lock (so the workers of one machine build each module once), and nothing off the main
thread touches a CUDA stream, so the decode graphs captured meanwhile are undisturbed. The
modules are named the way flashinfer's own calls name them (`flashinfer_specs`); a module
the warm-up still compiles is a naming mismatch, and `Prebuild.finish` says which.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

log = logging.getLogger("baton.scheduler")


class Buildable(Protocol):
    """What a flashinfer `JitSpec` offers: a name, and a build that compiles (no load)."""

    @property
    def name(self) -> str: ...

    def build(self, verbose: bool) -> None: ...


@dataclass
class Prebuild:
    """Modules being compiled in background threads; `finish` waits for them."""

    specs: Sequence[Buildable]
    built_dir: Path | None = None  # flashinfer's JIT folder, to see what else compiles
    started: float = field(default_factory=time.monotonic)
    errors: dict[str, str] = field(default_factory=dict)
    _threads: list[threading.Thread] = field(default_factory=list)
    _before: set[str] = field(default_factory=set)

    def start(self) -> Prebuild:
        self._before = self.compiled()
        for spec in self.specs:
            t = threading.Thread(target=self._build, args=(spec,), daemon=True)
            t.name = f"prebuild-{spec.name[:40]}"
            t.start()
            self._threads.append(t)
        return self

    def _build(self, spec: Buildable) -> None:
        try:
            spec.build(False)
        except Exception as e:  # the warm-up compiles it again, and says why if it fails
            self.errors[spec.name] = f"{type(e).__name__}: {e}"

    def wait(self) -> float:
        """Seconds this waited for the builds (0 when they were done already)."""
        start = time.monotonic()
        for t in self._threads:
            t.join()
        waited = time.monotonic() - start
        names = [s.name for s in self.specs]
        fresh = [n for n in names if n not in self._before]
        log.info(
            "flashinfer: %d kernel modules ready %.1f s after the start (%d compiled here, "
            "waited %.1f s for them): %s",
            len(names),
            time.monotonic() - self.started,
            len(fresh),
            waited,
            ", ".join(names),
        )
        for name, error in self.errors.items():
            log.warning(
                "flashinfer: building %s failed (%s); its first use compiles it", name, error
            )
        return waited

    def compiled(self) -> set[str]:
        """Names of the modules whose library is in flashinfer's JIT folder."""
        if self.built_dir is None or not self.built_dir.is_dir():
            return set()
        return {p.parent.name for p in self.built_dir.glob("*/*.so")}

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
    """Start compiling; None (and a log line) where the specs cannot be named, as with a
    flashinfer whose internals moved: then the warm-up compiles as it always did."""
    try:
        from flashinfer.jit import env as jit_env

        built_dir: Path | None = Path(jit_env.FLASHINFER_JIT_DIR)
    except Exception:
        built_dir = None
    try:
        named = specs(head_dim, dtype, device)
    except Exception as e:
        log.warning("flashinfer: cannot name its kernel modules (%s); the warm-up compiles them", e)
        return None
    return Prebuild(named, built_dir).start()
