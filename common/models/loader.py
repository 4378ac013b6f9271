"""Strict safetensors loading: every checkpoint tensor is consumed, every parameter filled.

A missing tensor, a leftover tensor or a wrong shape is an error that names it.
Sharded checkpoints are read through `model.safetensors.index.json`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    pass


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors files in {model_dir}")
    return files


def iter_tensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def load_weights(model: nn.Module, model_dir: str | Path) -> None:
    params = dict(model.named_parameters())
    expected: set[tuple[str, int]] = model.expected_shards()  # type: ignore[operator]
    tied = getattr(model.config, "tie_word_embeddings", False)
    filled: set[tuple[str, int]] = set()
    leftovers: list[str] = []
    for ckpt_name, tensor in iter_tensors(model_dir):
        if ckpt_name.endswith(_IGNORED_SUFFIXES) or (tied and ckpt_name == "lm_head.weight"):
            continue
        target = model.checkpoint_target(ckpt_name)  # type: ignore[operator]
        param = params.get(target[0]) if target is not None else None
        if target is None or param is None:
            leftovers.append(ckpt_name)
            continue
        name, shard = target
        loader = getattr(param, "weight_loader", None)
        if loader is not None:
            loader(param, tensor.to(param.dtype), shard, ckpt_name)
        elif tuple(param.shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"{ckpt_name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(param.shape)}"
            )
        else:
            param.data.copy_(tensor.to(param.dtype))
        filled.add((name, shard))
    missing = sorted(expected - filled)
    if leftovers or missing:
        parts = []
        if missing:
            parts.append(
                "missing tensors: " + ", ".join(_ckpt_name(model, n, s) for n, s in missing)
            )
        if leftovers:
            parts.append("unexpected tensors: " + ", ".join(sorted(leftovers)))
        raise CheckpointError(
            f"checkpoint {model_dir} does not match the model: " + "; ".join(parts)
        )


def _ckpt_name(model: nn.Module, name: str, shard: int) -> str:
    stacked: dict[str, tuple[str, int]] = getattr(model, "stacked", {})
    for frag, (ours, s) in stacked.items():
        if ours in name and s == shard:
            return name.replace(ours, frag)
    return name


def init_dummy(model: nn.Module, seed: int) -> None:
    """Random weights of the real shapes, deterministic per seed and device; no weight
    files read. Generated on the parameters' device, so 8B-sized models start fast."""
    for i, (name, param) in enumerate(model.named_parameters()):
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
            continue
        gen = torch.Generator(device=param.device).manual_seed(seed * 100003 + i)
        fan_in = param.shape[-1] if param.dim() > 1 else 1
        noise = torch.randn(
            param.shape,
            generator=gen,
            device=param.device,
            dtype=torch.float32 if param.dtype == torch.float32 else param.dtype,
        )
        param.data.copy_(noise.mul_(1.0 / max(fan_in, 1) ** 0.5))
