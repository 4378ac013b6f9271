"""baton's frontend language: programs of prompts and generations, run against the
cluster (SGLang's frontend names, so its programs read the same here).

    from baton.lang import RuntimeEndpoint, assistant, function, gen, set_default_backend, user

    @function
    def qa(s, question):
        s += user(question)
        s += assistant(gen("answer", max_tokens=64))

    set_default_backend(RuntimeEndpoint("http://127.0.0.1:8000", api_key=...))
    print(qa.run(question="Why is the sky blue?")["answer"])

A client library: it needs only httpx and jinja2 (never torch, nor the rest of baton).
The guide is docs/LANG.md.
"""

from baton.lang.backend import Backend, Generation
from baton.lang.chat_template import ChatTemplate
from baton.lang.choices import (
    Decision,
    greedy_token_selection,
    token_length_normalized,
    total_logprob,
)
from baton.lang.endpoint import RuntimeEndpoint
from baton.lang.errors import EndpointError, ProgramError
from baton.lang.expr import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from baton.lang.program import Program, function, set_default_backend
from baton.lang.state import ProgramState, ProgramStateGroup

__all__ = [
    "Backend",
    "ChatTemplate",
    "Decision",
    "EndpointError",
    "Generation",
    "Program",
    "ProgramError",
    "ProgramState",
    "ProgramStateGroup",
    "RuntimeEndpoint",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "function",
    "gen",
    "greedy_token_selection",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "total_logprob",
    "user",
    "user_begin",
    "user_end",
]
