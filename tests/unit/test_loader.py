"""Strict checkpoint loading: wrong or missing tensors are refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton.common.engine import Engine
from baton.common.models.loader import CheckpointError
from baton.common.sampling import SamplingParams
from tests.conftest import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


def _copy(model: Path, dst: Path) -> dict[str, torch.Tensor]:
    shutil.copytree(model, dst)
    return load_file(str(dst / "model.safetensors"))


def test_wrong_shape_is_refused_by_name(tiny_model: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    tensors = _copy(tiny_model, bad)
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        Engine(bad)


def test_missing_and_unexpected_tensors_are_named(tiny_model: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    tensors = _copy(tiny_model, bad)
    del tensors["model.layers.0.mlp.up_proj.weight"]
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        Engine(bad)
    assert "model.layers.0.mlp.up_proj.weight" in str(err.value)
    assert "model.layers.0.mlp.extra.weight" in str(err.value)


def test_sharded_checkpoint_loads_the_same(tiny_model: Path, tmp_path: Path) -> None:
    sharded = tmp_path / "sharded"
    tensors = _copy(tiny_model, sharded)
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(sharded / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    prompts = random_prompts([12], vocab=2000)
    with Engine(tiny_model) as a, Engine(sharded) as b:
        assert (
            a.generate(prompts, GREEDY)[0].output_ids == b.generate(prompts, GREEDY)[0].output_ids
        )


def test_dummy_load_reads_no_weights(tiny_model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "noweights"
    folder.mkdir()
    shutil.copy(tiny_model / "config.json", folder / "config.json")
    with (
        Engine(folder, load_format="dummy", seed=3) as a,
        Engine(folder, load_format="dummy", seed=3) as b,
    ):
        prompts = random_prompts([10], vocab=2000)
        out = a.generate(prompts, GREEDY)[0].output_ids
        assert len(out) == 8
        assert out == b.generate(prompts, GREEDY)[0].output_ids
    with pytest.raises(CheckpointError):
        Engine(folder)
