"""Physical floors of one engine step: the bytes a decode step must read and the FLOPs a
prefill must compute, from a Hugging Face `config.json` (as a dict).

A floor counts only the work the step cannot avoid:
  decode   every layer's weights, the final norm and the LM head, once; of the embedding
           table only the rows the batch gathers (one per request), or nothing when the
           LM head is the same table (tied: it is read whole anyway); and the KV the batch
           attends to (each request's whole context, this step's token included).
  prefill  the matmuls of every layer for every prompt token, the causal attention, and
           the LM head for the one row that is sampled.
With tensor parallelism the figures are one rank's: projections, LM head and KV heads are
split across ranks, norms are replicated, each rank gathers its embedding rows.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class _Dims(NamedTuple):
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int


def _dims(cfg: dict[str, Any]) -> _Dims:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    return _Dims(
        h,
        cfg["intermediate_size"],
        cfg["num_hidden_layers"],
        cfg["vocab_size"],
        heads,
        cfg.get("num_key_value_heads") or heads,
        cfg.get("head_dim") or h // heads,
    )


def _arch(cfg: dict[str, Any]) -> str:
    return (cfg.get("architectures") or ["?"])[0]


def projection_params(cfg: dict[str, Any]) -> int:
    """One decoder layer's projection weights (q, k, v, o, gate, up, down)."""
    h, i, _, _, heads, kv_heads, d = _dims(cfg)
    return h * (heads + 2 * kv_heads) * d + heads * d * h + 3 * h * i


def layer_split_params(cfg: dict[str, Any]) -> int:
    """One decoder layer's weights that tensor parallelism splits: the projections and the
    q/k/v biases (Qwen2, or `attention_bias`)."""
    dims = _dims(cfg)
    n = projection_params(cfg)
    if cfg.get("attention_bias") or _arch(cfg) == "Qwen2ForCausalLM":
        n += (dims.heads + 2 * dims.kv_heads) * dims.head_dim
    return n


def layer_replicated_params(cfg: dict[str, Any]) -> int:
    """One layer's weights every rank holds whole: its two RMSNorms and the q/k norms
    (Qwen3)."""
    h, d = cfg["hidden_size"], _dims(cfg).head_dim
    return 2 * h + (2 * d if _arch(cfg) == "Qwen3ForCausalLM" else 0)


def kv_bytes_per_token(cfg: dict[str, Any], dtype_bytes: int = 2, tp: int = 1) -> int:
    """Bytes of K and V one token holds in every layer (on one rank)."""
    _, _, layers, _, _, kv_heads, d = _dims(cfg)
    return 2 * layers * (kv_heads // tp) * d * dtype_bytes


def decode_read_bytes(
    cfg: dict[str, Any], batch: int, kv_tokens: int, dtype_bytes: int = 2, tp: int = 1
) -> int:
    """Bytes one decode step of `batch` requests must read on one rank. `kv_tokens`: the
    tokens the batch attends to, summed over its requests (the sum of their sequence
    lengths after the step)."""
    h, _, layers, v, _, _, _ = _dims(cfg)
    weights = layers * (layer_split_params(cfg) // tp + layer_replicated_params(cfg)) + h
    weights += -(-v // tp) * h  # the LM head (the vocabulary split over ranks, padded)
    if not cfg.get("tie_word_embeddings", False):
        weights += batch * h  # the gathered embedding rows, not the table
    return weights * dtype_bytes + kv_tokens * kv_bytes_per_token(cfg, dtype_bytes, tp)


def prefill_flops(cfg: dict[str, Any], length: int) -> float:
    """FLOPs of one prompt of `length` tokens, from nothing in cache, first token sampled."""
    h, _, layers, v, heads, _, d = _dims(cfg)
    matmuls = 2 * layers * projection_params(cfg) * length
    attention = 2 * 2 * layers * heads * d * length * length / 2  # QK^T and PV, causal half
    return matmuls + attention + 2 * v * h  # the LM head for the sampled row only
