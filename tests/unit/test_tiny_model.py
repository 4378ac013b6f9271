"""The tiny-model kit writes folders that Hugging Face transformers loads and runs."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from baton.common.models import tiny, tiny_tokenizer
from baton.services import cli

transformers.logging.set_verbosity_error()

ARCH_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
PROMPTS = ["Hello, world!", "The quick brown fox", "東京 café 🙂", "1 2 3 4", "a", "x x x x x x"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: tiny.make_model(root / arch, arch=arch) for arch in tiny.ARCHES}


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("arch", tiny.ARCHES)
def test_transformers_loads_and_generates_varied_text(
    model_dirs: dict[str, Path], arch: str
) -> None:
    model_dir = model_dirs[arch]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    loaded: Any = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    model, info = loaded
    assert type(model).__name__ == ARCH_CLASSES[arch]
    assert not any(info.values()), f"checkpoint keys do not match the model: {info}"
    assert model.dtype == torch.float32

    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            logits = model(ids).logits[0, -1]
            out = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        # A wide logit spread keeps greedy argmax far from float-rounding ties.
        assert logits.std() >= 1.5
        generated = out[0, ids.shape[1] :].tolist()
        assert len(generated) == 32
        assert len(set(generated)) >= 8, f"{arch} degenerates on {prompt!r}: {generated}"


def test_outputs_depend_on_context(model_dirs: dict[str, Path]) -> None:
    # KV cache bugs must show: changing one early prompt token changes the continuation.
    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"])
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, 4096, (8, 24), generator=gen)
    changed = prompts.clone()
    changed[:, 1] = torch.randint(4, 4096, (8,), generator=gen)
    with torch.no_grad():
        a = model.generate(prompts, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        b = model.generate(changed, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert (a[:, 24:] != b[:, 24:]).any(dim=1).sum() >= 6


def test_architecture_details(model_dirs: dict[str, Path]) -> None:
    llama = read_json(model_dirs["llama"] / "config.json")
    assert llama["rope_parameters"]["rope_type"] == "llama3"
    assert llama["rope_parameters"]["rope_theta"] == 500000.0
    assert llama["rope_parameters"]["original_max_position_embeddings"] == 1024
    assert llama["tie_word_embeddings"] is False
    assert "lm_head.weight" in load_file(model_dirs["llama"] / "model.safetensors")

    qwen2 = load_file(model_dirs["qwen2"] / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.bias" in qwen2
    assert "lm_head.weight" not in qwen2  # tied to the embedding

    qwen3 = read_json(model_dirs["qwen3"] / "config.json")
    assert qwen3["head_dim"] != qwen3["hidden_size"] // qwen3["num_attention_heads"]
    weights = load_file(model_dirs["qwen3"] / "model.safetensors")
    assert weights["model.layers.0.self_attn.q_norm.weight"].shape == (qwen3["head_dim"],)

    mistral = read_json(model_dirs["mistral"] / "config.json")
    assert mistral["sliding_window"] is None
    assert mistral["rope_parameters"]["rope_theta"] == 1e6
    assert all(t.dtype == torch.float32 for t in weights.values())


def test_llama3_rope_scaling_changes_frequencies(model_dirs: dict[str, Path]) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"])
    head_dim = model.config.head_dim
    unscaled = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    scaled = model.model.rotary_emb.inv_freq
    assert torch.allclose(scaled[0], unscaled[0])  # fast rotations are kept
    assert (scaled < unscaled * 0.99).sum() >= 2  # slow ones are stretched


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    kwargs = dict(layers=1, hidden=64, heads=2, kv_heads=1, vocab=1024)
    a = tiny.make_model(tmp_path / "a", seed=3, **kwargs)
    b = tiny.make_model(tmp_path / "b", seed=3, **kwargs)
    c = tiny.make_model(tmp_path / "c", seed=4, **kwargs)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    wa, wc = load_file(a / "model.safetensors"), load_file(c / "model.safetensors")
    assert wa.keys() == wc.keys()
    assert not torch.equal(wa["model.embed_tokens.weight"], wc["model.embed_tokens.weight"])


def test_chat_template_and_special_tokens(model_dirs: dict[str, Path]) -> None:
    model_dir = model_dirs["qwen2"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = read_json(model_dir / "config.json")
    generation = read_json(model_dir / "generation_config.json")
    bos = tokenizer.convert_tokens_to_ids(tiny_tokenizer.BOS)
    eos = tokenizer.convert_tokens_to_ids(tiny_tokenizer.EOS)
    im_end = tokenizer.convert_tokens_to_ids(tiny_tokenizer.IM_END)

    assert tokenizer.bos_token_id == config["bos_token_id"] == generation["bos_token_id"] == bos
    assert tokenizer.eos_token_id == config["eos_token_id"] == eos
    assert generation["eos_token_id"] == [eos, im_end]
    assert tokenizer("hi").input_ids[0] == bos
    assert tokenizer("hi").input_ids.count(bos) == 1

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    parts: list[Any] = [{"role": "user", "content": [{"type": "text", "text": "Hi!"}]}]
    rendered = tokenizer.apply_chat_template(parts, tokenize=False)
    assert isinstance(rendered, str) and rendered.endswith("user\nHi!<|im_end|>\n")


def test_tokenizer_is_deterministic_and_exactly_vocab_sized() -> None:
    first, second = tiny_tokenizer.train_tokenizer(4096), tiny_tokenizer.train_tokenizer(4096)
    assert first.to_str() == second.to_str()
    assert first.get_vocab_size() == 4096
    # More than the shipped text supports: the rest is reserved tokens, which render as
    # text (a model of random weights generates them; as special tokens they showed
    # clients no content)
    big = tiny_tokenizer.train_tokenizer(20000)
    assert big.get_vocab_size() == 20000
    assert all(big.decode([i], skip_special_tokens=True) for i in range(4, 20000, 97))
    with pytest.raises(ValueError):
        tiny_tokenizer.train_tokenizer(100)


def test_default_model_path_is_built_once_under_concurrency(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))
    results: list[Path] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(tiny.default_model_path())
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    expected = tmp_path / "models" / tiny.DEFAULT_MODEL_NAME
    assert results == [expected] * 3
    assert os.listdir(tmp_path / "models") == [tiny.DEFAULT_MODEL_NAME]  # no temp leftovers
    assert (expected / "model.safetensors").is_file()
    assert tiny.default_model_path() == expected


def test_cache_dir_follows_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATON_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert tiny.cache_dir() == Path("/xdg/baton")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert tiny.cache_dir() == Path.home() / ".cache" / "baton"


def test_make_model_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m"
    argv = ["make-model", str(out), "--arch", "mistral", "--layers", "1", "--vocab", "1024"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.strip() == str(out)
    config = read_json(out / "config.json")
    assert config["num_hidden_layers"] == 1
    assert config["vocab_size"] == 1024
    assert config["architectures"] == ["MistralForCausalLM"]
