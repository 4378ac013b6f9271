"""The Mooncake trace reader: equal hash ids are equal token blocks, bad lines are named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from baton.benchmarks.config import BenchConfig, BenchConfigError
from baton.benchmarks.datasets import TokenText
from baton.benchmarks.mooncake import (
    BLOCK_TOKENS,
    BlockPrompt,
    BlockVocab,
    TraceFormatError,
    prefix_reuse,
    read_trace,
)
from baton.benchmarks.serve import make_plan

pytestmark = pytest.mark.timeout(60)


def line(ts: float, n_in: int, n_out: int, ids: list[int]) -> dict[str, object]:
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


def write_trace(path: Path, records: list[object]) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    from baton.common.models.tiny import default_model_path
    from baton.common.tokenizer import Tokenizer

    return Tokenizer.load(default_model_path())


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ("{not json", "malformed"),
        (json.dumps({"timestamp": 5, "input_length": 10, "output_length": 2}), "hash_ids"),
        (json.dumps(line(5, 10, 2, [1]) | {"input_length": "10"}), "input_length"),
        (json.dumps(line(5, 1025, 2, [1, 2])), "3 blocks"),
        (json.dumps(line(5, 10, 0, [1])), "output_length"),
        (json.dumps(line(-1, 10, 2, [1])), "timestamp"),
        (json.dumps(line(5, 10, 2, [-3])), "hash_ids"),
        (json.dumps([1, 2]), "object"),
    ],
)
def test_a_malformed_line_is_refused_with_its_number(tmp_path: Path, bad: str, why: str) -> None:
    path = write_trace(tmp_path / "t.jsonl", [line(0, 600, 5, [0, 1]), "", bad])
    with pytest.raises(TraceFormatError, match=rf"t\.jsonl:3: .*{why}"):
        read_trace(path)


def test_lines_are_read_in_arrival_order(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path / "t.jsonl",
        [line(30, 600, 5, [0, 1]), line(10, 100, 7, [2]), line(10, 512, 9, [3])],
    )
    trace = read_trace(path)
    assert [(r.timestamp_ms, r.output_length) for r in trace] == [(10, 7), (10, 9), (30, 5)]
    assert trace[2].hash_ids == (0, 1) and trace[2].input_length == 600


def test_equal_hash_ids_are_identical_token_blocks(tokenizer) -> None:  # type: ignore[no-untyped-def]
    vocab = BlockVocab.of(tokenizer)
    first = BlockPrompt((7, 8, 9), 3 * BLOCK_TOKENS, vocab).token_ids()
    second = BlockPrompt((7, 8, 4, 5), 3 * BLOCK_TOKENS + 100, vocab).token_ids()
    assert first is not None and second is not None
    assert (len(first), len(second)) == (3 * BLOCK_TOKENS, 3 * BLOCK_TOKENS + 100)
    shared = 2 * BLOCK_TOKENS
    assert first[:shared] == second[:shared]
    assert first[shared] != second[shared] or first[shared:] != second[shared : 3 * BLOCK_TOKENS]
    # A block is the same wherever it appears, and a partial block is its beginning.
    alone = BlockPrompt((8,), BLOCK_TOKENS, vocab).token_ids()
    tail = BlockPrompt((3, 9), BLOCK_TOKENS + 40, vocab).token_ids()
    assert alone == first[BLOCK_TOKENS:shared]
    assert tail is not None and tail[BLOCK_TOKENS:] == first[shared : shared + 40]
    # Every id is a token of the model; another seed makes other blocks (a fresh cache).
    assert set(first) <= set(vocab.token_ids or ())
    assert BlockPrompt((7,), BLOCK_TOKENS, vocab, seed=1).token_ids() != first[:BLOCK_TOKENS]


def test_the_text_tokenizes_back_into_the_blocks(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Sent as text (chat), a prompt is the same tokens as sent as ids: block boundaries
    survive tokenization, so shared blocks are shared prefixes on the server."""
    vocab = BlockVocab.of(tokenizer)
    prompt = BlockPrompt((1, 2, 3), 2 * BLOCK_TOKENS + 77, vocab)
    assert tokenizer.encode(prompt.text(), add_special_tokens=False) == prompt.token_ids()


def test_without_a_tokenizer_blocks_are_words() -> None:
    prompt = BlockPrompt((1, 2), BLOCK_TOKENS + 3, BlockVocab.of(None))
    assert prompt.token_ids() is None
    words = prompt.text().split()
    assert len(words) == BLOCK_TOKENS + 3
    assert words[:BLOCK_TOKENS] == BlockPrompt((1,), BLOCK_TOKENS, prompt.vocab).text().split()


def test_the_plan_replays_a_window_of_the_trace_scaled(tmp_path: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    path = write_trace(
        tmp_path / "t.jsonl",
        [
            line(0, 1000, 50, [0, 1]),
            line(1000, 1500, 400, [0, 1, 2]),
            line(3000, 300, 9, [3]),
            line(9000, 20, 9, [4]),
        ],
    )
    tokens = TokenText(tokenizer, "tiny")
    config = BenchConfig(
        dataset="mooncake",
        dataset_path=path,
        time_scale=0.5,
        duration_s=2.0,
        max_input_len=1200,
        max_output_len=100,
    )
    plan = make_plan(config, tokens)
    assert plan.offsets == [0.0, 0.5, 1.5]  # ms -> s, halved; 4.5 s is past --duration
    assert [r.max_tokens for r in plan.requests] == [50, 100, 9]
    assert [r.input_len for r in plan.requests] == [1000, 1200, 300]
    assert all(r.ignore_eos for r in plan.requests)
    cut = plan.requests[1].prompt
    assert isinstance(cut, BlockPrompt)
    whole = BlockPrompt((0, 1, 2), 1500, cut.vocab).token_ids()
    assert whole is not None and cut.token_ids() == whole[:1200]  # cut at the end
    # The second prompt begins with the first's 1000 tokens: 1000 of 2500 tokens.
    assert plan.prefix_reuse == pytest.approx(1000 / 2500)
    assert len(make_plan(BenchConfig(dataset="mooncake", dataset_path=path, num_requests=2), tokens).offsets) == 2  # fmt: skip


def test_prefix_reuse_counts_only_prefixes() -> None:
    vocab = BlockVocab.of(None)
    prompts = [
        BlockPrompt((1, 2), 1024, vocab),
        BlockPrompt((5, 2), 1024, vocab),  # block 2 behind another block: not a prefix hit
        BlockPrompt((1, 2, 3), 1100, vocab),  # the first's two blocks, then a new one
        BlockPrompt((1, 2, 3), 1300, vocab),  # the third's 1100 tokens: not more
    ]
    assert prefix_reuse(prompts) == pytest.approx(2124 / (1024 + 1024 + 1100 + 1300))


def test_mooncake_settings_are_checked() -> None:
    with pytest.raises(BenchConfigError, match="needs a dataset path"):
        BenchConfig(dataset="mooncake")
    with pytest.raises(BenchConfigError, match="max input len is for --dataset mooncake"):
        BenchConfig(max_input_len=100)
    with pytest.raises(BenchConfigError, match="max output len"):
        BenchConfig(dataset="mooncake", dataset_path="x", max_output_len=0)
    # Replayed at its own times, a trace bounded by --duration alone is fine.
    BenchConfig(dataset="mooncake", dataset_path="x", duration_s=10)
    with pytest.raises(BenchConfigError, match="conversation sample must be in"):
        BenchConfig(dataset="mooncake", dataset_path="x", conversation_sample=0)
    with pytest.raises(BenchConfigError, match="conversation sample is for --dataset mooncake"):
        BenchConfig(conversation_sample=0.5)


def test_a_conversation_sample_keeps_whole_conversations(tmp_path: Path) -> None:
    # 200 conversations of 3 turns each: every turn opens with the shared block 0, then its
    # conversation's own blocks, then the earlier turns' and a new one.
    records = []
    for turn in range(3):
        for c in range(200):
            own = [1000 + 10 * c + k for k in range(turn + 1)]
            records.append(line(turn * 1000 + c, 512 * (1 + len(own)), 4, [0, *own]))
    records.sort(key=lambda r: r["timestamp"])
    path = write_trace(tmp_path / "t.jsonl", records)
    whole = make_plan(BenchConfig(dataset="mooncake", dataset_path=path))
    half = make_plan(BenchConfig(dataset="mooncake", dataset_path=path, conversation_sample=0.5))
    again = make_plan(BenchConfig(dataset="mooncake", dataset_path=path, conversation_sample=0.5))
    assert [r.prompt.hash_ids for r in half.requests] == [r.prompt.hash_ids for r in again.requests]
    kept = {r.prompt.hash_ids[1] for r in half.requests}
    assert 70 < len(kept) < 130  # about half of the 200 conversations
    # each kept conversation has all three of its turns, so its reuse survives the sample
    assert len(half.requests) == 3 * len(kept)
    assert half.prefix_reuse == pytest.approx(whole.prefix_reuse, abs=0.02)
