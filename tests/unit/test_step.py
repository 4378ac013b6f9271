"""The step as a value: a tensor-parallel follower uploads, from the message rank 0 sends,
the very batch rank 0 uploaded from the columns it built once."""

from __future__ import annotations

import numpy as np
import torch

from baton.common.engine.step import Step, StepColumns, input_ids
from baton.common.engine.tp_step import read_step_message, step_message, stop_message
from baton.common.sampling import SamplingParams
from baton.common.state import Req, ScheduledBatch, ScheduledItem

CPU = torch.device("cpu")


def request(rid: str, prompt: list[int], slot: int) -> Req:
    req = Req(rid, prompt, SamplingParams(max_new_tokens=4), 0, frozenset())
    req.slot = slot
    return req


def mixed_batch() -> ScheduledBatch:
    """A prompt chunk (numpy columns) and a decode row whose input is still being sampled."""
    prompt = request("p", list(range(10, 110)), slot=1)
    decoding = request("d", [5, 6, 7], slot=2)
    decoding.output_ids, decoding.in_flight, decoding.future = [8], 1, 3
    return ScheduledBatch(
        [
            ScheduledItem(prompt, 0, 100, True, np.arange(100, 200)),
            ScheduledItem(decoding, 4, 1, True, [300]),
        ]
    )


def test_a_follower_uploads_the_batch_rank_0_built() -> None:
    sb = mixed_batch()
    writes = [(1, 0, np.arange(100, 200)), (2, 4, range(300, 301))]
    columns = StepColumns.of(sb, writes, prompt_rows=[])
    ids, futures = input_ids(sb)
    assert futures and ids[-1] == -3 and list(ids[:100]) == list(range(10, 110))
    assert columns.logit_rows == [99, 100]  # each sampled request's last token
    table = torch.zeros(4, 256, dtype=torch.int64)
    batch, rows, (future_out,), ids_t = columns.upload(CPU, table, [[7, 8]], ids)
    step = Step(columns, ids_t, batch, rows, future_out, kv_scatter=[4], kv_gather=[5, 6])

    message = read_step_message(step_message(step, len(ids)))
    assert message is not None
    num_tokens, received, kv_scatter, kv_gather = message
    assert (num_tokens, kv_scatter, kv_gather) == (101, [4], [5, 6])
    follower, follower_rows, _, _ = received.upload(CPU, table)
    for name in ("positions", "out_cache_loc", "req_slots", "seq_lens", "extend_lens"):
        assert torch.equal(getattr(follower, name), getattr(batch, name)), name
    assert torch.equal(follower.prefix_lens, batch.prefix_lens)
    assert torch.equal(follower_rows, rows)
    assert follower.seq_lens_list == [100, 5] and follower.prefix_lens_list == [0, 4]
    assert [(r, s, list(v)) for r, s, v in received.table_writes] == [
        (1, 0, list(range(100, 200))),
        (2, 4, [300]),
    ]
    assert torch.equal(future_out, torch.tensor([7, 8]))


def test_rank_0_stopping_reads_as_no_step() -> None:
    assert read_step_message(stop_message()) is None
