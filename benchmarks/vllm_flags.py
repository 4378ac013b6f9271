"""`vllm bench serve`'s spellings of `bench serve`'s flags: its command lines run unchanged.

A vLLM flag here is one of three things:

- an alias of one of our flags with the same meaning (`--random-input-len` is
  `--input-len`), parsed into the same config field;
- a translation, applied once when the config is built (`--backend` picks the API,
  `--host`/`--port` make the base URL, `--goodput` is `--slo`, `--dataset-name sharegpt`
  reads the file as our `jsonl` does, `--random-prefix-len` shares a prefix);
- refused, with the reason. A flag that is parsed and then ignored would make a run
  measure something other than what its command line says.

Flags vLLM and we spell alike (`--model`, `--endpoint`, `--seed`, `--request-rate`,
`--max-concurrency`, `--save-result`, `--percentile-metrics`, `--ignore-eos`, ...) are
the config's own. Differences stay: without `--num-prompts`, we send 100 requests (vLLM
1,000); without `--temperature` we send none (the server's default; recent vLLMs send 0).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from baton.benchmarks.config import DATASETS, BenchConfig, BenchConfigError
from baton.benchmarks.flags import SLO_METRICS, Limits

GROUP = "vLLM's spellings (vllm bench serve)"

# vLLM flag -> (our config field, how its value is read)
ALIASES: dict[str, tuple[str, Callable[[str], Any]]] = {
    "--num-prompts": ("num_requests", int),
    "--random-input-len": ("input_len", int),
    "--random-output-len": ("output_len", int),
    "--random-range-ratio": ("range_ratio", float),
    "--prefix-repetition-prefix-len": ("prefix_len", int),
    "--prefix-repetition-suffix-len": ("input_len", int),
    "--prefix-repetition-num-prefixes": ("num_groups", int),
    "--prefix-repetition-output-len": ("output_len", int),
}

# vLLM's dataset names -> ours. sharegpt and custom files are what `jsonl` reads
# (ShareGPT conversations, {"prompt", "output_tokens"|"max_tokens"} lines).
DATASET_NAMES = {
    **{name: name for name in DATASETS},
    "sharegpt": "jsonl",
    "custom": "jsonl",
    "prefix_repetition": "shared-prefix",
}

BACKENDS = {"vllm": "completions", "openai": "completions", "openai-chat": "chat"}

REFUSED: dict[str, str] = {
    "--profile": "baton serves no profiler endpoints",
    "--use-beam-search": "baton does not do beam search",
    "--logprobs": "the benchmark does not read logprobs",
    "--lora-modules": "baton serves no LoRA adapters",
    "--ramp-up-strategy": "arrivals are Poisson/gamma at one --request-rate, or a trace's",
    "--ramp-up-start-rps": "arrivals are Poisson/gamma at one --request-rate, or a trace's",
    "--ramp-up-end-rps": "arrivals are Poisson/gamma at one --request-rate, or a trace's",
    "--append-result": "each run writes its own file (--result-filename)",
    "--header": "only --api-key is sent as a header",
    "--request-id-prefix": "requests carry no id header",
    "--sharegpt-output-len": "ShareGPT output lengths come from the conversation's answer",
    "--custom-output-len": "a custom line's output length comes from its max_tokens",
    "--no-oversample": "a file with fewer prompts than asked is cycled through",
    "--disable-shuffle": "a file's prompts are drawn in a seeded random order",
    "--skip-chat-template": "the chat API applies the server's template",
    "--no-stream": "files are read whole; Hugging Face datasets are not loaded",
    "--extra-body": "only the sampling flags are added to the request body",
    "--ready-check-timeout-sec": "use --wait-for-workers",
    "--burstgpt-output-len": "burstgpt is not a dataset here",
}


def add_aliases(parser: argparse.ArgumentParser, fields: Sequence[str]) -> None:
    """vLLM's names of the flags `parser` has for `fields` (pd-sweep has fewer)."""
    group = _group(parser)
    for flag, (field, parse) in ALIASES.items():
        if field in fields:
            group.add_argument(
                flag,
                dest=field,
                type=parse,
                default=argparse.SUPPRESS,
                help=f"= --{field.replace('_', '-')}",
            )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every vLLM flag `bench serve` takes beyond its own, and those it refuses."""
    add_aliases(parser, list(BenchConfig.__dataclass_fields__))
    group = _group(parser)

    def vllm(flag: str, help: str, **kwargs: Any) -> None:
        name = flag[2:].replace("-", "_")
        if kwargs.get("action") is None:
            kwargs["metavar"] = name.upper()
        group.add_argument(flag, dest="vllm_" + name, default=None, help=help, **kwargs)

    vllm("--dataset-name", "= --dataset; also sharegpt, custom (jsonl), prefix_repetition")
    vllm("--backend", "vllm, openai: the completions API; openai-chat: chat")
    vllm("--host", "with --port, the server when --base-url is not given")
    vllm("--port", "with --host", type=int)
    vllm("--goodput", "SLO as KEY:MS pairs (ttft, tpot, e2el) = --slo", nargs="+")
    vllm("--served-model-name", "the model name sent; --model then names the tokenizer")
    vllm("--random-prefix-len", "random: tokens of one prefix every prompt shares", type=int)
    vllm("--disable-tqdm", "= --no-progress", action="store_true")
    vllm("--tokenizer-mode", "auto only (the tokenizer's own)", choices=("auto",))
    vllm("--metadata", "KEY=VALUE pairs written into the result JSON", nargs="+")
    for flag, why in REFUSED.items():
        group.add_argument(flag, nargs="?", action=_Refused, help=argparse.SUPPRESS, why=why)


def apply(args: argparse.Namespace, values: dict[str, Any]) -> dict[str, Any]:
    """`values` (BenchConfig fields by name, from the flags) with the vLLM flags of `args`
    translated into them. Raises BenchConfigError for flags that contradict each other."""
    out = dict(values)
    given = {k[5:]: v for k, v in vars(args).items() if k.startswith("vllm_") and v is not None}
    default = BenchConfig()
    if "dataset_name" in given:
        name = given["dataset_name"]
        if name not in DATASET_NAMES:
            raise BenchConfigError(
                f"--dataset-name {name}: vLLM's dataset {name!r} is not one bench serve "
                f"builds; use one of {sorted(DATASET_NAMES)}"
            )
        out["dataset"] = DATASET_NAMES[name]
    if given.get("random_prefix_len"):
        if out.get("dataset", default.dataset) != "random":
            raise BenchConfigError("--random-prefix-len is for --dataset-name random")
        # One prefix shared by every prompt: the shared-prefix dataset with one group.
        out.update(dataset="shared-prefix", num_groups=1, prefix_len=given["random_prefix_len"])
    if "backend" in given:
        out["endpoint"] = _endpoint_of(given["backend"], out.get("endpoint", default.endpoint))
    base_url_given = out.get("base_url", default.base_url) != default.base_url
    if ("host" in given or "port" in given) and not base_url_given:  # --base-url wins
        host, port = given.get("host", "127.0.0.1"), given.get("port", 8000)
        out["base_url"] = f"http://{host}:{port}"
    if "goodput" in given:
        out["slo"] = goodput(given["goodput"])
    if "served_model_name" in given:
        if out.get("model") is not None and out.get("tokenizer") is None:
            out["tokenizer"] = out["model"]  # vLLM's --model names the tokenizer then
        out["model"] = given["served_model_name"]
    if given.get("disable_tqdm"):
        out["progress"] = False
    return out


def metadata(args: argparse.Namespace) -> dict[str, str]:
    """`--metadata version=0.3 tp=1` as the keys it adds to the result JSON."""
    pairs = _words(getattr(args, "vllm_metadata", None))
    bad = [p for p in pairs if "=" not in p or not p.partition("=")[0]]
    if bad:
        raise BenchConfigError(f"--metadata {bad[0]!r}: expected KEY=VALUE")
    return dict(p.partition("=")[::2] for p in pairs)


def goodput(pairs: Sequence[str] | str) -> Limits:
    """vLLM's `--goodput ttft:500 tpot:50 e2el:2000` (ms) as SLO limits in seconds."""
    limits = Limits()
    for pair in _words(pairs):
        name, _, number = pair.partition(":")
        name = "e2e" if name.strip() == "e2el" else name.strip()
        try:
            value = float(number)
        except ValueError:
            value = -1.0
        if name not in SLO_METRICS or not value > 0:
            raise BenchConfigError(
                f"--goodput {pair!r}: expected KEY:MILLISECONDS with KEY one of "
                f"ttft, tpot, e2el, e.g. ttft:500"
            )
        limits[name] = value / 1000.0
    return limits


def _endpoint_of(backend: str, endpoint: str) -> str:
    if backend not in BACKENDS:
        raise BenchConfigError(
            f"--backend {backend}: bench serve talks to OpenAI-compatible servers only "
            f"({', '.join(BACKENDS)})"
        )
    wanted = BACKENDS[backend]
    # An --endpoint left at its default (completions) follows the backend; vLLM's own
    # command lines name the chat path with openai-chat anyway.
    if endpoint not in ("completions", wanted):
        raise BenchConfigError(f"--backend {backend} calls the {wanted} API, not {endpoint}")
    return wanted


def _words(value: Sequence[str] | str | None) -> list[str]:
    """A list flag's values; from the environment (BATON_VLLM_GOODPUT) they are one string."""
    if value is None:
        return []
    return value.split() if isinstance(value, str) else list(value)


class _Refused(argparse.Action):
    def __init__(self, *args: Any, why: str, **kwargs: Any) -> None:
        self.why = why
        super().__init__(*args, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        parser.error(f"vLLM's {self.option_strings[0]} is not supported here: {self.why}")


def _group(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    for group in parser._action_groups:
        if group.title == GROUP:
            return group
    return parser.add_argument_group(GROUP)
