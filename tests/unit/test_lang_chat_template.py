"""Role blocks cut from chat templates render what transformers renders: for the tiny
model's template and templates shaped like the common families'."""

from __future__ import annotations

from typing import Any

import pytest

from baton.common.models.tiny import default_model_path
from baton.common.models.tiny_tokenizer import CHAT_TEMPLATE
from baton.common.tokenizer import Tokenizer
from baton.lang.chat_template import ChatTemplate

# ChatML with a default system prompt when the conversation brings none (Qwen-2.5-like)
CHATML_DEFAULT_SYSTEM = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# headers and a BOS (Llama-3-like); contents are trimmed
HEADERS = (
    "{{- bos_token }}{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim"
    " + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
# no system role, the assistant named "model" (Gemma-like)
NO_SYSTEM = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + m['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load(default_model_path())


def variables(tok: Tokenizer) -> dict[str, Any]:
    return {"bos_token": tok.hf.bos_token, "eos_token": tok.hf.eos_token}


def ours(template: ChatTemplate, messages: list[dict[str, str]], generation: bool) -> str:
    text = "".join(
        template.opening(m["role"], i == 0) + m["content"] + template.closing(m["role"])
        for i, m in enumerate(messages)
    )
    return text + (template.opening("assistant", not messages) if generation else "")


def theirs(tok: Tokenizer, source: str, messages: list[dict[str, str]], generation: bool) -> str:
    return str(
        tok.hf.apply_chat_template(
            messages, chat_template=source, tokenize=False, add_generation_prompt=generation
        )
    )


CONVERSATION = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "It is 4.\nAnything else?"},
    {"role": "user", "content": "No, thanks."},
]
SYSTEM = {"role": "system", "content": "You answer in one line."}


@pytest.mark.parametrize("source", [CHAT_TEMPLATE, CHATML_DEFAULT_SYSTEM, HEADERS, NO_SYSTEM])
def test_role_blocks_render_like_transformers(tok: Tokenizer, source: str) -> None:
    template = ChatTemplate.from_jinja(source, variables(tok))
    conversations = [CONVERSATION, CONVERSATION[:1]]
    if source != NO_SYSTEM:
        conversations += [[SYSTEM, *CONVERSATION], [SYSTEM]]
    for messages in conversations:
        for generation in (False, True):
            assert ours(template, messages, generation) == theirs(
                tok, source, messages, generation
            ), (messages, generation)


def test_a_template_without_a_system_role_refuses_one(tok: Tokenizer) -> None:
    template = ChatTemplate.from_jinja(NO_SYSTEM, variables(tok))
    assert template.opening("assistant", False) == "<start_of_turn>model\n"
    with pytest.raises(ValueError, match="no 'system' role"):
        template.opening("system", True)


def test_the_tiny_models_program_text_tokenizes_like_its_chat_prompt(tok: Tokenizer) -> None:
    """The server adds the BOS itself, so the program text leaves it out, and the tokens
    the server computes are the chat template's."""
    template = ChatTemplate.from_jinja(CHAT_TEMPLATE, variables(tok)).without_leading(
        tok.hf.bos_token
    )
    messages = [SYSTEM, *CONVERSATION]
    assert tok.encode(ours(template, messages, True)) == tok.apply_chat_template(messages)


def test_a_template_that_does_not_split_is_refused(tok: Tokenizer) -> None:
    last_only = "{{ messages[-1]['content'] }}"
    with pytest.raises(ValueError, match="cannot be split into role blocks"):
        ChatTemplate.from_jinja(last_only, variables(tok))
