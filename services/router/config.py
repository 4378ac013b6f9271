"""The router's configuration, resolved once from the command line (or built by tests)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from baton.common.config import ModelConfig
from baton.common.options import ConfigError, log_level_option, option, secret_option
from baton.services.httpguard import DEFAULT_HEADER_TIMEOUT_S
from baton.services.registry.config import RegistryConfig
from baton.services.router.placement import PLACEMENT_NAMES
from baton.services.router.policies import POLICY_NAMES
from baton.services.router.tool_parsers import PARSER_NAMES
from baton.services.tracing import (
    check_endpoint,
    check_sample_ratio,
    endpoint_option,
    sample_ratio_option,
)


@dataclass(frozen=True)
class WorkerCounts:
    """Workers by role, by the names /health counts them under: ``prefill=1,decode=2``
    on a command line (a role left out counts none)."""

    both: int = 0  # aggregated workers
    prefill: int = 0
    decode: int = 0

    def __post_init__(self) -> None:
        if any(count < 0 for count in asdict(self).values()):
            raise ValueError(f"worker counts must be >= 0 (got {self})")

    @classmethod
    def parse(cls, text: str) -> WorkerCounts | None:
        """``prefill=1,decode=2`` -> counts; empty text -> None (unset, as for every flag).
        Raises ValueError naming what it cannot read."""
        if not text.strip():
            return None
        roles = [f.name for f in fields(cls)]
        counts: dict[str, int] = {}
        for part in text.split(","):
            role, _, count = part.partition("=")
            role = role.strip()
            if role not in roles or role in counts or not count.strip().isdigit():
                raise ValueError(
                    f"{part.strip()!r}: expected <role>=<count> with a role of "
                    f"{', '.join(roles)}, each once, e.g. prefill=1,decode=2"
                )
            counts[role] = int(count)
        return cls(**counts)

    def __str__(self) -> str:
        """The text `parse` reads back."""
        return ",".join(f"{role}={n}" for role, n in asdict(self).items() if n) or "both=0"

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def missing(self, joined: Mapping[str, int]) -> dict[str, int]:
        return missing_workers(asdict(self), joined)


def missing_workers(expected: Mapping[str, int], joined: Mapping[str, int]) -> dict[str, int]:
    """Workers of each role still to join, given the counts expected and those that have
    (roles short of none are left out). The router's /health and a benchmark reading it
    both count this way."""
    return {
        role: n - joined.get(role, 0) for role, n in expected.items() if n > joined.get(role, 0)
    }


@dataclass(frozen=True)
class RouterConfig:
    """The router process: where it listens, which model it serves, how it routes."""

    host: str = option("127.0.0.1", "address to bind", group="network")
    port: int = option(8000, "HTTP port", group="network")
    registry: RegistryConfig | None = None  # where workers register (its own flags: --registry)
    model: str | None = option(
        None,
        "model folder (tokenizer, chat template, context length); default: the built-in tiny model",
        group="model",
    )
    served_model_name: str | None = option(
        None, "the model name clients use; default: the model folder's name", group="model"
    )
    tool_call_parser: str = option(
        "auto",
        "how tool calls are read from the model's text; auto: by the tokenizer's "
        "tokens (Mistral, Llama 3 JSON, else Hermes/Qwen <tool_call> tags)",
        group="model",
        choices=PARSER_NAMES,
    )
    policy: str = option(
        "cache_aware", "how to pick among aggregated workers", group="routing", choices=POLICY_NAMES
    )
    prefill_policy: str = option(
        "cache_aware", "how to pick a prefill worker", group="routing", choices=POLICY_NAMES
    )
    decode_policy: str = option(
        "power_of_two", "how to pick a decode worker", group="routing", choices=POLICY_NAMES
    )
    kv_events: str = option(
        "on",
        "follow the workers' KV events to know exactly which prefixes each caches (off: "
        "cache_aware guesses from the prompts it sent)",
        group="routing",
        choices=("on", "off"),
    )
    kv_events_max_lag: float = option(
        1.0,
        "seconds a worker's KV events may lag before routing guesses its cache instead",
        group="routing",
    )
    expect_workers: WorkerCounts | None = option(
        None,
        "workers the cluster is made of, by role, e.g. prefill=1,decode=2 or both=4: "
        "/health says 'partial' until that many have joined (baton up sets it)",
        group="routing",
        parse=WorkerCounts.parse,
    )
    placement: str = option(
        "always-disagg",
        "where each request's prompt is computed with prefill and decode workers: "
        "always-disagg (on P), threshold (on D when under 2,048 tokens and 70%% of the prompt "
        "are uncached there), cost (the cheapest by the cluster's measured step times)",
        group="routing",
        choices=PLACEMENT_NAMES,
    )
    ttft_slo: float = option(
        2.0, "seconds to the first token the cost placement aims for", group="routing"
    )
    tpot_slo: float = option(
        0.02,
        "seconds per output token the cost placement aims for (give decode workers the same "
        "--tpot-slo: they hold their local prefill to it)",
        group="routing",
    )
    api_key: str | None = secret_option(
        "require 'Authorization: Bearer <key>' on the API; prefer the environment "
        "variable over the flag, which other local users can read in the process list",
    )
    admin_api_key: str | None = secret_option(
        "require 'Authorization: Bearer <key>' on admin endpoints (/flush_cache), "
        "which are refused without one (same advice as --api-key)",
    )
    cluster_id: str | None = option(
        None,
        "a name for this cluster, reported in /health so that a client can tell it is "
        "asking the router it means to (baton up sets it); default: a random one",
        group="routing",
    )
    vllm_metrics: bool = option(
        True,
        "also serve vLLM's names for the series of the same meaning (vllm:num_requests_running, "
        "vllm:time_to_first_token_seconds, ...; docs/METRICS.md), for vLLM's dashboards and "
        "autoscalers; promtool flags their colons, as it does on vLLM's own /metrics",
        group="observability",
    )
    metrics_public: bool = option(
        False,
        "serve /metrics without the API key (to scrapers that cannot send one); by default "
        "/metrics needs it whenever --api-key is set",
        group="security",
    )
    cluster_token: str | None = secret_option(
        "shared secret of the cluster's control plane (same advice as --api-key)",
    )
    max_concurrent_requests: int = option(
        0,
        "requests served at once, more wait in line (0: twice what the workers report they "
        "run at once)",
        group="limits",
    )
    max_queued_requests: int = option(
        1024, "requests waiting in line for a slot; more are refused with 429", group="limits"
    )
    queue_timeout: float = option(
        60.0, "seconds a request may wait in line before it is refused with 429", group="limits"
    )
    max_body_bytes: int = option(
        16 * 1024 * 1024,
        "largest request body accepted; larger ones are refused with 413",
        group="limits",
    )
    body_timeout: float = option(
        30.0, "seconds a request body may take to arrive before a 408", group="limits"
    )
    header_timeout: float = option(
        DEFAULT_HEADER_TIMEOUT_S,
        "seconds a connection may take to send a request's headers (from opening, or from "
        "its previous response) before it is closed",
        group="limits",
    )
    request_timeout: float = option(
        600.0, "seconds a request may take before it is aborted (0: no limit)", group="limits"
    )
    otlp_traces_endpoint: str | None = endpoint_option()
    otlp_traces_sample_ratio: float | None = sample_ratio_option()
    log_level: str = log_level_option()

    def __post_init__(self) -> None:
        for name in ("policy", "prefill_policy", "decode_policy"):
            if getattr(self, name) not in POLICY_NAMES:
                raise ConfigError(self, name, f"must be one of {', '.join(POLICY_NAMES)}")
        if self.kv_events not in ("on", "off"):
            raise ConfigError(self, "kv_events", "must be on or off")
        if not self.kv_events_max_lag > 0:
            raise ConfigError(self, "kv_events_max_lag", "must be > 0")
        if self.tool_call_parser not in PARSER_NAMES:
            raise ConfigError(self, "tool_call_parser", f"must be one of {', '.join(PARSER_NAMES)}")
        if self.max_concurrent_requests < 0:
            raise ConfigError(self, "max_concurrent_requests", "must be >= 0")
        if self.max_queued_requests < 0:
            raise ConfigError(self, "max_queued_requests", "must be >= 0")
        for name in ("queue_timeout", "max_body_bytes", "body_timeout", "header_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(self, name, "must be > 0")
        if not 0 <= self.port < 65536:
            raise ConfigError(self, "port", "must be in [0, 65536)")
        if why := check_endpoint(self.otlp_traces_endpoint):
            raise ConfigError(self, "otlp_traces_endpoint", why)
        if why := check_sample_ratio(self.otlp_traces_sample_ratio):
            raise ConfigError(self, "otlp_traces_sample_ratio", why)
        if self.placement not in PLACEMENT_NAMES:
            raise ConfigError(self, "placement", f"must be one of {', '.join(PLACEMENT_NAMES)}")
        for name in ("ttft_slo", "tpot_slo"):
            if not getattr(self, name) > 0:
                raise ConfigError(self, name, "must be > 0")

    def model_path(self) -> Path:
        if self.model is not None:
            return Path(self.model)
        from baton.common.models.tiny import default_model_path  # builds it on first use

        return default_model_path()

    @property
    def timeout(self) -> float | None:
        return self.request_timeout if self.request_timeout > 0 else None


@dataclass(frozen=True)
class ModelInfo:
    """What the router needs to know of the model besides its tokenizer."""

    name: str  # the served model name
    path: Path
    context_len: int
    vocab_size: int

    @classmethod
    def load(cls, path: Path, served_name: str | None) -> ModelInfo:
        model = ModelConfig.from_pretrained(path)  # the engine's reading of config.json
        return cls(
            name=served_name or path.resolve().name,
            path=path,
            context_len=model.context_len,
            vocab_size=model.vocab_size,
        )
