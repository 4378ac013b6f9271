"""What the benchmark sends: prompts and output lengths, built or read before the run.

Synthetic prompts are random common English words. With the served model's tokenizer
(`TokenText`: `--tokenizer`, else the model folder the server names in /v1/models),
lengths are exact token counts, as in vLLM's and SGLang's benchmarks: the words are
encoded, cut to N tokens and decoded. Without one, a prompt of N words stands in for N
tokens (each such word is one token for most byte-pair tokenizers). The server's own
count comes back in `usage.prompt_tokens` and is what the results report.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from baton.benchmarks.config import BenchConfig

_WORD_TEXT = """
    the of and to in is you that it he was for on are as with his they at be this have
    from or one had by word but not what all were we when your can said there use an
    each which she do how their if will up other about out many then them these so some
    her would make like him into time has look two more write go see number no way could
    people my than first water been call who oil its now find long down day did get come
    made may part over new sound take only little work know place year live me back give
    most very after thing our just name good sentence man think say great where help
    through much before line right too mean old any same tell boy follow came want show
    also around form three small set put end does another well large must big even such
    because turn here why ask went men read need land different home us move try kind
    hand picture again change off play spell air away animal house point page letter
    mother answer found study still learn should world high every near add food between
    own below country plant last school father keep tree never start city earth eye light
    thought head under story saw left few while along might close something seem next
    hard open example begin life always those both paper together got group often run
"""
WORDS = tuple(_WORD_TEXT.split())

# ShareGPT speaker tags.
_HUMAN = ("human", "user")
_ASSISTANT = ("gpt", "assistant", "chatgpt", "bard", "model")


class BuiltPrompt(Protocol):
    """A prompt too large to hold for a whole run (a trace's), built when it is sent."""

    def token_ids(self) -> list[int] | None: ...  # None: send `text()`
    def text(self) -> str: ...


@dataclass(frozen=True)
class BenchRequest:
    """One request's content; the endpoint decides how it is put on the wire."""

    prompt: str | BuiltPrompt
    max_tokens: int
    system: str | None = None  # shared-prefix: the shared system prompt
    ignore_eos: bool = False  # synthetic workloads want exactly max_tokens tokens
    input_len: int | None = None  # prompt length in tokens, when known (approximate)


@dataclass(frozen=True)
class TraceEntry:
    timestamp: float
    request: BenchRequest


def random_text(rng: np.random.Generator, num_words: int) -> str:
    picks = rng.integers(0, len(WORDS), size=num_words)
    return " ".join(WORDS[i] for i in picks)


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class TokenText:
    """Random texts of an exact length in one tokenizer's tokens."""

    def __init__(self, tokenizer: Tokenizer, name: str) -> None:
        self.tokenizer = tokenizer
        self.name = name  # where it came from, for the results

    def __call__(self, rng: np.random.Generator, num_tokens: int) -> str:
        ids: list[int] = []
        while len(ids) < num_tokens:
            more = random_text(rng, num_tokens - len(ids) + 1)
            ids += self.tokenizer.encode(" " + more, add_special_tokens=False)
        return self.tokenizer.decode(ids[:num_tokens])


TextMaker = Callable[[np.random.Generator, int], str]


def ranged_lengths(rng: np.random.Generator, length: int, ratio: float, count: int) -> list[int]:
    """`count` integers drawn uniformly from [length*(1-ratio), length*(1+ratio)], each >= 1."""
    if ratio == 0:
        return [length] * count
    low = max(1, round(length * (1 - ratio)))
    high = max(low, round(length * (1 + ratio)))
    return [int(n) for n in rng.integers(low, high + 1, size=count)]


def random_requests(
    config: BenchConfig, count: int, rng: np.random.Generator, text: TextMaker = random_text
) -> list[BenchRequest]:
    inputs = ranged_lengths(rng, config.input_len, config.range_ratio, count)
    outputs = ranged_lengths(rng, config.output_len, config.range_ratio, count)
    return [
        BenchRequest(text(rng, n_in), n_out, ignore_eos=True, input_len=n_in)
        for n_in, n_out in zip(inputs, outputs, strict=True)
    ]


def shared_prefix_requests(
    config: BenchConfig, count: int, rng: np.random.Generator, text: TextMaker = random_text
) -> list[BenchRequest]:
    """Groups of requests whose system prompt (`prefix_len` tokens) is the same."""
    prefixes = [text(rng, config.prefix_len) for _ in range(config.num_groups)]
    groups = rng.integers(0, config.num_groups, size=count)
    inputs = ranged_lengths(rng, config.input_len, config.range_ratio, count)
    outputs = ranged_lengths(rng, config.output_len, config.range_ratio, count)
    return [
        BenchRequest(
            text(rng, n_in),
            n_out,
            system=prefixes[group],
            ignore_eos=True,
            input_len=config.prefix_len + n_in,
        )
        for group, n_in, n_out in zip(groups, inputs, outputs, strict=True)
    ]


def read_records(path: str | Path) -> list[dict[str, object]]:
    """JSON objects of a .jsonl file (blank lines skipped), or of a file holding one array."""
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        loaded = json.loads(text)
        records = loaded if isinstance(loaded, list) else []
    else:
        records = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not JSON: {e}") from e
    return [r for r in records if isinstance(r, dict)]


def request_from_record(record: dict[str, object], default_output_len: int) -> BenchRequest | None:
    """A jsonl line as a request: {"prompt", "max_tokens"} or a ShareGPT conversation.

    ShareGPT: the first human turn is the prompt; the answer that follows it, counted in
    words, approximates the output length. None for a record with no usable prompt.
    """
    prompt = record.get("prompt")
    if isinstance(prompt, str) and prompt:
        max_tokens = record.get("max_tokens", record.get("output_len", default_output_len))
        return BenchRequest(prompt, _positive_int(max_tokens, default_output_len))
    turns = record.get("conversations")
    if not isinstance(turns, list):
        return None
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get("from") not in _HUMAN:
            continue
        text = turn.get("value")
        if not isinstance(text, str) or not text:
            return None
        answer = turns[i + 1] if i + 1 < len(turns) else None
        output_len = default_output_len
        if isinstance(answer, dict) and answer.get("from") in _ASSISTANT:
            output_len = max(1, len(str(answer.get("value", "")).split()))
        return BenchRequest(text, output_len)
    return None


def jsonl_requests(config: BenchConfig, count: int, rng: np.random.Generator) -> list[BenchRequest]:
    """`count` requests drawn from the file in a seeded random order, cycling if needed."""
    assert config.dataset_path is not None
    pool = [
        request
        for record in read_records(config.dataset_path)
        if (request := request_from_record(record, config.output_len)) is not None
    ]
    if not pool:
        raise ValueError(f"{config.dataset_path}: no usable prompts")
    if config.ignore_eos:
        pool = [dataclasses.replace(request, ignore_eos=True) for request in pool]
    order = rng.permutation(len(pool))
    return [pool[order[i % len(pool)]] for i in range(count)]


def trace_entries(
    config: BenchConfig, rng: np.random.Generator, text: TextMaker = random_text
) -> list[TraceEntry]:
    """A recorded trace, by timestamp: {"timestamp", "prompt" | "input_len", "output_len"}."""
    assert config.dataset_path is not None
    entries = []
    for number, record in enumerate(read_records(config.dataset_path), start=1):
        timestamp = record.get("timestamp")
        if not isinstance(timestamp, int | float):
            raise ValueError(f"{config.dataset_path}: record {number} has no numeric timestamp")
        output_len = _positive_int(record.get("output_len"), config.output_len)
        prompt = record.get("prompt")
        if isinstance(prompt, str) and prompt:
            request = BenchRequest(prompt, output_len, ignore_eos=True)
        else:
            input_len = _positive_int(record.get("input_len"), config.input_len)
            request = BenchRequest(
                text(rng, input_len), output_len, ignore_eos=True, input_len=input_len
            )
        entries.append(TraceEntry(float(timestamp), request))
    entries.sort(key=lambda e: e.timestamp)
    return entries


def synthetic_requests(
    config: BenchConfig, count: int, rng: np.random.Generator, text: TextMaker = random_text
) -> list[BenchRequest]:
    """`count` requests for the rate-driven datasets (everything but `trace`)."""
    if config.dataset == "random":
        return random_requests(config, count, rng, text)
    if config.dataset == "shared-prefix":
        return shared_prefix_requests(config, count, rng, text)
    if config.dataset == "jsonl":
        return jsonl_requests(config, count, rng)
    raise ValueError(f"dataset {config.dataset!r} is not rate-driven")


def _positive_int(value: object, default: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default
    return max(1, int(value))


def phased_requests(
    config: BenchConfig,
    phase_of: list[int],
    rng: np.random.Generator,
    text: TextMaker = random_text,
) -> list[BenchRequest]:
    """Random requests of `--phases`: request i has the lengths of phase `phase_of[i]`."""
    out: list[BenchRequest] = []
    for index, phase in enumerate(config.phases):
        count = phase_of.count(index)
        lengths = dataclasses.replace(
            config, input_len=phase.input_len, output_len=phase.output_len
        )
        out += random_requests(lengths, count, rng, text)
    return out
