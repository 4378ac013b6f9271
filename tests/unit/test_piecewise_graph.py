"""Steps with prompt rows in pieces between the layers' attentions (engine/piecewise_graph.py).

On a CPU the pieces run as plain functions over the runner's fixed buffers, in the order a
GPU replays their graphs: what these tests hold is the plumbing (padding to a captured
length, the buffers between pieces and attentions, the eager tail of the sampled rows).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from baton.common.engine import Engine
from baton.common.engine.piecewise_graph import PiecewiseGraphRunner
from baton.common.sampling import SamplingParams
from tests.conftest import random_prompts, staggered_outputs


def _attach(engine: Engine, max_tokens: int) -> list[tuple[int, int]]:
    """Give the engine's runner CPU pieces; returns (tokens, decode rows) of each step
    they ran."""
    runner = engine.scheduler.runner
    # scratch slot 0 is never written: without Triton the pieces store no KV (the eager
    # attention stores the step's real rows)
    pieces = PiecewiseGraphRunner(
        runner.model, runner.attn, 0, max_tokens, torch.device("cpu"), None
    )
    pieces.capture()
    seen: list[tuple[int, int]] = []
    run = pieces.run

    def counted(ids, batch, rows):  # type: ignore[no-untyped-def]
        seen.append((batch.num_tokens, batch.extend_lens_list.count(1)))
        return run(ids, batch, rows)

    pieces.run = counted  # type: ignore[method-assign]
    runner.piecewise_graphs = pieces
    return seen


@pytest.mark.parametrize("mixed", [False, True])
def test_steps_in_pieces_give_the_eager_tokens(tiny_model: Path, mixed: bool) -> None:
    """Prompt chunks (with a cached prefix after the first), several prompts in one step,
    and with --enable-mixed-chunk prompt chunks beside decode rows: padded to a captured
    length and run in pieces, the same greedy tokens as launched layer by layer."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    prompts = random_prompts([40, 9, 70, 33, 5], vocab=2000, seed=23)
    opts = dict(
        attention_backend="torch",
        enable_mixed_chunk=mixed,
        chunked_prefill_size=24,
        page_size=4,
        max_total_tokens=1024,
    )
    tokens = {}
    steps: list[tuple[int, int]] = []
    for name in ("eager", "pieces"):
        with Engine(tiny_model, **opts) as engine:
            if name == "pieces":
                steps = _attach(engine, 32)
            tokens[name] = staggered_outputs(engine, prompts, greedy)
            assert engine.all_pages_free()
    assert tokens["pieces"] == tokens["eager"]
    padded = [t for t, _ in steps if t not in (16, 32)]
    assert padded, "no step was padded to a captured length"
    if mixed:
        assert any(0 < decodes < t for t, decodes in steps), "no mixed step ran in pieces"


def test_a_step_longer_than_the_largest_piece_runs_eager(tiny_model: Path) -> None:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)
    with Engine(tiny_model, attention_backend="torch", max_total_tokens=1024) as engine:
        steps = _attach(engine, 32)
        engine.scheduler.add_request("long", random_prompts([40], vocab=2000)[0], greedy)
        while engine.scheduler.has_work():
            engine.scheduler.step()
    # the prompt's 40 tokens eager; its decode steps (no decode graphs on a CPU) in pieces
    assert steps == [(1, 1), (1, 1)]


def test_no_pieces_fit_zero_tokens(tiny_model: Path) -> None:
    with Engine(tiny_model, attention_backend="torch", max_total_tokens=1024) as engine:
        runner = engine.scheduler.runner
        with pytest.raises(ValueError, match="no piecewise graph fits 8 tokens"):
            PiecewiseGraphRunner(runner.model, runner.attn, 0, 8, torch.device("cpu"), None)


def test_prompt_logprobs_in_pieces_equal_the_eager_ones(tiny_model: Path) -> None:
    """A step that wants every prompt row's logits (prompt logprobs) runs in pieces too:
    its tail computes the rows it asks for."""
    params = SamplingParams(temperature=0.0, max_new_tokens=3, prompt_logprobs=2)
    prompt = random_prompts([21], vocab=2000, seed=31)[0]
    outs = {}
    for name in ("eager", "pieces"):
        with Engine(tiny_model, attention_backend="torch", max_total_tokens=1024) as engine:
            steps = _attach(engine, 32) if name == "pieces" else []
            outs[name] = engine.generate([prompt], params)[0]
    assert (21, 0) in steps  # the prompt's step, in pieces
    eager, pieces = outs["eager"], outs["pieces"]
    assert pieces.output_ids == eager.output_ids
    assert len(pieces.prompt_logprobs) == len(eager.prompt_logprobs) == 20  # all but the first
    for got, want in zip(pieces.prompt_logprobs, eager.prompt_logprobs, strict=True):
        assert got.token_id == want.token_id
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
