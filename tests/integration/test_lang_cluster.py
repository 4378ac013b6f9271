"""baton.lang programs against `baton up` (1 prefill + 1 decode worker, the tiny model):
what a program's author would notice — greedy gen equals the OpenAI endpoint, select
agrees with transformers, forks share the cached prefix and run concurrently, batches keep
their order, constraints hold, errors say what failed, and the guide's examples run."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from baton.lang import (
    EndpointError,
    Generation,
    ProgramError,
    RuntimeEndpoint,
    assistant,
    function,
    gen,
    select,
    set_default_backend,
    system,
    user,
)
from tests.integration.cluster import Cluster, cluster

pytestmark = pytest.mark.timeout(300)
KEY = "sk-lang"
AUTH = {"authorization": f"Bearer {KEY}"}
DOCS = Path(__file__).resolve().parents[2] / "docs" / "LANG.md"


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(tmp_path_factory.mktemp("lang"), "--api-key", KEY) as c:
        yield c


@pytest.fixture(scope="module")
def backend(up: Cluster) -> Iterator[RuntimeEndpoint]:
    with RuntimeEndpoint(up.url, api_key=KEY) as endpoint:
        yield endpoint


def completion(up: Cluster, prompt: str, max_tokens: int) -> str:
    status, body = up.post(
        "/v1/completions",
        {"model": "tiny-llama-v1", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        headers=AUTH,
    )
    assert status == 200, body
    return str(body["choices"][0]["text"])


def test_greedy_gen_equals_the_completions_endpoint(up: Cluster, backend: RuntimeEndpoint) -> None:
    @function
    def weather(s: Any, city: str) -> None:
        s += f"Weather in {city}:" + gen("report", max_tokens=24, temperature=0)

    state = weather.run(city="Tokyo", backend=backend)
    assert state["report"] == completion(up, "Weather in Tokyo:", 24)
    assert state.text() == "Weather in Tokyo:" + state["report"]
    assert state.get_meta_info("report")["completion_tokens"] >= 1


def test_a_chat_program_answers_like_chat_completions(
    up: Cluster, backend: RuntimeEndpoint
) -> None:
    """Role blocks render the model's chat template token for token (the server adds the
    BOS, the program text leaves it out): the greedy answer is the chat endpoint's."""

    @function
    def chat(s: Any) -> None:
        s += system("You answer briefly.")
        s += user("Where is Edinburgh?")
        s += assistant(gen("answer", max_tokens=16, temperature=0))

    state = chat.run(backend=backend)
    status, body = up.post(
        "/v1/chat/completions",
        {
            "model": "tiny-llama-v1",
            "messages": state.messages()[:2],
            "max_tokens": 16,
            "temperature": 0,
        },
        headers=AUTH,
    )
    assert status == 200, body
    assert state["answer"] == body["choices"][0]["message"]["content"]


def test_select_picks_the_highest_mean_logprob_by_transformers(
    up: Cluster, backend: RuntimeEndpoint
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from baton.common.tokenizer import Tokenizer

    prompt = "Weather in Tokyo: windy, 12 °C, wind"
    choices = [" 50 km/h", " cold", " the wolf of Bangkok", " km"]

    @function
    def pick(s: Any) -> None:
        s += prompt + select("wind", choices)

    state = pick.run(backend=backend)
    tok = Tokenizer.load(up.model)
    model = AutoModelForCausalLM.from_pretrained(up.model, dtype=torch.float32).eval()
    ids = tok.encode(prompt)
    expected = []
    for choice in choices:
        tail = tok.encode(choice, add_special_tokens=False)
        with torch.no_grad():
            logits = model(torch.tensor([ids + tail])).logits[0]  # type: ignore[operator]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        expected.append([float(logprobs[len(ids) - 1 + j, t]) for j, t in enumerate(tail)])
    means = [sum(lps) / len(lps) for lps in expected]
    meta = state.get_meta_info("wind")
    for ours, theirs in zip(meta["token_logprobs"], expected, strict=True):
        assert ours == pytest.approx(theirs, abs=1e-3)
    assert state["wind"] == choices[means.index(max(means))]
    assert state.text() == prompt + state["wind"]


class TimedEndpoint(RuntimeEndpoint):
    """Notes when each generation was sent and answered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.intervals: list[tuple[float, float]] = []

    def generate(
        self,
        text: str,
        sampling: dict[str, Any],
        on_text: Callable[[str], None] | None = None,
    ) -> Generation:
        sent = time.monotonic()
        result = super().generate(text, sampling, on_text)
        self.intervals.append((sent, time.monotonic()))
        return result


def prefix_hits(up: Cluster) -> float:
    """The cluster's prefix-cache hit counter, summed over workers (router /metrics)."""
    import urllib.request

    scrape = urllib.request.Request(up.url + "/metrics", headers=AUTH)  # --api-key covers it
    with urllib.request.urlopen(scrape, timeout=30) as r:
        text = r.read().decode()
    samples = re.findall(r"^baton_worker_prefix_cache_hits_total\{.*\} (\S+)$", text, re.M)
    assert samples, "no prefix-cache hit counter in /metrics"
    return sum(float(v) for v in samples)


def test_fork_branches_share_the_prefix_and_run_concurrently(up: Cluster) -> None:
    prefix = "Here are three tips for a rainy day in Edinburgh, each one short. " * 2

    @function
    def tips(s: Any) -> None:
        s += prefix
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"Tip {i + 1}:" + gen("tip", max_tokens=32, temperature=0, ignore_eos=True)
        forks.join()

    before = prefix_hits(up)
    with TimedEndpoint(up.url, api_key=KEY) as timed:
        state = tips.run(backend=timed)
        prefix_len = len(timed.tokenize(prefix))
    assert len(state["tip"]) == 3
    cached = [m["cached_tokens"] for m in state.get_meta_info("tip")["branches"]]
    # the prefix's last token may merge with the branch's first text
    assert min(cached) >= prefix_len - 2, (cached, prefix_len)
    starts, ends = zip(*timed.intervals, strict=True)
    assert max(starts) < min(ends), f"the branches did not overlap: {timed.intervals}"
    deadline = time.monotonic() + 10
    while prefix_hits(up) < before + sum(cached):
        assert time.monotonic() < deadline, f"prefix hits {prefix_hits(up)}, before {before}"
        time.sleep(0.5)


def test_run_batch_returns_one_state_per_input_in_order(
    up: Cluster, backend: RuntimeEndpoint
) -> None:
    @function
    def about(s: Any, topic: str) -> None:
        s += f"A note about {topic}:" + gen("note", max_tokens=8, temperature=0)

    topics = ["Tokyo", "the university", "breakfast", "a slip", "Cortam"]
    states = about.run_batch([{"topic": t} for t in topics], backend=backend)
    notes = [s["note"] for s in states]
    assert notes == [completion(up, f"A note about {t}:", 8) for t in topics]
    assert len(set(notes)) > 1  # different inputs, different answers: the order is tested


def test_a_regex_or_json_schema_inside_gen_is_honored(backend: RuntimeEndpoint) -> None:
    pattern = r"[0-9]{3}-[a-z]{2}"

    @function
    def code(s: Any) -> None:
        s += "Code: " + gen("code", regex=pattern, max_tokens=16, temperature=1.0)

    for _ in range(3):
        value = code.run(backend=backend)["code"]
        assert re.fullmatch(pattern, value), value

    schema = {
        "type": "object",
        "properties": {"sunny": {"type": "boolean"}},
        "required": ["sunny"],
        "additionalProperties": False,
    }

    @function
    def weather(s: Any) -> None:
        s += "Weather in Tokyo as JSON: " + gen("json", json_schema=schema, max_tokens=16)

    assert json.loads(weather.run(backend=backend)["json"]) in ({"sunny": True}, {"sunny": False})


def test_a_second_run_hits_the_radix_cache(backend: RuntimeEndpoint) -> None:
    @function
    def story(s: Any) -> None:
        s += user("Tell me about the lunchroom of Brilotor, which was wrecked on a Wednesday.")
        s += assistant(gen("story", max_tokens=8, temperature=0))

    first = story.run(backend=backend).get_meta_info("story")
    second = story.run(backend=backend).get_meta_info("story")
    assert second["cached_tokens"] > first["cached_tokens"]
    assert second["cached_tokens"] >= second["prompt_tokens"] - 1


def test_stream_yields_the_text_as_it_is_generated(backend: RuntimeEndpoint) -> None:
    @function
    def poem(s: Any) -> None:
        s += "A poem about the seashore:" + gen("poem", max_tokens=24, temperature=0)

    state = poem.run(backend=backend, stream=True)
    pieces = list(state.text_iter("poem"))
    assert len(pieces) > 1
    assert "".join(pieces) == state["poem"] == poem.run(backend=backend)["poem"]


def test_errors_carry_the_servers_message_and_name_the_statement(
    up: Cluster, backend: RuntimeEndpoint
) -> None:
    @function
    def too_long(s: Any) -> None:
        s += "Hello" + gen("x", max_tokens=100000)

    with pytest.raises(ProgramError) as info:
        too_long.run(backend=backend)
    message = str(info.value)
    assert "too_long: 'Hello' + gen('x', max_tokens=100000) at test_lang_cluster.py:" in message
    assert "maximum context length is" in message
    cause = info.value.cause
    assert isinstance(cause, EndpointError)
    assert (cause.status, cause.param) == (400, "sampling_params.max_new_tokens")

    with (
        RuntimeEndpoint(up.url, api_key="wrong") as wrong,
        pytest.raises(ProgramError, match=r"401 .*invalid API key"),
    ):
        too_long.run(backend=wrong)


def guide_examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)


@pytest.mark.parametrize("index", range(1, len(guide_examples())))
def test_the_guides_examples_run(up: Cluster, index: int) -> None:
    setup, example = guide_examples()[0], guide_examples()[index]
    setup = setup.replace("http://127.0.0.1:8000", up.url).replace("api_key=None", "api_key=KEY")
    try:
        exec(compile(setup + example, f"{DOCS.name} example {index}", "exec"), {"KEY": KEY})
    finally:
        set_default_backend(None)
