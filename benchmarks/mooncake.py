"""The Mooncake FAST'25 trace format, replayed so that its prefix sharing is real.

One JSON object a line: `timestamp` (ms from the trace's start), `input_length`,
`output_length` and `hash_ids`, the prompt as a list of 512-token blocks where equal ids
are equal blocks (the last block may be partial: `input_length` decides). The trace
carries no text, so each block is made up here, the same every time for the same id:

    block h, token k < 512  --hash(seed, h, k)-->  a word of the vocabulary  -->  its token id

The vocabulary is the common words that the served model's tokenizer encodes as one
token each (with a leading space), so a block is exactly 512 tokens and the text of a
prompt re-tokenizes into the very ids of its blocks: block boundaries survive on the
completions API (ids are sent) and the chat API (text is sent) alike. Without a tokenizer
the words stand in for tokens, as the other synthetic datasets do.

A whole trace's prompts do not fit in memory (12,031 requests of 12k tokens), so a
request holds its block ids and builds its tokens only when it is sent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from baton.benchmarks.config import BenchConfig
from baton.benchmarks.datasets import WORDS, BenchRequest, Tokenizer, TraceEntry

BLOCK_TOKENS = 512
# A vocabulary this small would make unrelated blocks share their first tokens.
MIN_VOCABULARY = 16


class TraceFormatError(ValueError):
    """A trace line that does not describe a request; says which line and why."""


class _Line(msgspec.Struct, forbid_unknown_fields=False):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


@dataclass(frozen=True)
class MooncakeRequest:
    """One line of the trace, checked."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: str | Path) -> list[MooncakeRequest]:
    """Every request of the trace in arrival order; a malformed line raises
    `TraceFormatError` naming its line number (blank lines are skipped)."""
    decoder = msgspec.json.Decoder(_Line)
    requests = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                requests.append(_checked(decoder.decode(line)))
            except (msgspec.DecodeError, ValueError) as e:
                raise TraceFormatError(f"{path}:{number}: {e}") from e
    if not requests:
        raise TraceFormatError(f"{path}: no requests")
    # Stable: requests recorded in the same millisecond keep the trace's order.
    return sorted(requests, key=lambda r: r.timestamp_ms)


def _checked(line: _Line) -> MooncakeRequest:
    if not (math.isfinite(line.timestamp) and line.timestamp >= 0):
        raise ValueError(f"timestamp must be a time in ms >= 0, got {line.timestamp}")
    if line.input_length < 1 or line.output_length < 1:
        raise ValueError("input_length and output_length must be >= 1")
    blocks = math.ceil(line.input_length / BLOCK_TOKENS)
    if len(line.hash_ids) != blocks:
        raise ValueError(
            f"{line.input_length} input tokens are {blocks} blocks of {BLOCK_TOKENS}, "
            f"but hash_ids has {len(line.hash_ids)}"
        )
    if any(not 0 <= h < 2**64 for h in line.hash_ids):
        raise ValueError("hash_ids must be in [0, 2**64)")
    return MooncakeRequest(
        line.timestamp, line.input_length, line.output_length, tuple(line.hash_ids)
    )


@dataclass(frozen=True)
class BlockVocab:
    """What blocks are made of: words, each one token of the served model when
    `token_ids` is known (`token_ids[i]` encodes `" " + words[i]`)."""

    words: tuple[str, ...]
    token_ids: tuple[int, ...] | None = None

    @classmethod
    def of(cls, tokenizer: Tokenizer | None) -> BlockVocab:
        if tokenizer is None:
            return cls(WORDS)
        words, ids = [], []
        for word in WORDS:
            encoded = tokenizer.encode(" " + word, add_special_tokens=False)
            if len(encoded) == 1 and encoded[0] not in ids:
                words.append(word)
                ids.append(encoded[0])
        if len(words) < MIN_VOCABULARY:
            raise ValueError(
                f"the tokenizer encodes only {len(words)} common words as one token each; "
                f"blocks need at least {MIN_VOCABULARY}"
            )
        return cls(tuple(words), tuple(ids))


@dataclass(frozen=True)
class BlockPrompt:
    """A prompt made of trace blocks, built when sent. Equal ids (under one seed) give
    equal blocks; `length` cuts the last block (and any `--max-input-len` cut)."""

    hash_ids: tuple[int, ...]
    length: int  # tokens
    vocab: BlockVocab
    seed: int = 0

    def picks(self) -> np.ndarray:
        """Indices into the vocabulary, one a token: token k of block h is a hash of
        (seed, h, k), computed for the whole prompt at once (a generator seeded per block
        cost 1.4 ms a 12k-token prompt; this, 0.3 ms)."""
        blocks = np.asarray(self.hash_ids, dtype=np.uint64)
        within = np.arange(self.length, dtype=np.uint64)
        ids = blocks[within // np.uint64(BLOCK_TOKENS)]
        keys = _mix(
            _mix(ids ^ _mix(np.full(1, self.seed % 2**64, dtype=np.uint64))) + within % BLOCK_TOKENS
        )
        return (keys % np.uint64(len(self.vocab.words))).astype(np.intp)

    def token_ids(self) -> list[int] | None:
        """The prompt as the served model's token ids; None without a tokenizer."""
        if self.vocab.token_ids is None:
            return None
        return np.asarray(self.vocab.token_ids)[self.picks()].tolist()

    def text(self) -> str:
        """The prompt as text that tokenizes back into `token_ids()`."""
        words = self.vocab.words
        return "".join(" " + words[i] for i in self.picks())


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijective scramble of 64-bit keys (wraps, as meant)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def prompt_for(
    request: MooncakeRequest, vocab: BlockVocab, *, max_input_len: int | None, seed: int
) -> BlockPrompt:
    """`request`'s prompt, cut at its end to `max_input_len` tokens when that is less."""
    length = request.input_length
    if max_input_len is not None:
        length = min(length, max_input_len)
    return BlockPrompt(request.hash_ids, length, vocab, seed)


def prefix_reuse(prompts: list[BlockPrompt]) -> float | None:
    """The share of prompt tokens an unbounded prefix cache could serve, replaying the
    prompts in order: each prompt's longest prefix that an earlier prompt had, counted in
    tokens (what the server's hit ratio is to be read against)."""
    seen: dict[int, int] = {}  # chained hash of a block prefix -> most tokens of its block
    total = reusable = 0
    for prompt in prompts:
        total += prompt.length
        chain, hitting = 0, True
        for i, block in enumerate(prompt.hash_ids[: math.ceil(prompt.length / BLOCK_TOKENS)]):
            tokens = min(BLOCK_TOKENS, prompt.length - i * BLOCK_TOKENS)
            chain = hash((chain, block))
            had = seen.get(chain, 0)
            if hitting:
                reusable += min(had, tokens)
                hitting = had >= tokens
            seen[chain] = max(had, tokens)
    return reusable / total if total else None


def conversation(request: MooncakeRequest) -> int:
    """The conversation a request belongs to: its first block of its own. Every request of
    the conversation trace opens with one shared block (block 0, a system prompt), and each
    turn repeats the earlier turns' blocks, so its second block names the conversation
    (7,373 of them in the 12,031 requests)."""
    ids = request.hash_ids
    return ids[1] if len(ids) > 1 else ids[0] if ids else -1


def sampled(request: MooncakeRequest, share: float) -> bool:
    """Whether `request`'s conversation is in the replayed `share` of conversations: a
    hash of the conversation, the same on every run, so a conversation is kept whole."""
    if share >= 1.0:
        return True
    mixed = _mix(np.array([conversation(request) % 2**64], dtype=np.uint64))[0]
    return int(mixed) / 2**64 < share


def trace_entries(config: BenchConfig, tokenizer: Tokenizer | None) -> list[TraceEntry]:
    """The trace at `config.dataset_path` as timed requests (seconds from its start),
    cut to `--max-input-len` / `--max-output-len`, keeping `--conversation-sample` of its
    conversations; every request ignores EOS, so that it produces the output length the
    trace recorded."""
    assert config.dataset_path is not None
    vocab = BlockVocab.of(tokenizer)
    entries = []
    for request in read_trace(config.dataset_path):
        if not sampled(request, config.conversation_sample):
            continue
        prompt = prompt_for(request, vocab, max_input_len=config.max_input_len, seed=config.seed)
        max_tokens = min(request.output_length, config.max_output_len or request.output_length)
        bench = BenchRequest(prompt, max_tokens, ignore_eos=True, input_len=prompt.length)
        entries.append(TraceEntry(request.timestamp_ms / 1000.0, bench))
    return entries
