"""Request preparation: tools reach the chat template, constraints become one grammar."""

from __future__ import annotations

import copy
import json

import pytest

from baton.common.models.tiny import default_model_path
from baton.common.tokenizer import Tokenizer
from baton.services.router.config import ModelInfo
from baton.services.router.errors import APIError
from baton.services.router.params import RequestPreparer
from baton.services.router.schemas import ChatCompletionRequest, CompletionRequest
from baton.services.router.tool_parsers import make_parser

# A ChatML template that renders tools and tool turns the way Qwen's does.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t | tojson }}"
    "{% endfor %}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} "
    "{{ c.function.arguments.city }}</tool_call>{%- endfor %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def preparer() -> RequestPreparer:
    path = default_model_path()
    tokenizer = Tokenizer.load(path)
    tokenizer.hf = copy.copy(tokenizer.hf)
    tokenizer.hf.chat_template = TOOL_TEMPLATE
    return RequestPreparer(ModelInfo.load(path, None), tokenizer, make_parser("auto", set()))


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "tiny-llama-v1", "messages": [{"role": "user", "content": "Weather?"}], **fields}
    )


def text_of(preparer: RequestPreparer, request: ChatCompletionRequest) -> str:
    return preparer.tokenizer.decode(preparer.chat(request).choices[0].input_ids, False)


def test_tools_and_tool_history_reach_the_template(preparer: RequestPreparer) -> None:
    history = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    text = text_of(preparer, chat(messages=history, tools=[WEATHER]))
    assert '"name": "get_weather"' in text  # the tool list
    assert "<tool_call>get_weather Paris</tool_call>" in text  # arguments as an object
    assert "<|im_start|>tool\nsunny" in text
    assert "Tools:" not in text_of(preparer, chat(tools=[WEATHER], tool_choice="none"))
    prepared = preparer.chat(chat(tools=[WEATHER]))
    assert prepared.tools.mode == "auto" and prepared.choices[0].sampling.grammar is None


def test_forced_tool_choices_are_grammars(preparer: RequestPreparer) -> None:
    named = preparer.chat(
        chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    )
    grammar = named.choices[0].sampling.grammar
    assert grammar is not None and grammar.kind == "json_schema"
    assert json.loads(grammar.value) == WEATHER["function"]["parameters"]  # type: ignore[index]
    required = preparer.chat(chat(tools=[WEATHER], tool_choice="required"))
    schema = json.loads(required.choices[0].sampling.grammar.value)  # type: ignore[union-attr]
    assert schema["type"] == "array" and schema["minItems"] == 1
    with pytest.raises(APIError) as e:
        preparer.chat(
            chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}})
        )
    assert e.value.param == "tool_choice"
    with pytest.raises(APIError) as e:
        preparer.chat(chat(tools=[WEATHER], tool_choice="required", regex="a+"))
    assert e.value.param == "tool_choice"


@pytest.mark.parametrize(
    ("fields", "kind"),
    [
        ({"response_format": {"type": "json_object"}}, "json_schema"),
        ({"regex": "[a-z]+"}, "regex"),
        ({"structured_outputs": {"choice": ["yes", 'no "way"']}}, "ebnf"),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "ebnf"),
        ({"guided_json": '{"type": "integer"}'}, "json_schema"),
    ],
)
def test_every_spelling_of_a_constraint(
    preparer: RequestPreparer, fields: dict[str, object], kind: str
) -> None:
    body = CompletionRequest.model_validate({"model": "tiny-llama-v1", "prompt": "x", **fields})
    grammar = preparer.completion(body).choices[0].sampling.grammar
    assert grammar is not None and grammar.kind == kind


def test_logit_bias_and_echo_logprobs(preparer: RequestPreparer) -> None:
    body = CompletionRequest.model_validate(
        {
            "model": "tiny-llama-v1",
            "prompt": [[5, 6, 7]],
            "echo": True,
            "max_tokens": 1,
            "logprobs": 1,
            "logit_bias": {"42": 100},
        }
    )
    prepared = preparer.completion(body)
    sampling = prepared.choices[0].sampling
    assert sampling.logit_bias == {42: 100.0}
    assert sampling.prompt_logprobs == 1 and prepared.echo
