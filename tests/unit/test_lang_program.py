"""baton.lang's programs against a fake backend: statements, roles, select, fork/join,
streaming, batches, and errors that name the statement. (Against a real cluster:
tests/integration/test_lang_cluster.py.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from baton.lang import (
    Backend,
    ChatTemplate,
    EndpointError,
    Generation,
    ProgramError,
    assistant,
    function,
    gen,
    greedy_token_selection,
    select,
    system,
    user,
)

CHATML = ChatTemplate(
    prefix={r: f"<|im_start|>{r}\n" for r in ("system", "user", "assistant")},
    suffix={r: "<|im_end|>\n" for r in ("system", "user", "assistant")},
    start={"system": "<s><|im_start|>system\n", "user": "<s><|im_start|>user\n"},
)


class FakeBackend(Backend):
    """Answers `reply(prompt, sampling)`, streamed word by word; records what it was asked."""

    def __init__(
        self,
        reply: Callable[[str, dict[str, Any]], str] = lambda prompt, sampling: "fine",
        delay: float = 0.0,
        logprobs: dict[str, list[float]] | None = None,
    ) -> None:
        self.reply = reply
        self.delay = delay
        self.logprobs = logprobs or {}
        self.lock = threading.Lock()
        self.prompts: list[str] = []
        self.samplings: list[dict[str, Any]] = []
        self.cached: list[str] = []
        self.intervals: list[tuple[float, float]] = []

    def generate(
        self,
        text: str,
        sampling: dict[str, Any],
        on_text: Callable[[str], None] | None = None,
    ) -> Generation:
        start = time.monotonic()
        answer = self.reply(text, sampling)
        time.sleep(self.delay)
        if on_text is not None:
            for i, word in enumerate(answer.split(" ")):
                on_text(word if i == 0 else " " + word)
                time.sleep(0.001)
        with self.lock:
            self.prompts.append(text)
            self.samplings.append(sampling)
            self.intervals.append((start, time.monotonic()))
        return Generation(answer, {"finish_reason": {"type": "stop"}, "cached_tokens": 3})

    def choice_logprobs(self, text: str, choices: Sequence[str]) -> list[list[float]]:
        return [self.logprobs[c] for c in choices]

    def cache_prefix(self, text: str) -> None:
        with self.lock:
            self.cached.append(text)

    def chat_template(self) -> ChatTemplate:
        return CHATML


def test_importable_without_torch() -> None:
    code = textwrap.dedent(
        """
        import sys
        for blocked in ("torch", "transformers", "numpy"):
            sys.modules[blocked] = None  # `import torch` now raises ImportError
        import baton.lang
        from baton.lang import RuntimeEndpoint, function, gen, select
        loaded = sorted(m for m in sys.modules if m.startswith("baton.") and
                        not m.startswith("baton.lang"))
        assert not loaded, loaded
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_gen_appends_to_the_text_and_sets_its_variable() -> None:
    backend = FakeBackend(lambda prompt, sampling: "Paris")

    @function
    def capital(s: Any, country: str) -> None:
        s += f"The capital of {country} is " + gen("city", stop="\n", temperature=0)
        s += "."

    state = capital.run(country="France", backend=backend, max_new_tokens=8, top_p=0.9)
    assert state.text() == "The capital of France is Paris."
    assert state["city"] == "Paris"
    assert state.get_meta_info("city")["cached_tokens"] == 3
    assert backend.prompts == ["The capital of France is "]
    # the gen's own params win over the run's defaults; unset ones are not sent
    assert backend.samplings == [
        {"max_new_tokens": 8, "top_p": 0.9, "stop": ["\n"], "temperature": 0}
    ]


def test_role_blocks_render_the_chat_template_and_record_messages() -> None:
    backend = FakeBackend(lambda prompt, sampling: f"answer {prompt.count('user')}")

    @function
    def chat(s: Any) -> None:
        s += system("Be brief.")
        s += user("Hi")
        s += assistant(gen("first"))
        s += user("Again")
        s += assistant(gen("second"))

    state = chat.run(backend=backend)
    assert state.text() == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nanswer 1<|im_end|>\n"
        "<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\nanswer 2<|im_end|>\n"
    )
    assert backend.prompts[0].endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert state.messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "answer 1"},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "answer 2"},
    ]


def test_select_picks_by_the_choices_method() -> None:
    # "yes": one sure token; "no way": a poor first token, then a sure one
    backend = FakeBackend(logprobs={"yes": [-1.0], "no way": [-1.5, -0.1]})

    @function
    def ask(s: Any, method: Any) -> None:
        s += "Sure? " + select("answer", ["yes", "no way"], choices_method=method)

    from baton.lang import token_length_normalized

    state = ask.run(method=token_length_normalized, backend=backend)
    assert state["answer"] == "no way"  # mean -0.8 beats -1.0
    assert state.text() == "Sure? no way"
    assert state.get_meta_info("answer")["scores"] == pytest.approx([-1.0, -0.8])
    assert ask.run(method=greedy_token_selection, backend=backend)["answer"] == "yes"


def test_select_refuses_empty_choices() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        select("x", [])
    with pytest.raises(ValueError, match="non-empty strings"):
        select("x", ["a", ""])


def test_fork_branches_run_concurrently_from_one_cached_prefix() -> None:
    backend = FakeBackend(lambda prompt, sampling: prompt.split()[-1] * 2, delay=0.3)

    @function
    def tips(s: Any) -> None:
        s += "Two tips:"
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f" tip{i} " + gen("tip")
        forks.join()
        s += " done"

    began = time.monotonic()
    state = tips.run(backend=backend)
    elapsed = time.monotonic() - began
    assert state["tip"] == ["tip0tip0", "tip1tip1", "tip2tip2"]
    assert state.text() == "Two tips: done"
    assert backend.cached == ["Two tips:"]  # the shared prefix, computed once
    starts, ends = zip(*backend.intervals, strict=True)
    assert max(starts) < min(ends), "the branches' requests did not overlap"
    assert elapsed < 0.3 * 3, f"three branches of 0.3 s took {elapsed:.2f} s"


def test_join_can_append_the_branches_text() -> None:
    backend = FakeBackend(lambda prompt, sampling: "x")

    @function
    def prog(s: Any) -> None:
        s += "A"
        forks = s.fork(2)
        forks += "-" + gen("g")
        forks.join("concate_and_append")

    assert prog.run(backend=backend).text() == "A-x-x"


def test_a_failed_request_names_the_statement_and_carries_the_servers_message() -> None:
    def reply(prompt: str, sampling: dict[str, Any]) -> str:
        if "regex" in sampling:
            raise EndpointError(
                "POST /generate", "regex: unbalanced parenthesis", 400, param="regex"
            )
        return "ok"

    backend = FakeBackend(reply)
    after: list[str] = []

    @function
    def prog(s: Any) -> None:
        s += "Code: " + gen("code", regex="(", max_tokens=4)
        s += gen("more")  # not run: the state stopped at the failure
        after.append(s["more"])

    with pytest.raises(ProgramError) as info:
        prog.run(backend=backend)
    message = str(info.value)
    assert "prog: 'Code: ' + gen('code', max_tokens=4, regex='(')" in message
    assert "test_lang_program.py:" in message
    assert "400 error (param regex): regex: unbalanced parenthesis" in message
    assert isinstance(info.value.cause, EndpointError)
    assert after == [] and len(backend.prompts) == 0


def test_run_batch_returns_states_in_input_order() -> None:
    backend = FakeBackend(lambda prompt, sampling: prompt.upper(), delay=0.05)

    @function
    def shout(s: Any, word: str) -> None:
        s += word + gen("loud")

    words = [f"w{i}" for i in range(8)]
    states = shout.run_batch([{"word": w} for w in words], backend=backend, num_threads=4)
    assert [s["loud"] for s in states] == [w.upper() for w in words]


def test_run_batch_names_the_failed_input() -> None:
    def reply(prompt: str, sampling: dict[str, Any]) -> str:
        if prompt == "bad":
            raise EndpointError("POST /generate", "no", 400)
        return "ok"

    @function
    def prog(s: Any, text: str) -> None:
        s += text + gen("g")

    batch = [{"text": "good"}, {"text": "bad"}]
    with pytest.raises(ProgramError, match=r"^prog\[1\]: "):
        prog.run_batch(batch, backend=FakeBackend(reply))


def test_stream_yields_text_as_it_is_generated() -> None:
    backend = FakeBackend(lambda prompt, sampling: "one two three four")

    @function
    def story(s: Any) -> None:
        s += "Once: " + gen("story")
        s += " End."

    state = story.run(backend=backend, stream=True)
    pieces = list(state.text_iter())
    assert pieces == ["Once: ", "one", " two", " three", " four", " End."]
    assert list(state.text_iter("story")) == ["one", " two", " three", " four"]
    assert state.text() == "Once: one two three four End."
    assert state["story"] == "one two three four"


def test_a_streamed_programs_failure_reaches_the_reader() -> None:
    def reply(prompt: str, sampling: dict[str, Any]) -> str:
        raise EndpointError("POST /generate", "overloaded", 503)

    @function
    def prog(s: Any) -> None:
        s += "x" + gen("g")

    state = prog.run(backend=FakeBackend(reply), stream=True)
    with pytest.raises(ProgramError, match="overloaded"):
        list(state.text_iter())
    with pytest.raises(ProgramError, match="overloaded"):
        state.text()


def test_arguments_are_checked_before_anything_runs() -> None:
    backend = FakeBackend()

    @function
    def prog(s: Any, question: str) -> None:
        s += question + gen("a")

    with pytest.raises(TypeError, match="question"):
        prog.run(backend=backend)
    assert backend.prompts == []
    with pytest.raises(KeyError, match="'nope'"):
        prog.run(question="q", backend=backend)["nope"]


def test_a_role_block_cannot_open_inside_another() -> None:
    @function
    def prog(s: Any) -> None:
        s += user("a" + assistant("b"))

    with pytest.raises(ProgramError, match="cannot start inside the open user"):
        prog.run(backend=FakeBackend())
