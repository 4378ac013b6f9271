"""Tiny random-weight Hugging Face models, made on the fly for tests and demos.

`make_model` writes a folder that `transformers` loads like any hub checkpoint:
`config.json` and `generation_config.json` written by transformers' own config classes,
float32 weights in `model.safetensors`, and a byte-level BPE tokenizer trained on the
text shipped in `data/` (`tiny_tokenizer`: `tokenizer.json`, `tokenizer_config.json`
with a ChatML chat template, `special_tokens_map.json`).

The weights are random but chosen to behave: same seed, byte-identical safetensors;
next-token logits spread over several units, so a greedy argmax is decided by a wide
margin, not by float rounding (baton's tokens must equal transformers' on these weights;
top-two logits within float32 error of each other happen about once in 10^5 tokens);
greedy text does not collapse into one token repeated; and every prompt
token influences the continuation.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save
from transformers import (
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from baton.common.models.builtin import DEFAULT_MODEL_NAME as DEFAULT_MODEL_NAME
from baton.common.models.builtin import builtin_model_dir
from baton.common.models.builtin import cache_dir as cache_dir
from baton.common.models.tiny_tokenizer import (
    BOS,
    EOS,
    IM_END,
    save_tokenizer,
    token_id,
    train_tokenizer,
)

ARCHES = ("llama", "qwen2", "qwen3", "mistral")

# Weight scales (projection gains are relative to 1/sqrt(fan_in)), tuned with transformers:
# - logits have a std of ~3.5, so the top two rarely lie within float error of each other;
# - the per-token MLP dominates the residual, so the current token steers the next one
#   (with tied embeddings a weak MLP lets the input embedding win: "a a a a ...");
# - sharp, strong attention: changing any one prompt token changes the continuation,
#   which is what makes KV-cache and transfer bugs visible in outputs.
LOGIT_STD = 3.5
EMBED_STD = 1.0
Q_GAIN = 3.0
ATTN_OUT_GAIN = 2.0
MLP_OUT_GAIN = 8.0
NORM_NOISE = 0.1
BIAS_STD = 0.2


def make_model(
    out_dir: str | os.PathLike[str],
    *,
    arch: str = "llama",
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 4096,
    intermediate: int | None = None,
    head_dim: int | None = None,
    seed: int = 0,
    max_position: int = 4096,
) -> Path:
    """Write a complete HF model folder to `out_dir` (created if missing) and return it.

    `intermediate` defaults to 3 * hidden. `head_dim` defaults to hidden // heads, except
    for qwen3, whose default is twice that (as in Qwen3-0.6B), so that code assuming
    head_dim == hidden / heads is caught.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab)
    config = build_config(
        arch,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        vocab=vocab,
        intermediate=intermediate if intermediate is not None else 3 * hidden,
        head_dim=head_dim,
        max_position=max_position,
        bos_id=token_id(tokenizer, BOS),
        eos_id=token_id(tokenizer, EOS),
    )
    config.save_pretrained(out)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        # A chat turn ends with <|im_end|>; stop there as well as at end of text.
        eos_token_id=[config.eos_token_id, token_id(tokenizer, IM_END)],
        pad_token_id=config.eos_token_id,
    ).save_pretrained(out)
    # Written through Python (not save_file) so the file gets the usual umask permissions.
    (out / "model.safetensors").write_bytes(save(make_weights(config, seed), {"format": "pt"}))
    save_tokenizer(tokenizer, out, max_position)
    return out


def build_config(
    arch: str,
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    intermediate: int,
    head_dim: int | None,
    max_position: int,
    bos_id: int,
    eos_id: int,
) -> PretrainedConfig:
    if arch not in ARCHES:
        raise ValueError(f"arch must be one of {ARCHES}, got {arch!r}")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be a multiple of heads ({heads})")
        head_dim = hidden // heads * (2 if arch == "qwen3" else 1)
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position,
        rms_norm_eps=1e-6,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        dtype="float32",
    )
    if arch == "llama":
        # A small original context so that llama3 scaling really changes frequencies.
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        }
        return LlamaConfig(
            architectures=["LlamaForCausalLM"],
            rope_parameters=rope,
            tie_word_embeddings=False,
            attention_bias=False,
            mlp_bias=False,
            **common,
        )
    default_rope = {"rope_type": "default", "rope_theta": 1e6}
    if arch == "qwen2":  # q/k/v biases are built into Qwen2's attention
        return Qwen2Config(
            architectures=["Qwen2ForCausalLM"],
            rope_parameters=default_rope,
            tie_word_embeddings=True,
            **common,
        )
    if arch == "qwen3":
        return Qwen3Config(
            architectures=["Qwen3ForCausalLM"],
            rope_parameters=default_rope,
            tie_word_embeddings=True,
            attention_bias=False,
            **common,
        )
    return MistralConfig(
        architectures=["MistralForCausalLM"],
        rope_parameters=default_rope,
        tie_word_embeddings=False,
        sliding_window=None,
        **common,
    )


def weight_shapes(config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensors, in a fixed order: names and shapes as transformers expects."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        for name, dim in (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)):
            shapes[f"{p}self_attn.{name}.weight"] = (dim, hidden)
            if config.model_type == "qwen2":
                shapes[f"{p}self_attn.{name}.bias"] = (dim,)
        if config.model_type == "qwen3":
            shapes[p + "self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (config.head_dim,)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_dim)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def make_weights(config: PretrainedConfig, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic float32 weights: one generator seeded by `seed`, drawn in layout order."""
    gen = torch.Generator().manual_seed(seed)
    # Logits = norm(h) @ W_out.T, and norm(h) has unit rms: this std gives logits of LOGIT_STD.
    out_std = LOGIT_STD / math.sqrt(config.hidden_size)
    weights = {}
    for name, shape in weight_shapes(config).items():
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + NORM_NOISE * noise
        elif name.endswith(".bias"):
            weights[name] = BIAS_STD * noise
        elif name == "lm_head.weight" or (
            name == "model.embed_tokens.weight" and config.tie_word_embeddings
        ):
            weights[name] = out_std * noise
        elif name == "model.embed_tokens.weight":
            weights[name] = EMBED_STD * noise
        else:
            gain = {"q_proj": Q_GAIN, "o_proj": ATTN_OUT_GAIN, "down_proj": MLP_OUT_GAIN}.get(
                name.split(".")[-2], 1.0
            )
            weights[name] = gain / math.sqrt(shape[1]) * noise
    return weights


def default_model_path() -> Path:
    """The built-in tiny llama model, made on first use under the cache dir.

    Safe when several processes race: each builds into its own temp folder and renames it
    into place; rename is atomic, so a loser discards its copy and uses the winner's.
    """
    final = builtin_model_dir()
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.", dir=final.parent))
    try:
        make_model(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the model is not a secret
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="folder to write the model into")
    parser.add_argument("--arch", choices=ARCHES, default="llama")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=None, help="default: hidden / heads")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=None, help="default: 3 * hidden")
    parser.add_argument("--max-position", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    path = make_model(
        args.dir,
        arch=args.arch,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
        intermediate=args.intermediate,
        head_dim=args.head_dim,
        seed=args.seed,
        max_position=args.max_position,
    )
    print(path)
    return 0
