"""flashinfer's JIT kernels, compiled in a child process while the worker starts.

On a fresh machine flashinfer compiles each attention module the first time it is used. A
worker's warm-up spent 52 s in its first wave (the single-prompt kernel) and 60 s in its
second (the batch prefill kernel, paged and ragged), one after the other, after 66 s of
loading and capturing (4x H100, results/gpu_2026-11-28_s20). The scheduler process now
starts a child first thing that compiles both; the worker goes on meanwhile (importing
flashinfer, whose tvm-ffi JIT-compiles a torch extension for 22 s on a fresh machine,
loading, sizing the pool, capturing decode graphs) and waits for the child before its
warm-up. The child only compiles, so it skips tvm-ffi's torch extension
(`TVM_FFI_DISABLE_TORCH_C_DLPACK`) and touches no CUDA stream of the worker's.

One ninja process builds every module (a file of `subninja` lines), in flashinfer's JIT
folder and under each module's flashinfer file lock. Two ninja processes in one folder
share its deps log: run side by side, they left it inconsistent, and every later ninja
there rebuilt the modules from scratch, minutes per worker (4x H100, 2026-11-28, s21). The
modules are named the way flashinfer's own calls name them (`flashinfer_specs`); a module
the warm-up still compiles is a naming mismatch, and the scheduler process says which. A
module built ahead of time (the flashinfer-jit-cache package, or a module in flashinfer's
AOT folder) is not built again: flashinfer loads it as it is.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import IO, Protocol

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

    @property
    def is_aot(self) -> bool: ...  # built ahead of time: flashinfer loads it as it is

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


class Prebuild:
    """The child compiling the modules; `wait` waits for it and says what it built."""

    def __init__(self, command: Sequence[str], env: dict[str, str] | None = None) -> None:
        self.started = time.monotonic()
        self.names: list[str] = []
        self.build_dir: Path | None = None
        self._out: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 - closed in wait
        self._err: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 - closed in wait
        self._child = subprocess.Popen(
            list(command), stdout=self._out, stderr=self._err, stdin=subprocess.DEVNULL, env=env
        )

    def wait(self) -> float:
        """Seconds this waited for the child (0 when it was done already)."""
        start = time.monotonic()
        code = self._child.wait()
        waited = time.monotonic() - start
        self._out.seek(0)
        self._err.seek(0)
        out, err = (
            self._out.read().decode(errors="replace"),
            self._err.read().decode(errors="replace"),
        )
        self._out.close()
        self._err.close()
        try:
            report = json.loads(out.strip().splitlines()[-1]) if code == 0 else None
        except (ValueError, IndexError):
            report = None
        if not isinstance(report, dict):
            log.warning(
                "flashinfer: the kernel build beside the start failed (exit %s: %s); the "
                "warm-up builds what it needs",
                code,
                err.strip()[-600:] or out.strip()[-600:],
            )
            return waited
        self.names = [str(n) for n in report["names"]]
        self.build_dir = Path(report["build_dir"])
        log.info(
            "flashinfer: %d kernel modules ready %.1f s after the start (%d built ahead of "
            "time, %d built now, here or by a worker beside this one; waited %.1f s for "
            "them): %s",
            len(self.names),
            time.monotonic() - self.started,
            report.get("prebuilt", 0),
            report["fresh"],
            waited,
            ", ".join(self.names),
        )
        return waited

    def stop(self) -> None:
        """End the child now (the worker failed to start: nothing of it outlives it)."""
        if self._child.poll() is None:
            self._child.kill()
            self._child.wait()

    def compiled(self) -> set[str]:
        """Names of the modules whose library is in the JIT folder."""
        return compiled(self.build_dir) if self.build_dir is not None else set()

    def unexpected(self, before: Iterable[str]) -> list[str]:
        """Modules compiled since `before` that the child did not build."""
        return sorted(self.compiled() - set(before) - set(self.names))


def compiled(build_dir: Path) -> set[str]:
    if not build_dir.is_dir():
        return set()
    return {p.parent.name for p in build_dir.glob("*/*.so")}


def start_flashinfer_prebuild(head_dim: int, dtype: str, device: str) -> Prebuild:
    """Start the child that builds the modules of this head size and dtype (a torch dtype's
    name, e.g. bfloat16) for `device`."""
    command = [sys.executable, "-m", __name__, "--head-dim", str(head_dim), "--dtype", dtype]
    env = {**os.environ, "TVM_FFI_DISABLE_TORCH_C_DLPACK": "1"}
    return Prebuild([*command, "--device", device], env)


def build(head_dim: int, dtype_name: str, device_name: str) -> dict[str, object]:
    """The child's work: name the modules, build them, report."""
    import torch
    from flashinfer.jit import env as jit_env

    dtype, device = getattr(torch, dtype_name), torch.device(device_name)
    specs = flashinfer_specs(head_dim, dtype, device)
    return build_missing(Path(jit_env.FLASHINFER_JIT_DIR), specs)


def build_missing(build_dir: Path, specs: Sequence[Buildable]) -> dict[str, object]:
    """Build the modules of `specs` that were not built ahead of time (the
    flashinfer-jit-cache package, or modules in flashinfer's AOT folder): flashinfer loads
    those as they are, and compiling them again held every worker's start a minute."""
    before = compiled(build_dir)
    missing = [s for s in specs if not s.is_aot]
    if missing:
        run_one_ninja(build_dir, missing)
    return {
        "names": [s.name for s in specs],
        "build_dir": str(build_dir),
        "fresh": len([s for s in missing if s.name not in before]),
        "prebuilt": len(specs) - len(missing),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--device", required=True)
    args = parser.parse_args(argv)
    try:
        report = build(args.head_dim, args.dtype, args.device)
    except Exception as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
