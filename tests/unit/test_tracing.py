"""Tracing's switch: off unless an endpoint is given (flag or OTEL_* variable), off then
without importing OpenTelemetry's SDK, and the settings a config refuses."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from baton.common.options import ConfigError
from baton.services.router.config import RouterConfig
from baton.services.tracing import Tracing

_OTEL = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}


def test_off_by_default_without_loading_the_sdk() -> None:
    check = (
        "import sys\n"
        "from baton.services.router.app import create_app\n"
        "from baton.services.router.config import RouterConfig\n"
        "from baton.services.tracing import Tracing\n"
        "assert RouterConfig().otlp_traces_endpoint is None\n"
        "assert Tracing.start('baton-router', None, None) is None\n"
        "loaded = [m for m in sys.modules if m.startswith('opentelemetry.sdk')]\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", check], env=_OTEL, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


def test_the_standard_variables_turn_it_on_and_off(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:1")
    tracing = Tracing.start("baton-router", None, 0.5)
    assert tracing is not None
    try:
        resource = tracing.provider.resource.attributes
        assert resource["service.name"] == "baton-router"
        assert "TraceIdRatioBased{0.5}" in tracing.provider.sampler.get_description()
    finally:
        tracing.shutdown()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert Tracing.start("baton-router", "http://127.0.0.1:1", None) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("otlp_traces_endpoint", "collector:4317"),  # no scheme: the exporter would use TLS
        ("otlp_traces_endpoint", "http://collector:4317/v1/traces"),  # HTTP's path, not gRPC's
        ("otlp_traces_sample_ratio", 1.5),
        ("otlp_traces_sample_ratio", -0.1),
    ],
)
def test_settings_refused_with_their_flag(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as refused:
        RouterConfig(**{field: value})  # type: ignore[arg-type]
    assert refused.value.flag == "--" + field.replace("_", "-")
