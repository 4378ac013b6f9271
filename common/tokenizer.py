"""Text in and text out: HF tokenizer loading, chat templates, streaming detokenization, stops.

The router owns all of this; workers only ever see token ids. Streaming output goes
through two stages, each fed the previous stage's deltas:

    token ids --IncrementalDetokenizer--> final text --StopMatcher--> text for the client

Each stage emits only text that can no longer change: the detokenizer never emits half
a UTF-8 character, and the stop matcher never emits text that may still turn out to be
the start of a stop string.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from baton.common.config import eos_token_ids

REPLACEMENT_CHAR = "\ufffd"  # what a decoder shows for bytes that are not (yet) valid UTF-8


def load_tokenizer(model_dir: str | os.PathLike[str]) -> PreTrainedTokenizerFast:
    """The model folder's fast (Rust-backed) Hugging Face tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        # Slow tokenizers are too slow for a router; every current model ships tokenizer.json.
        raise TypeError(f"{model_dir}: no fast tokenizer (tokenizer.json), got {type(tokenizer)}")
    return tokenizer


class TextDecoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class Tokenizer:
    """The small surface the router needs from a Hugging Face tokenizer."""

    def __init__(self, hf: PreTrainedTokenizerFast, eos_token_ids: Iterable[int] = ()) -> None:
        self.hf = hf
        self.eos_token_ids: set[int] = set(eos_token_ids)
        if hf.eos_token_id is not None:
            self.eos_token_ids.add(int(hf.eos_token_id))
        self.vocab_size: int = len(hf)  # includes added and special tokens
        # The Rust decoder itself, where the class adds nothing to it: transformers' wrapper
        # first converts the ids one by one in Python (its to_py_obj), some 2.5 us a call,
        # and the detokenizer calls it twice a streamed message. Classes that edit the text
        # (e.g. Whisper's) keep their own decode.
        cls = type(hf)
        plain = (
            cls.decode is PreTrainedTokenizerFast.decode
            and cls._decode is PreTrainedTokenizerFast._decode
        )
        self._rust_decode = hf.backend_tokenizer.decode if plain else None

    @classmethod
    def load(cls, model_dir: str | os.PathLike[str]) -> Tokenizer:
        """Load the tokenizer; stop tokens also come from the model's config files."""
        return cls(load_tokenizer(model_dir), eos_token_ids(model_dir))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text for `messages` (and `tools`, for templates that render them),
        ending with the assistant's turn opener unless `add_generation_prompt` is False.
        `template_kwargs` are more variables for the template (e.g. enable_thinking)."""
        return str(
            self.hf.apply_chat_template(
                messages,
                tools=tools,  # type: ignore[arg-type]
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **template_kwargs,
            )
        )

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        # Chat templates write their own BOS, so the post-processor must not add another.
        text = self.render_chat(messages, tools, add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # Cleanup edits spaces around punctuation, which would make streamed text differ
        # from the full decode; clients get the model's text verbatim.
        if self._rust_decode is not None:
            return self._rust_decode(list(ids), skip_special_tokens=skip_special_tokens)
        return str(
            self.hf.decode(
                list(ids),
                skip_special_tokens=skip_special_tokens,
                clean_up_tokenization_spaces=False,
            )
        )

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)

    def vocabulary(self) -> set[str]:
        """Every token's text, added and special tokens included."""
        return set(self.hf.get_vocab())


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of final text.

    Invariant: the concatenation of every `add` result and `flush()` equals
    `decoder.decode(all_ids, skip_special_tokens)`.

    Each step decodes only a short window, never the whole sequence. The window keeps
    the ids of the previous emitted step as context, because some decoders render a
    token differently at the start of a text (e.g. dropping its leading space); the new
    text is the window's decode minus the decode of that context. Text ending in U+FFFD
    is held back: the last token may end inside a multi-byte character that the next
    token completes.
    """

    def __init__(self, decoder: TextDecoder, skip_special_tokens: bool = True) -> None:
        self._decoder = decoder
        self._skip_special = skip_special_tokens
        self._window: list[int] = []  # ids before the window are emitted and forgotten
        self._read = 0  # window ids before this offset are emitted already (the context)

    def add(self, ids: Iterable[int]) -> str:
        """Feed new token ids; return the text that is now final (often "")."""
        self._window.extend(ids)
        if len(self._window) == self._read:
            return ""
        context = self._decode(self._window[: self._read])
        text = self._decode(self._window)
        if text.endswith(REPLACEMENT_CHAR):
            return ""
        self._advance()
        return text[len(context) :]

    def flush(self) -> str:
        """The text still held back (e.g. a character that will never be completed)."""
        context = self._decode(self._window[: self._read])
        text = self._decode(self._window)
        self._advance()
        return text[len(context) :]

    def _advance(self) -> None:
        del self._window[: self._read]
        self._read = len(self._window)

    def _decode(self, ids: list[int]) -> str:
        return self._decoder.decode(ids, skip_special_tokens=self._skip_special) if ids else ""


class StopMatcher:
    """Cuts streamed text at the first stop string, even one split across deltas.

    `add` withholds the longest tail that could still grow into a stop string and emits
    the rest. When a stop string completes, everything from its start on is dropped and
    the matcher stays stopped. Generation stops at the first stop string to *complete*,
    as it would if the model were stopped there; `matched` names it.
    """

    def __init__(self, stop_strings: Iterable[str]) -> None:
        self.stop_strings: tuple[str, ...] = tuple(dict.fromkeys(stop_strings))
        if any(not s for s in self.stop_strings):
            raise ValueError("stop strings must be non-empty")
        self._held = ""
        self._max_held = max((len(s) for s in self.stop_strings), default=1) - 1
        self.stopped = False
        self.matched: str | None = None

    def add(self, text: str) -> tuple[str, bool]:
        """Feed a text delta; return (text safe to emit, whether a stop string was hit)."""
        if self.stopped:
            return "", True
        buffer = self._held + text
        hit = self._first_completed(buffer)
        if hit is not None:
            start, self.matched = hit
            self.stopped, self._held = True, ""
            return buffer[:start], True
        keep = self._partial_suffix_len(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """Release the withheld tail once generation ended without a stop string."""
        held, self._held = self._held, ""
        return held

    def _first_completed(self, buffer: str) -> tuple[int, str] | None:
        # The earliest end wins; for equal ends, the longer stop string (earlier start).
        best: tuple[int, int, str] | None = None
        for stop in self.stop_strings:
            start = buffer.find(stop)
            if start >= 0:
                key = (start + len(stop), start, stop)
                best = key if best is None or key < best else best
        return None if best is None else (best[1], best[2])

    def _partial_suffix_len(self, buffer: str) -> int:
        for n in range(min(len(buffer), self._max_held), 0, -1):
            tail = buffer[-n:]
            if any(stop.startswith(tail) for stop in self.stop_strings):
                return n
        return 0
