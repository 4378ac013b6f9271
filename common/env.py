"""Every environment variable baton reads, besides those of its flags.

Each flag `--foo-bar` of a command reads `BATON_FOO_BAR` (services/cli.py). The variables
below are the others: each is declared once, typed and documented, and read once at
start-up by the one module that needs it; `baton --help` lists them.
tests/unit/test_env.py fails on an environment read anywhere else.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def _switch(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on")


def _text(text: str) -> str | None:
    return text or None


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    parse: Callable[[str], T]
    default: T
    help: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        return self.default if raw is None else self.parse(raw)


CACHE_DIR = EnvVar(
    "BATON_CACHE_DIR",
    _text,
    None,
    "baton's cache (the built-in tiny model): default $XDG_CACHE_HOME/baton or ~/.cache/baton",
)
XDG_CACHE_HOME = EnvVar("XDG_CACHE_HOME", _text, None, "the user's cache root (freedesktop.org)")
REGISTRY_PASSWORD = EnvVar(
    "BATON_REGISTRY_PASSWORD",
    _text,
    None,
    "the etcd user's password (--registry-username); never a flag, never in a URL",
)
UCX_ERROR_HANDLING = EnvVar(
    "BATON_UCX_ERROR_HANDLING",
    _switch,
    False,
    "ucx: endpoint error handling (a lost peer fails at once; no shared memory or CUDA IPC)",
)
TRITON_CPU = EnvVar(
    "BATON_TRITON_CPU",
    _switch,
    False,
    "run the fused Triton kernels on the CPU too, in Triton's interpreter (tests)",
)
CHECK_STEPS = EnvVar(
    "BATON_CHECK_STEPS",
    _switch,
    False,
    "check that no step writes one KV slot or one table cell twice (tests; host time per step)",
)
STEP_SECONDS_PER_TOKEN = EnvVar(
    "BATON_STEP_SECONDS_PER_TOKEN",
    float,
    0.0,
    "tests: every step also sleeps this long per token it computes, so that a CPU worker's "
    "steps take as long as a GPU's long prompt chunks (0: off)",
)
PDL = EnvVar(
    "BATON_PDL",
    _switch,
    True,
    "launch baton's Triton kernels with programmatic dependent launch on Hopper (0: without, "
    "so that a profiler sees each kernel's own time)",
)
CUDA_VISIBLE_DEVICES = EnvVar(
    "CUDA_VISIBLE_DEVICES",
    _text,
    None,
    "GPUs baton up may use: its --gpus ids index this list, as CUDA's device ids do",
)

# OpenTelemetry's own, read where baton decides whether to trace (services/tracing.py);
# the SDK reads the rest of its OTEL_* variables itself.
OTEL_SDK_DISABLED = EnvVar(
    "OTEL_SDK_DISABLED", _switch, False, "OpenTelemetry: true keeps tracing off, whatever else"
)
OTEL_TRACES_ENDPOINT = EnvVar(
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    _text,
    None,
    "OpenTelemetry: the OTLP/gRPC collector of traces; turns tracing on (--otlp-traces-endpoint)",
)
OTEL_ENDPOINT = EnvVar(
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    _text,
    None,
    "OpenTelemetry: the OTLP/gRPC collector of every signal; turns tracing on",
)
OTEL_SERVICE_NAME = EnvVar(
    "OTEL_SERVICE_NAME",
    _text,
    None,
    "OpenTelemetry: the service name of this process's spans (default: baton-<command>)",
)

ALL: tuple[EnvVar[Any], ...] = (
    CACHE_DIR,
    XDG_CACHE_HOME,
    REGISTRY_PASSWORD,
    UCX_ERROR_HANDLING,
    TRITON_CPU,
    STEP_SECONDS_PER_TOKEN,
    PDL,
    CUDA_VISIBLE_DEVICES,
    OTEL_SDK_DISABLED,
    OTEL_TRACES_ENDPOINT,
    OTEL_ENDPOINT,
    OTEL_SERVICE_NAME,
)
