"""The role seam: how a role (aggregated, prefill, decode) plugs into the scheduler.

A role hands the scheduler its `SchedulerHooks` when the scheduler is built, and drives
the scheduler only through the narrow `SchedulerPort`. The engine never reads the role:
every difference between roles is one of these hooks.

    role ── port: new_request / enqueue / reserve / join_running / finish / release ──▶ scheduler
    role ◀── hooks: chunk_computed / first_token / hand_off / kv_moves / keep_memory ── scheduler
                    / prefill_budget
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from baton.common.sampling import SamplingParams
from baton.common.state import FinishReason, Req, ScheduledBatch

if TYPE_CHECKING:
    import torch

    from baton.common.cache.manager import HeldMemory
    from baton.common.distributed.wire import KVWire
    from baton.common.engine.step_clock import StepBudget, StepClock


class SchedulerHooks:
    """Where a role changes the loop; the aggregated worker uses these defaults."""

    decodes_locally = True  # False: a request leaves once its first token is sampled
    kv_wire: KVWire | None = None  # TP: rank 0's full-head pages for the KV transfer

    def chunk_computed(
        self, req: Req, computed: int, last: bool, ready: torch.cuda.Event | None
    ) -> None:
        """The KV of `req`'s first `computed` tokens is in the pool once `ready` has fired
        (None: already). `last`: the prompt is complete."""

    def first_token(self, req: Req, reason: FinishReason | None) -> bool:
        """The first token was sampled; True takes the request away (the scheduler emits
        the token as the request's last output and forgets it without freeing its memory:
        the role releases it through the port)."""
        return False

    def hand_off(
        self, req: Req, reason: FinishReason | None, ready: torch.cuda.Event | None
    ) -> bool:
        """A token was sampled and appended (`reason`: why the request stops after it, None:
        it goes on); the KV of every token before it is in the pool once `ready` fired.
        True takes the request away as `first_token` does, its output ending with that
        token and finish reason "migrated" (a live migration to another worker)."""
        return False

    def kv_moves(self, batch: ScheduledBatch) -> tuple[list[int], list[int]]:
        """Pages to scatter into the ranks' pools before this step and to gather from them
        after it (tensor parallelism with KV transfer; see distributed.wire)."""
        return [], []

    def prefill_budget(self, running: Sequence[Req], clock: StepClock) -> StepBudget | None:
        """The bound on the next step's prompt tokens, chunked, with the `running` requests
        decoding in the same step; None: the engine's own budget and batching. `clock`
        holds the engine's step times."""
        return None

    def keep_memory(self, req: Req, held: HeldMemory) -> bool:
        """The scheduler is taking `req`'s memory away to recompute it (after a failed
        step, or a retraction for memory: then its computed full pages are in the prefix
        cache, held through `held.node`). True: the role keeps `held` (pages a transfer may
        still read) and releases it later through the port; False: the scheduler frees it
        now."""
        return False


class SchedulerPort(Protocol):
    """Everything a role may ask of the scheduler."""

    def new_request(
        self, rid: str, input_ids: list[int], sampling: SamplingParams, received_at: float = 0.0
    ) -> Req:
        """A validated request, not queued yet; an invalid one comes back finished.
        `received_at`: time.monotonic() when the worker got it, if known (`ingress`)."""

    def enqueue(self, req: Req) -> None:
        """Compute the request's prompt here (the prefill queue)."""

    def reserve(self, req: Req) -> bool:
        """Admit a request whose KV comes from elsewhere: a table row, its cached prefix
        and pages for every prompt token, if the KV budget (the decode reserve of running
        and reserved requests included) allows. False leaves `req` untouched."""

    def join_running(self, req: Req) -> None:
        """A reserved request whose KV and first token arrived starts decoding here."""

    def finish(self, req: Req, reason: FinishReason) -> None:
        """End the request (its memory is released, its final output emitted)."""

    def release(self, req: Req, cache: bool) -> None:
        """Free the memory of a request the role took away (idempotent)."""

    def take_memory(self, req: Req) -> HeldMemory | None:
        """Detach `req`'s memory (None if it holds none): `finish` then frees nothing, and
        the role frees the memory later with `release_held`."""

    def release_held(self, held: HeldMemory) -> None:
        """Free memory a role kept (`keep_memory`, `take_memory`)."""

    def abort(self, rid: str) -> bool: ...

    def withdraw(self, rid: str, reason: FinishReason) -> bool:
        """End request `rid` with `reason` if it still waits for its first prompt step
        (nothing of it computed); False once it started, ended, or is not here."""

    def fail_all(self, reason: str) -> None:
        """Fail every request the scheduler holds."""
