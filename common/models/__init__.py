"""Model families and loading. `build_model(cfg)` returns the module for a config.json."""

from __future__ import annotations

from baton.common.config import ModelConfig


def build_model(cfg: ModelConfig):
    from baton.common.models.llama import CausalLM

    # Every supported architecture (config.SUPPORTED_ARCHITECTURES) is the same decoder;
    # their differences are fields of ModelConfig.
    return CausalLM(cfg)
