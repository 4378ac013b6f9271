"""The router's configuration, resolved once from the command line (or built by tests)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from baton.services.registry.config import RegistryConfig
from baton.services.router.policies import POLICY_NAMES


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    registry: RegistryConfig | None = None  # where workers register; None: static workers only
    model: str | None = None  # model folder; None: the built-in tiny model
    served_model_name: str | None = None  # None: the model folder's name
    policy: str = "cache_aware"  # among aggregated workers
    prefill_policy: str = "cache_aware"
    decode_policy: str = "power_of_two"
    api_key: str | None = None
    admin_api_key: str | None = None  # admin endpoints (/flush_cache); None: refused
    tool_call_parser: str = "auto"  # see tool_parsers.PARSER_NAMES
    cluster_token: str | None = None
    max_concurrent_requests: int = 256
    request_timeout: float = 600.0  # seconds per request; <= 0: no limit
    log_level: str = "info"

    def __post_init__(self) -> None:
        for name in ("policy", "prefill_policy", "decode_policy"):
            if getattr(self, name) not in POLICY_NAMES:
                raise ValueError(
                    f"{name} must be one of {', '.join(POLICY_NAMES)}, got {getattr(self, name)!r}"
                )
        if self.max_concurrent_requests < 1:
            raise ValueError(
                f"max_concurrent_requests must be >= 1, got {self.max_concurrent_requests}"
            )
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")

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
        # Read config.json directly rather than through the engine's ModelConfig: the
        # router needs two numbers, and must not import torch to get them.
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file} not found: not a Hugging Face model folder")
        config = json.loads(config_file.read_text())
        return cls(
            name=served_name or path.resolve().name,
            path=path,
            context_len=int(config["max_position_embeddings"]),
            vocab_size=int(config["vocab_size"]),
        )
