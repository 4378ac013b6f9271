"""Where the built-in tiny model lives, found without torch: `baton up` with no `--model`
serves it, and importing its builder (`tiny.py`: torch, transformers) costs seconds."""

from __future__ import annotations

from pathlib import Path

from baton.common.env import CACHE_DIR, XDG_CACHE_HOME

DEFAULT_MODEL_NAME = "tiny-llama-v1"  # bump the suffix whenever make_model's output changes


def cache_dir() -> Path:
    """baton's cache root: $BATON_CACHE_DIR, else $XDG_CACHE_HOME/baton, else ~/.cache/baton."""
    if explicit := CACHE_DIR.get():
        return Path(explicit)
    xdg = XDG_CACHE_HOME.get()
    return (Path(xdg) if xdg else Path.home() / ".cache") / "baton"


def builtin_model_dir() -> Path:
    """The built-in model's folder, whether or not it is built yet
    (`tiny.default_model_path` builds it)."""
    return cache_dir() / "models" / DEFAULT_MODEL_NAME
