"""SGLang's own frontend (the real `sglang` package, its `lang` part) against baton's router:
a program using gen, select, fork, roles, regex, run_batch and stream runs unchanged through
`sgl.RuntimeEndpoint` on a 1P1D cluster (the tiny model) and answers as the same program
does under `baton.lang`. Then the SGLang-native API shapes it relies on, against fake
workers: batches, `max_new_tokens: 0`, logprob triples, refused fields, model and server
info, /health_generate."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import sglang as sgl

import baton.lang as baton_lang
from baton.benchmarks.fake_worker import FakeBehavior, FakeWorker
from baton.common.rpc import baton_pb2 as pb
from baton.common.tokenizer import Tokenizer
from tests.integration.cluster import Cluster, cluster
from tests.integration.router_api import answered, events, eventually, worker
from tests.integration.router_api import cluster as fake_cluster

pytestmark = pytest.mark.timeout(300)
KEY = "sk-sglang"
CODE = r"[A-Z]{3}-[0-9]{2}"
CHOICES = [" sunny", " rainy", " foggy and cold"]


def trip_program(lang: ModuleType) -> Any:
    """One program, written once: `lang` is `sglang` or `baton.lang` (the same names)."""

    @lang.function
    def trip(s: Any, city: str) -> None:
        s += lang.system("You answer briefly.")
        s += lang.user(f"Plan a day in {city}.")
        s += lang.assistant(lang.gen("plan", max_tokens=16, temperature=0))
        s += lang.user("What is the weather there?")
        s += lang.assistant("Weather:" + lang.select("weather", choices=CHOICES))
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"\nIdea {i + 1}:" + lang.gen("idea", max_tokens=8, temperature=0)
        forks.join()
        s += "\nCode: " + lang.gen("code", regex=CODE, max_tokens=12, temperature=0)

    return trip


def note_program(lang: ModuleType) -> Any:
    @lang.function
    def note(s: Any, topic: str) -> None:
        s += f"A note about {topic}:" + lang.gen("note", max_tokens=8, temperature=0)
        s += " Verdict:" + lang.select("verdict", choices=[" good", " bad"])

    return note


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(tmp_path_factory.mktemp("sglang"), "--api-key", KEY) as c:
        yield c


@pytest.fixture(scope="module")
def sglang_backend(up: Cluster) -> Any:
    # SGLang's frontend picks its chat template by the model's path; its registry does not
    # know "tiny-llama-v1", whose template is ChatML, so the endpoint is told (the program
    # itself is unchanged).
    return sgl.RuntimeEndpoint(up.url, api_key=KEY, chat_template_name="chatml")


@pytest.fixture(scope="module")
def baton_backend(up: Cluster) -> Iterator[baton_lang.RuntimeEndpoint]:
    with baton_lang.RuntimeEndpoint(up.url, api_key=KEY) as endpoint:
        yield endpoint


def test_an_sglang_program_answers_as_under_baton_lang(
    sglang_backend: Any, baton_backend: baton_lang.RuntimeEndpoint
) -> None:
    theirs = trip_program(sgl).run(city="Tokyo", backend=sglang_backend)
    ours = trip_program(baton_lang).run(city="Tokyo", backend=baton_backend)
    for name in ("plan", "weather", "idea", "code"):
        assert theirs[name] == ours[name], name
    assert theirs.text() == ours.text()  # roles rendered alike, every value in its place
    assert re.fullmatch(CODE, theirs["code"])
    assert len(theirs["idea"]) == 2 and theirs["plan"]
    # select scored each choice's tokens with the same prompt logprobs baton.lang reads
    entries = theirs.get_meta_info("weather")["input_token_logprobs"]
    for choice, scored, expected in zip(
        CHOICES, entries, ours.get_meta_info("weather")["token_logprobs"], strict=True
    ):
        tail = scored[-len(expected) :]
        assert [e[1] for e in tail] == baton_backend.tokenize(choice, add_special_tokens=False)
        assert "".join(e[2] for e in tail) == choice  # return_text_in_logprobs
        assert [e[0] for e in tail] == pytest.approx(expected, abs=1e-4)


def test_run_batch_and_stream_answer_as_under_baton_lang(
    sglang_backend: Any, baton_backend: baton_lang.RuntimeEndpoint
) -> None:
    topics = ["Tokyo", "the university", "breakfast", "a slip"]
    theirs = note_program(sgl).run_batch([{"topic": t} for t in topics], backend=sglang_backend)
    ours = note_program(baton_lang).run_batch([{"topic": t} for t in topics], backend=baton_backend)
    pairs = [(s["note"], s["verdict"]) for s in theirs]
    assert pairs == [(s["note"], s["verdict"]) for s in ours]
    assert len({note for note, _ in pairs}) > 1  # different inputs: the order is tested

    state = note_program(sgl).run(topic="Tokyo", backend=sglang_backend, stream=True)
    pieces = list(state.text_iter("note"))
    assert len(pieces) > 1
    assert "".join(pieces) == state["note"] == pairs[0][0]
    assert state["verdict"] == pairs[0][1]


def test_sglangs_server_queries_answer(up: Cluster, sglang_backend: Any) -> None:
    assert sglang_backend.get_model_name() == up.model
    info = sgl.get_server_info(backend=sglang_backend)
    assert info["model_path"] == up.model and info["workers"]["decode"] == 1
    with urllib.request.urlopen(up.url + "/health_generate", timeout=30) as r:
        assert r.status == 200
    request = urllib.request.Request(up.url + "/model_info")  # no API key
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 401


# -- the native API's shapes, against fake workers ------------------------------------------


async def test_a_batch_is_answered_item_by_item(tokenizer: Tokenizer, script: list[int]) -> None:
    fake = worker(script)
    async with fake_cluster(tokenizer, [fake]) as client:
        r = await client.post(
            "/generate",
            json={"text": ["Hi", "Hello there"], "sampling_params": {"max_new_tokens": 2}},
        )
        answers = r.json()
        assert [a["text"] for a in answers] == ["Hello world", "Hello world"]
        assert [a["meta_info"]["prompt_tokens"] for a in answers] == [
            len(tokenizer.encode("Hi")),
            len(tokenizer.encode("Hello there")),
        ]
        assert len({a["meta_info"]["id"] for a in answers}) == 2
        r = await client.post(
            "/generate",
            json={
                "input_ids": [[5, 6], [7]],
                "rid": ["a", "b"],
                "sampling_params": {"max_new_tokens": 2},
                "stream": True,
            },
        )
        chunks = events(r.text)[:-1]
        last = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"]}
        assert {i: c["meta_info"]["id"] for i, c in last.items()} == {0: "a", 1: "b"}
        assert all(c["output_ids"] == script[:2] for c in last.values())


async def test_max_new_tokens_zero_computes_the_prompt_and_returns_no_token(
    tokenizer: Tokenizer, script: list[int]
) -> None:
    fake = worker(script)
    async with fake_cluster(tokenizer, [fake]) as client:
        r = await client.post(
            "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 0}}
        )
        body = r.json()
        assert (body["text"], body["output_ids"]) == ("", [])
        meta = body["meta_info"]
        assert meta["completion_tokens"] == 0
        assert meta["finish_reason"] == {"type": "length", "length": 0}
        assert list(fake.requests[0].input_ids) == tokenizer.encode("Hi")  # computed
        assert fake.requests[0].sampling.max_new_tokens == 1  # its one token left out


async def test_logprobs_carry_token_texts_when_asked(
    tokenizer: Tokenizer, script: list[int]
) -> None:
    async with fake_cluster(tokenizer, [worker(script)]) as client:
        asked = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}
        plain = (await client.post("/generate", json=asked)).json()["meta_info"]
        assert plain["output_token_logprobs"] == [[-0.5, t, None] for t in script[:2]]
        assert plain["input_token_logprobs"] == []  # logprob_start_len -1: none
        texts = (
            await client.post("/generate", json={**asked, "return_text_in_logprobs": True})
        ).json()["meta_info"]
        words = [tokenizer.decode([t]) for t in script[:2]]
        assert texts["output_token_logprobs"] == [
            [-0.5, t, w] for t, w in zip(script[:2], words, strict=True)
        ]


async def test_special_tokens_stay_in_the_text_when_asked(tokenizer: Tokenizer) -> None:
    start = tokenizer.hf.convert_tokens_to_ids("<|begin_of_text|>")
    end = tokenizer.hf.convert_tokens_to_ids("<|end_of_text|>")
    hello = tokenizer.encode("Hello", add_special_tokens=False)
    async with fake_cluster(tokenizer, [worker([start, *hello, end])]) as client:
        body = {"input_ids": [5], "sampling_params": {"max_new_tokens": 8}}
        skipped = (await client.post("/generate", json=body)).json()
        assert skipped["text"] == "Hello"
        body["sampling_params"] |= {
            "skip_special_tokens": False,
            "spaces_between_special_tokens": True,
        }
        kept = (await client.post("/generate", json=body)).json()
        # the end token stops the generation and, as in SGLang, is trimmed from the text
        assert kept["text"] == "<|begin_of_text|>Hello"
        assert kept["output_ids"][-1] == end


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text": "x", "sampling_params": {"stop_regex": "a+"}}, "sampling_params.stop_regex"),
        ({"text": ["x", "y"], "rid": "one"}, "rid"),
        ({"text": "x", "rid": ["a"]}, "rid"),
        ({"text": []}, "text"),
        ({"input_ids": [[1], []]}, "input_ids"),
        ({"text": "x", "return_logprob": True, "logprob_start_len": 99}, "logprob_start_len"),
        ({"text": "x", "image_data": "a.png"}, "image_data"),
        ({"text": "x", "sampling_params": {"skip_special_tokens": 1}}, None),
        (
            {"text": "x", "sampling_params": {"stop_token_ids": ["a"]}},
            "sampling_params.stop_token_ids",
        ),
        ({"text": "x", "sampling_params": {"stop": ["a", 1]}}, "sampling_params.stop"),
        (
            {"text": "x", "sampling_params": {"max_new_tokens": 1, "min_new_tokens": 2}},
            "sampling_params.min_new_tokens",
        ),
    ],
)
async def test_what_cannot_be_honoured_is_a_400(
    tokenizer: Tokenizer, script: list[int], body: dict[str, Any], param: str | None
) -> None:
    async with fake_cluster(tokenizer, [worker(script)]) as client:
        r = await client.post("/generate", json=body)
        assert r.status_code == 400, r.text
        if param is not None:
            assert r.json()["error"]["param"] == param


async def test_stop_regex_null_is_no_stop_regex(tokenizer: Tokenizer, script: list[int]) -> None:
    async with fake_cluster(tokenizer, [worker(script)]) as client:
        params = {"max_new_tokens": 2, "stop_regex": None, "n": 1, "stop": [], "top_k": -1}
        r = await client.post("/generate", json={"text": "x", "sampling_params": params})
        assert r.status_code == 200 and r.json()["text"] == "Hello world"


async def test_the_finish_names_what_matched(tokenizer: Tokenizer, script: list[int]) -> None:
    end = sorted(tokenizer.eos_token_ids)[0]
    async with fake_cluster(tokenizer, [worker([*script[:3], end])]) as client:
        params: dict[str, Any] = {"max_new_tokens": 8, "stop": ["world"]}
        body = await client.post("/generate", json={"text": "x", "sampling_params": params})
        assert body.json()["text"] == "Hello "
        assert body.json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": "world"}
        params["stop"] = []
        body = await client.post("/generate", json={"text": "x", "sampling_params": params})
        assert body.json()["output_ids"] == [*script[:3], end]  # the stop token, not its text
        assert body.json()["text"] == tokenizer.decode(script[:3])
        assert body.json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": end}


async def test_model_info_and_health_generate(tokenizer: Tokenizer, script: list[int]) -> None:
    fake = worker(script)
    async with fake_cluster(tokenizer, [fake]) as client:
        for path in ("/get_model_info", "/model_info"):
            info = (await client.get(path)).json()
            assert info["model_path"].endswith("tiny-llama-v1") and info["is_generation"]
        for path in ("/get_server_info", "/server_info"):
            assert (await client.get(path)).json()["worker_ids"] == ["w0"]
        assert (await client.get("/health_generate")).status_code == 200
        assert list(fake.requests[-1].input_ids) == [0]
        assert fake.requests[-1].sampling.max_new_tokens == 1
    broken = FakeWorker("w1", pb.BOTH, FakeBehavior(script=script, fail="at_start"))
    async with fake_cluster(tokenizer, [broken]) as client:
        r = await client.get("/health_generate")
        assert r.status_code == 503 and r.json()["status"] == "unhealthy"
        metrics = await client.get("/metrics")
        assert answered(metrics, "/health_generate", 503) == 1
    async with fake_cluster(tokenizer, []) as client:
        assert (await client.get("/health_generate")).status_code == 503


async def test_a_router_whose_slots_are_taken_is_healthy_at_once(
    tokenizer: Tokenizer, script: list[int]
) -> None:
    slow = worker(script, first_delay=3.0)
    async with fake_cluster(tokenizer, [slow], max_concurrent_requests=1) as client:
        body = {"text": "x", "sampling_params": {"max_new_tokens": 1}}
        running = asyncio.ensure_future(client.post("/generate", json=body))
        await eventually(lambda: len(slow.requests) == 1)
        started = time.monotonic()
        r = await client.get("/health_generate")
        assert r.status_code == 200 and r.json()["status"] == "busy"
        assert time.monotonic() - started < 1.0 and len(slow.requests) == 1  # no probe
        assert (await running).status_code == 200
