"""Shared fixtures: tiny models made on the fly and Hugging Face reference outputs."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from baton.common.config import ModelConfig

torch.set_num_threads(min(2, os.cpu_count() or 1))
# every engine step, here and in the workers tests start, checks it writes no KV slot or
# table cell twice (common/cache/manager.py: check_step_writes)
os.environ.setdefault("BATON_CHECK_STEPS", "1")
if not torch.cuda.is_available():
    # Without a GPU, Triton kernels run in Triton's interpreter (CI tests them that way).
    # This must happen before anything imports triton: kernels are bound at definition.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# families and their tiny shapes; qwen3 gets an explicit head_dim different from hidden/heads
FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    from baton.common.models.tiny import make_model

    made: dict[tuple, Path] = {}

    def make(arch: str = "llama", **kw: object) -> Path:
        key = (arch, *sorted(kw.items()))
        if key not in made:
            out = tmp_path_factory.mktemp(f"model-{arch}")
            made[key] = make_model(out, arch=arch, **kw)  # type: ignore[arg-type]
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(model_factory: Callable[..., Path]) -> Path:
    return model_factory("llama")


_HF_CACHE: dict[tuple, list[int]] = {}
_HF_MODELS: dict[str, object] = {}


def hf_greedy(model_dir: Path, prompt: list[int], max_new: int) -> list[int]:
    """transformers' greedy continuation in float32 on CPU (EOS ignored)."""
    key = (str(model_dir), tuple(prompt), max_new)
    if key not in _HF_CACHE:
        from transformers import AutoModelForCausalLM

        model = _HF_MODELS.get(str(model_dir))
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            _HF_MODELS[str(model_dir)] = model
        with torch.no_grad():
            out = model.generate(  # type: ignore[attr-defined]
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        _HF_CACHE[key] = out[0, len(prompt) :].tolist()
    return _HF_CACHE[key]


def hf_prompt_logprobs(model_dir: Path, prompt: list[int]) -> list[float]:
    """transformers' float32 log-softmax of each prompt token after the first."""
    from transformers import AutoModelForCausalLM

    model = _HF_MODELS.get(str(model_dir))
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        _HF_MODELS[str(model_dir)] = model
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()  # type: ignore[operator]
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    return logprobs.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1).tolist()


def random_prompts(
    lengths: list[int], vocab: int, seed: int = 0, prefix: list[int] | None = None
) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(10, vocab) for _ in range(n)] for n in lengths]


def staggered_outputs(engine, prompts: list[list[int]], sampling) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Each prompt's output ids, the prompts added two steps apart so that later ones are
    computed beside earlier ones decoding (mixed steps under --enable-mixed-chunk)."""
    sched = engine.scheduler
    for i, p in enumerate(prompts):
        sched.add_request(f"r{i}", p, sampling)
        sched.step()
        sched.step()
    while sched.has_work():
        sched.step()
    return [engine._done.pop(f"r{i}").output_ids for i in range(len(prompts))]


def llama_8b_config(**overrides: object) -> ModelConfig:
    """A Llama-3.1-8B-shaped model config (bf16), without a folder: for code that reads
    only shapes."""
    fields: dict[str, object] = dict(
        path="",
        architecture="LlamaForCausalLM",
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=32000,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=None,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
        eos_token_ids=(2,),
        torch_dtype="bfloat16",
    )
    return ModelConfig(**{**fields, **overrides})  # type: ignore[arg-type]
