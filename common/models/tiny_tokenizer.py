"""The tiny models' tokenizer (`tiny.make_model`): a byte-level BPE trained on the text
shipped in `data/`, with Llama 3's BOS and EOS, ChatML's turn markers and a ChatML chat
template, saved in the layout every transformers version reads."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (BOS, EOS, IM_START, IM_END)
MIN_VOCAB = 512

DATA_DIR = Path(__file__).parent / "data"

# ChatML. Content may be a string or a list of OpenAI-style parts ({"type": "text", ...}).
# BOS comes from the template: chat prompts are encoded without the post-processor's BOS.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Pre-tokenizer split: contractions, words with their leading space, digits in groups of
# at most three (so numbers do not flood the vocabulary), punctuation runs, whitespace.
SPLIT_PATTERN = r"'(?:s|t|re|ve|m|ll|d)| ?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def train_tokenizer(vocab: int) -> Tokenizer:
    """A byte-level BPE tokenizer of exactly `vocab` tokens, trained on `data/*.txt`.

    Training is deterministic and takes a fraction of a second. When the text supports
    fewer merges than asked, the rest of the vocabulary is `<|reserved_N|>` tokens. They
    are plain text, not special: a model of random weights (a benchmark's `--load-format
    dummy`) generates them most of the time, and as special tokens they rendered as no
    text, so a client saw its first content tokens after its first token (32,000 ids:
    79% of them reserved; session 34's TTFTs held 85-140 ms of that at p50).
    """
    if vocab < MIN_VOCAB:
        raise ValueError(f"vocab must be at least {MIN_VOCAB}, got {vocab}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(sorted(str(p) for p in DATA_DIR.glob("*.txt")), trainer)
    missing = vocab - tokenizer.get_vocab_size()
    if missing > 0:
        tokenizer.add_tokens(
            [
                AddedToken(f"<|reserved_{i}|>", special=False, normalized=False)
                for i in range(missing)
            ]
        )
    bos_id = token_id(tokenizer, BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS}:1 $B:1",
        special_tokens=[(BOS, bos_id)],
    )
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out: Path, max_length: int) -> None:
    """Write the tokenizer files in the layout every transformers version reads."""
    tokenizer.save(str(out / "tokenizer.json"))
    added = {
        str(token_id(tokenizer, tok.content)): {
            "content": tok.content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": tok.special,
        }
        for tok in tokenizer.get_added_tokens_decoder().values()
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "model_max_length": max_length,
        # Must stay off: it edits spaces around punctuation, so streamed text would not
        # add up to the full decode.
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": added,
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS})


def token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise KeyError(f"tokenizer has no {token!r}")
    return int(token_id)


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
