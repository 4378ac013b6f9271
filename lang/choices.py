"""How `select` decides: from each choice's token logprobs (after the prompt) to a pick.

A choices method is any callable `method(token_logprobs) -> Decision`, where
`token_logprobs[i]` lists the logprob of each token of choice i given the prompt and the
choice's earlier tokens. Ties go to the earlier choice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Decision:
    index: int  # the chosen choice
    scores: list[float]  # what the method compared, one per choice


ChoicesMethod = Callable[[Sequence[Sequence[float]]], Decision]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _first_best(keys: Sequence[object]) -> int:
    best = 0
    for i, key in enumerate(keys):
        if key > keys[best]:  # type: ignore[operator]
            best = i
    return best


def token_length_normalized(token_logprobs: Sequence[Sequence[float]]) -> Decision:
    """The highest mean token logprob (the default; SGLang's name). A long choice is not
    penalized for its length, but easy later tokens can carry a poor first one."""
    scores = [_mean(lps) for lps in token_logprobs]
    return Decision(_first_best(scores), scores)


def greedy_token_selection(token_logprobs: Sequence[Sequence[float]]) -> Decision:
    """The highest first-token logprob; ties go to the next tokens, where a shorter choice
    counts as continuing with its own mean (SGLang's name)."""
    longest = max(len(lps) for lps in token_logprobs)
    keys = [tuple(lps) + (_mean(lps),) * (longest - len(lps)) for lps in token_logprobs]
    return Decision(_first_best(keys), [lps[0] for lps in token_logprobs])


def total_logprob(token_logprobs: Sequence[Sequence[float]]) -> Decision:
    """The highest total logprob: the choice the model finds likeliest as a whole (favors
    short choices)."""
    scores = [float(sum(lps)) for lps in token_logprobs]
    return Decision(_first_best(scores), scores)
