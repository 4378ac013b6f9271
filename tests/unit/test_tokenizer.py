"""Tokenizer wrapper, streaming detokenization and stop strings, as the router uses them."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton.common.models import tiny, tiny_tokenizer
from baton.common.tokenizer import IncrementalDetokenizer, StopMatcher, Tokenizer

VOCAB = 1024
HYPOTHESIS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
# Letters, accents, CJK, emoji (incl. ZWJ sequences and flags), punctuation, whitespace.
ALPHABET = [*"ab cdeé ïñ,.!?\n\t0123", *"東京🙂🚀ßЖ\u0301", "👩\u200d💻", "🇯🇵"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    model_dir = tiny.make_model(tmp_path_factory.mktemp("tok"), layers=1, hidden=32, vocab=VOCAB)
    return Tokenizer.load(model_dir)


def chunked(ids: Sequence[int], cuts: list[int]) -> list[list[int]]:
    bounds = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    return [list(ids[a:b]) for a, b in itertools.pairwise(bounds)]


def stream(tokenizer: Tokenizer, chunks: list[list[int]]) -> list[str]:
    detok = tokenizer.detokenizer()
    return [detok.add(chunk) for chunk in chunks] + [detok.flush()]


def test_wrapper_surface(tokenizer: Tokenizer) -> None:
    bos, eos = tokenizer.hf.bos_token_id, tokenizer.hf.eos_token_id
    im_end = tokenizer.hf.convert_tokens_to_ids(tiny_tokenizer.IM_END)
    assert tokenizer.vocab_size == VOCAB
    assert tokenizer.eos_token_ids == {eos, im_end}  # generation_config's stop tokens count
    ids = tokenizer.encode("Hello, café 東京 🙂")
    assert ids[0] == bos
    assert tokenizer.encode("Hello", add_special_tokens=False)[0] != bos
    assert tokenizer.decode(ids) == "Hello, café 東京 🙂"
    assert tokenizer.decode([*ids, eos]) == "Hello, café 東京 🙂"


def test_chat_prompt_has_one_bos_and_ends_with_assistant_turn(tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi there"}]
    ids = tokenizer.apply_chat_template(messages)
    assert ids.count(tokenizer.hf.bos_token_id) == 1 and ids[0] == tokenizer.hf.bos_token_id
    opener = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert ids[-len(opener) :] == opener
    assert tokenizer.decode(ids, skip_special_tokens=False) == tokenizer.render_chat(messages)


@HYPOTHESIS
@given(ids=st.lists(st.integers(0, VOCAB - 1), max_size=60), skip=st.booleans())
def test_decode_is_transformers_decode_for_any_ids(
    tokenizer: Tokenizer, ids: list[int], skip: bool
) -> None:
    # decode skips transformers' Python wrapper for the Rust decoder: the same text
    expected = tokenizer.hf.decode(
        ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
    )
    assert tokenizer.decode(ids, skip_special_tokens=skip) == expected


@HYPOTHESIS
@given(
    ids=st.lists(st.integers(0, VOCAB - 1), max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=20),
)
def test_deltas_add_up_to_full_decode_for_any_ids(
    tokenizer: Tokenizer, ids: list[int], cuts: list[int]
) -> None:
    deltas = stream(tokenizer, chunked(ids, cuts))
    assert "".join(deltas) == tokenizer.hf.decode(ids, skip_special_tokens=True)


@HYPOTHESIS
@given(
    text=st.lists(st.sampled_from(ALPHABET), max_size=40).map("".join),
    cuts=st.lists(st.integers(0, 100), max_size=30),
)
def test_streamed_text_is_exact_and_never_shows_half_a_character(
    tokenizer: Tokenizer, text: str, cuts: list[int]
) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = stream(tokenizer, chunked(ids, cuts))
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_multibyte_character_waits_for_its_last_token(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1, "pick a character the tokenizer splits"
    detok = tokenizer.detokenizer()
    assert [detok.add([i]) for i in ids] == [""] * (len(ids) - 1) + ["🙂"]
    assert detok.flush() == ""


def test_bytes_that_never_complete_are_released_by_flush(tokenizer: Tokenizer) -> None:
    head = tokenizer.encode("🙂", add_special_tokens=False)[:-1]
    detok = tokenizer.detokenizer()
    assert detok.add(tokenizer.encode("ok ", add_special_tokens=False)) == "ok "
    assert detok.add(head) == ""
    assert detok.flush() == tokenizer.decode(head)


def test_each_step_decodes_a_short_window(tokenizer: Tokenizer) -> None:
    longest: list[int] = [0]

    class Recorder:
        def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
            longest[0] = max(longest[0], len(ids))
            return tokenizer.decode(ids, skip_special_tokens)

    ids = tokenizer.encode("Streaming 東京 text 🙂 stays cheap. " * 60, add_special_tokens=False)
    detok = IncrementalDetokenizer(Recorder())
    text = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert text == tokenizer.decode(ids)
    assert len(ids) > 500
    assert longest[0] <= 8


def run_stops(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    matcher = StopMatcher(stops)
    out, stopped = [], False
    for piece in pieces:
        text, stopped = matcher.add(piece)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(matcher.flush())
    return "".join(out), stopped


def reference_stop(stops: list[str], text: str) -> tuple[str, bool]:
    """Cut at the stop string that completes first, as a model stopped there would."""
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    if not hits:
        return text, False
    return text[: min(hits)[1]], True


def test_stop_string_split_at_every_boundary() -> None:
    text = "Answer: 42.\n###\nignored"
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            pieces = [text[:i], text[i:j], text[j:]]
            assert run_stops(["###"], pieces) == ("Answer: 42.\n", True), pieces


def test_possible_stop_prefix_is_withheld_until_resolved() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.add("Hello ST") == ("Hello ", False)
    assert matcher.add("O") == ("", False)
    assert matcher.add("RM!") == ("STORM!", False)
    assert matcher.add(" S") == (" ", False)
    assert matcher.flush() == "S"


def test_stopped_matcher_stays_stopped() -> None:
    matcher = StopMatcher(["\n\n", "END"])
    assert matcher.add("line\n\nmore END") == ("line", True)
    assert matcher.matched == "\n\n"
    assert matcher.add("anything") == ("", True)
    assert matcher.flush() == ""


def test_first_completed_stop_wins() -> None:
    # "bc" completes before "abcd" does, although "abcd" starts earlier.
    assert run_stops(["abcd", "bc"], ["xab", "cd"]) == ("xa", True)
    assert run_stops(["abc", "bc"], ["xabc"]) == ("x", True)


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError):
        StopMatcher([""])


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc 東🙂", max_size=30),
    stops=st.lists(st.text(alphabet="abc 東🙂", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=10),
)
def test_streamed_stops_match_whole_text_stops(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    assert run_stops(stops, pieces) == reference_stop(stops, text)
