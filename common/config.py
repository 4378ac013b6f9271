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
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from baton.common.options import ConfigError, option, pool_size, token_budget

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

DTYPES = ("float32", "bfloat16", "float16")  # names of torch dtypes
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


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
        eos_ids = eos_token_ids(path, cfg)
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


def eos_token_ids(
    path: str | os.PathLike[str], config: dict[str, Any] | None = None
) -> tuple[int, ...]:
    """The tokens that end a generation of the model in folder `path`: generation_config's
    `eos_token_id`, else config.json's. The one definition the engine (stops unless
    `ignore_eos`) and the router's tokenizer (sends them as stop tokens) share."""
    path = Path(path)
    if config is None:
        config_file = path / "config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    eos = config.get("eos_token_id")
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        eos = json.loads(gen_file.read_text()).get("eos_token_id", eos)
    if eos is None:
        return ()
    return tuple(int(i) for i in eos) if isinstance(eos, list) else (int(eos),)


Policy = Literal["fcfs", "lpm"]
Role = Literal["both", "prefill", "decode"]


def attention_backend_names() -> list[str]:
    """The attention backend registry's names (imported only when asked)."""
    from baton.common.attention import available_backends

    return available_backends()


@dataclass(frozen=True)
class EngineConfig:
    """Every engine option. `Engine(path, **options)` and the worker CLI both build one."""

    model_path: str = option(
        help="Hugging Face model folder (default: the built-in tiny model)",
        group="model",
        flag="--model",
    )
    dtype: str = option("float32", "weights and KV cache dtype", group="model", choices=DTYPES)
    device: str = option("cpu", "cpu, cuda or cuda:N", group="model")
    load_format: Literal["safetensors", "dummy"] = option(
        "safetensors", "dummy: random weights, for benchmarks", group="model"
    )
    seed: int = option(0, "random seed of sampling", group="model")
    page_size: int = option(1, "tokens per KV page", group="memory")
    max_total_tokens: int | None = option(
        None,
        "KV pool capacity in tokens; auto: on a GPU, what --gpu-memory-fraction leaves after "
        "the weights and activations, elsewhere 32768",
        group="memory",
        parse=pool_size,
    )
    gpu_memory_fraction: float = option(
        0.88,
        "share of the GPU's memory this worker may use (weights, KV pool, activations) when "
        "--max-total-tokens is auto; baton up divides it among workers that share a GPU",
        group="memory",
    )
    max_running_requests: int = option(64, "requests decoded at once", group="memory")
    disable_radix_cache: bool = option(False, "no prefix reuse across requests", group="memory")
    host_kv_tokens: int = option(
        0,
        "host-memory tier of the prefix cache, in tokens: pages the device pool evicts go "
        "there (pinned on CUDA) and a prefix found there is loaded back (0: off; a decode "
        "worker has one only with --decode-radix-cache)",
        group="memory",
    )
    host_kv_write: str = option(
        "on-evict",
        "when a page is copied to the host tier: as it leaves the device (on-evict), or soon "
        "after it enters the cache (through: its later eviction copies nothing)",
        group="memory",
        choices=("on-evict", "through"),
    )
    chunked_prefill_size: int | None = option(
        None,
        "per-step prefill token budget (none = no chunking)",
        group="scheduling",
        parse=token_budget,
    )
    max_prefill_tokens: int = option(
        16384, "per-step prefill token budget when chunking is off", group="scheduling"
    )
    enable_mixed_chunk: bool = option(
        False, "run prefill chunks and decodes in one batch", group="scheduling"
    )
    disable_overlap: bool = option(
        False, "process a step's results before scheduling the next", group="scheduling"
    )
    overlap_max_step_tokens: int = option(
        0,
        "a step of more tokens (a long prompt chunk) is processed before the next is "
        "scheduled: a request that comes during it can join the next step, not the one "
        "after (costs the GPU the next step's preparation; 0: always overlap)",
        group="scheduling",
    )
    schedule_policy: Policy = option(
        "fcfs", "prefill order: first come, or longest prefix match", group="scheduling"
    )
    decode_reserve_tokens: int = option(
        64, "tokens per running request held back from admission", group="scheduling"
    )
    tpot_slo: float = option(
        0.02,
        "seconds a decode step may take while a decode worker computes a prompt itself "
        "(the router's local placement): its prompt tokens per step are bounded by its "
        "measured step times",
        group="scheduling",
    )
    attention_backend: str = option(
        "torch", "attention kernels", group="attention", choices=attention_backend_names
    )
    prefill_attention_backend: str | None = option(
        None,
        "attention kernels of prefill (default: --attention-backend)",
        group="attention",
        choices=attention_backend_names,
    )
    decode_attention_backend: str | None = option(
        None,
        "attention kernels of decode (default: --attention-backend; with flashinfer, baton's "
        "triton kernel, which was faster)",
        group="attention",
        choices=attention_backend_names,
    )
    disable_cuda_graph: bool = option(
        False,
        "no CUDA graphs (they are used on CUDA with a backend that has them)",
        group="attention",
    )
    cuda_graph_max_bs: int = option(
        512,
        "largest decode batch captured in a CUDA graph (no larger than "
        "--max-running-requests: every batch a worker runs replays a graph)",
        group="attention",
    )
    prefill_graph_max_tokens: int = option(
        2048,
        "longest prompt whose step (one prompt, no cached prefix) replays a CUDA graph "
        "(they hold about one such forward's activations); 0: none",
        group="attention",
    )
    piecewise_graph_max_tokens: int = option(
        1024,
        "largest other step with prompt rows (a prompt chunk, several prompts, a mixed step "
        "of prompt and decode rows) that replays CUDA graphs between its layers' attentions, "
        "the attentions launched between them; 0: none",
        group="attention",
    )
    tp_size: int = option(
        1, "tensor-parallel size (GPUs per worker)", group="parallelism", flag="--tp"
    )
    role: Role = option("both", "the worker's role (from its command)", flag="")

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ConfigError(self, "page_size", "must be >= 1")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ConfigError(self, "max_total_tokens", "must hold at least one page")
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ConfigError(self, "gpu_memory_fraction", "must be in (0, 1]")
        if self.dtype not in DTYPES:
            raise ConfigError(self, "dtype", f"must be one of {list(DTYPES)}")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 1:
            raise ConfigError(self, "chunked_prefill_size", "must be >= 1")
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ConfigError(self, "schedule_policy", "must be fcfs or lpm")
        for name in ("max_running_requests", "max_prefill_tokens", "cuda_graph_max_bs", "tp_size"):
            if getattr(self, name) < 1:
                raise ConfigError(self, name, "must be >= 1")
        if self.prefill_graph_max_tokens < 0:
            raise ConfigError(self, "prefill_graph_max_tokens", "must be >= 0")
        if self.piecewise_graph_max_tokens < 0:
            raise ConfigError(self, "piecewise_graph_max_tokens", "must be >= 0")
        if self.host_kv_tokens < 0:
            raise ConfigError(self, "host_kv_tokens", "must be >= 0")
        if self.host_kv_tokens and self.host_kv_tokens < self.page_size:
            raise ConfigError(self, "host_kv_tokens", "must hold at least one page")
        if self.host_kv_write not in ("on-evict", "through"):
            raise ConfigError(self, "host_kv_write", "must be on-evict or through")
        if self.host_kv_tokens and self.disable_radix_cache:
            raise ConfigError(
                self,
                "host_kv_tokens",
                "needs the radix cache (a decode worker's: --decode-radix-cache)",
            )
        if self.host_kv_tokens and self.tp_size > 1:
            raise ConfigError(self, "host_kv_tokens", "not yet with tensor parallelism")
        if self.decode_reserve_tokens < 0:
            raise ConfigError(self, "decode_reserve_tokens", "must be >= 0")
        if self.overlap_max_step_tokens < 0:
            raise ConfigError(self, "overlap_max_step_tokens", "must be >= 0")
        if not self.tpot_slo > 0:
            raise ConfigError(self, "tpot_slo", "must be > 0")
        if not _DEVICE.fullmatch(self.device):
            raise ConfigError(self, "device", "must be cpu, cuda or cuda:N")
        names = attention_backend_names()
        for name in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
            if getattr(self, name) not in (*names, None):
                raise ConfigError(self, name, f"must be one of {names}")

    @property
    def num_pages(self) -> int:
        """Pages of the pool; only once its size is known (the model runner resolves
        `auto` into the config it serves with)."""
        if self.max_total_tokens is None:
            raise ValueError("the KV pool's size is resolved by the model runner (auto)")
        return self.max_total_tokens // self.page_size

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def overlap(self) -> bool:
        return not self.disable_overlap

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}


def transfer_backend_names() -> tuple[str, ...]:
    """The transfer backend registry's names (imported only when asked)."""
    from baton.common.transfer.registry import backend_names

    return tuple(backend_names())


@dataclass(frozen=True)
class TransferConfig:
    """How a prefill or decode worker moves KV pages: its KV-control socket and its data
    plane. The worker fills `host`, `advertise_host` and `cluster_token` from its own."""

    backend: str = option(
        "auto",
        "data-plane backend that moves KV pages (auto: the best both sides share, per peer)",
        group="disaggregation",
        flag="--transfer-backend",
        choices=transfer_backend_names,
    )
    host: str = option("127.0.0.1", "address the KV-control socket and data listener bind", flag="")
    advertise_host: str | None = option(
        None, "address peers use to reach this worker (None: host)", flag=""
    )
    kv_control_port: int = option(
        0, "KV-control (ZMQ) port; 0 = any free port", group="disaggregation"
    )
    cluster_token: str | None = option(
        None,
        "shared secret: control messages and data connections without it are dropped",
        flag="",
        repr=False,
    )
    verify_checksum: bool = option(
        False,
        "debug: checksum every transferred run of pages and verify it on receipt",
        group="disaggregation",
        flag="--kv-verify-checksum",
    )
    room_timeout: float = option(
        30.0,
        "seconds a room (one handoff) may stay in one state without its peer confirming "
        "that it still holds the room",
        group="disaggregation",
    )
    fault: str | None = option(
        None,
        "fault plan of the `fake` backend, e.g. 'fail:every=3; delay:ms=50' (for tests)",
        group="disaggregation",
        flag="--transfer-fault",
    )

    def __post_init__(self) -> None:
        if self.backend not in transfer_backend_names():
            raise ConfigError(self, "backend", f"must be one of {list(transfer_backend_names())}")
        if not self.room_timeout > 0:
            raise ConfigError(self, "room_timeout", "must be > 0")
        if not 0 <= self.kv_control_port < 65536:
            raise ConfigError(self, "kv_control_port", "must be in [0, 65536)")
        if self.fault and self.backend != "fake":
            raise ConfigError(self, "fault", "is a plan of the fake backend only")
