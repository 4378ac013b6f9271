"""Typed configuration, resolved once at start-up.

Hot paths read fields of these frozen dataclasses, never flags or the environment.
`ModelConfig` is read from a Hugging Face `config.json`; `EngineConfig` holds every
engine option with its default (the CLI takes its defaults from here); `TransferConfig`
says how a prefill or decode worker moves KV pages.

torch is imported only where a torch dtype is asked for, so the command line can build and
validate these without it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from baton.common.options import option

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

DTYPES = ("float32", "bfloat16", "float16")  # names of torch dtypes


@dataclass(frozen=True)
class ModelConfig:
    path: str
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    torch_dtype: str

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{cfg_file} not found: not a Hugging Face model folder")
        cfg = json.loads(cfg_file.read_text())
        arch = (cfg.get("architectures") or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {arch!r} is not supported (supported: {SUPPORTED_ARCHITECTURES})"
            )
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            eos = json.loads(gen_file.read_text()).get("eos_token_id", eos)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        rope_theta = cfg.get("rope_theta")
        rope_scaling = cfg.get("rope_scaling")
        rope_params = cfg.get("rope_parameters")  # transformers >= 5 writes this form
        if isinstance(rope_params, dict):
            rope_theta = rope_theta or rope_params.get("rope_theta")
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_scaling or rope_params
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) in (
            None,
            "default",
        ):
            rope_scaling = None
        return cls(
            path=str(path),
            architecture=arch,
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)) or is_qwen2,
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=eos_ids,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        )

    @property
    def context_len(self) -> int:
        return self.max_position_embeddings


Policy = Literal["fcfs", "lpm"]
Role = Literal["both", "prefill", "decode"]


@dataclass(frozen=True)
class EngineConfig:
    """Every engine option. `Engine(path, **options)` and the worker CLI both build one."""

    model_path: str
    dtype: str = "float32"
    device: str = "cpu"
    load_format: Literal["safetensors", "dummy"] = "safetensors"
    seed: int = 0
    # memory
    page_size: int = 1
    max_total_tokens: int = 32768  # KV pool capacity in tokens
    max_running_requests: int = 64
    disable_radix_cache: bool = False
    # scheduling
    chunked_prefill_size: int | None = None  # per-step prefill token budget; None = no chunking
    max_prefill_tokens: int = 16384  # per-step budget when chunking is off
    enable_mixed_chunk: bool = False
    disable_overlap: bool = False
    schedule_policy: Policy = "fcfs"
    decode_reserve_tokens: int = 64  # per running request, held back from admission
    # attention
    attention_backend: str = "torch"
    prefill_attention_backend: str | None = None
    decode_attention_backend: str | None = None
    disable_cuda_graph: bool = False  # graphs are used on CUDA with a backend that has them
    cuda_graph_max_bs: int = 128
    # parallelism and role
    tp_size: int = 1
    role: Role = "both"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1 (got {self.page_size})")
        if self.max_total_tokens < self.page_size:
            raise ValueError("max_total_tokens must hold at least one page")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)} (got {self.dtype!r})")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 1:
            raise ValueError("chunked_prefill_size must be >= 1")
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError(f"schedule_policy must be fcfs or lpm (got {self.schedule_policy!r})")

    @property
    def num_pages(self) -> int:
        return self.max_total_tokens // self.page_size

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)  # type: ignore[no-any-return]

    @property
    def overlap(self) -> bool:
        return not self.disable_overlap

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}


def transfer_backend_names() -> tuple[str, ...]:
    """The transfer backend registry's names (imported only when asked)."""
    from baton.common.transfer.backend import backend_names

    return tuple(backend_names())


@dataclass(frozen=True)
class TransferConfig:
    """How a prefill or decode worker moves KV pages: its KV-control socket and its data
    plane. The worker fills `host`, `advertise_host` and `cluster_token` from its own."""

    backend: str = option(
        "auto",
        "data-plane backend that moves KV pages (auto: the best both sides share, per peer)",
        flag="--transfer-backend",
        choices=transfer_backend_names,
    )
    host: str = option("127.0.0.1", "address the KV-control socket and data listener bind", flag="")
    advertise_host: str | None = option(
        None, "address peers use to reach this worker (None: host)", flag=""
    )
    kv_control_port: int = option(0, "KV-control (ZMQ) port; 0 = any free port")
    cluster_token: str | None = option(
        None,
        "shared secret: control messages and data connections without it are dropped",
        flag="",
        repr=False,
    )
    verify_checksum: bool = option(
        False,
        "debug: checksum every transferred run of pages and verify it on receipt",
        flag="--kv-verify-checksum",
    )
    room_timeout: float = option(
        30.0,
        "seconds a room (one handoff) may stay in one state without its peer confirming "
        "that it still holds the room",
    )
    fault: str | None = option(
        None,
        "fault plan of the `fake` backend, e.g. 'fail:every=3; delay:ms=50' (for tests)",
        flag="--transfer-fault",
    )

    def __post_init__(self) -> None:
        if not self.room_timeout > 0:
            raise ValueError(f"room_timeout must be > 0 (got {self.room_timeout})")
        if not 0 <= self.kv_control_port < 65536:
            raise ValueError(f"kv_control_port must be in [0, 65536) (got {self.kv_control_port})")
        if self.fault and self.backend != "fake":
            raise ValueError(
                f"a transfer fault plan needs the fake backend (got backend {self.backend!r})"
            )
