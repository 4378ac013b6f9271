"""The cluster's own measurements, for placement: each worker's step-time lines, fitted
from the cumulative step counts in its load reports, its decode step now, and the KV
transfer rate.

A worker's load (pb.Load, with every heartbeat) carries cumulative counts of its steps
(`common/step_times.py`). Between two reports, the mean step of each kind (its tokens,
attention pairs and seconds) is one sample of its line, weighted by its number of steps:
means of a linear relation lie on the same line (the attention term is linear in pairs;
a decode step's pairs are its rows' contexts). The mean decode step of the latest interval
that had any is the worker's decode step *now* (`DecodeNow`): at its batch and contexts
as they are, where a line fitted over minutes of smaller batches may lag far behind.
Counts that go down belong to a restarted worker: they start a new baseline. The
transfer rate is the bytes prefill workers sent over the seconds their transfer threads
spent sending them, with the same forgetting as the lines. A worker that reports its own
fit of its prompt steps (step by step: the spread of step sizes that tells a token's cost
from a step's, which means over a second of steps lose) is predicted by that line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from baton.common.rpc import baton_pb2 as pb
from baton.common.step_times import Line, LinearFit

_DECAY = 0.9  # per load report (about one a second): the rate follows the last ~10 s


@dataclass(frozen=True)
class DecodeNow:
    """A worker's mean decode step over its latest report interval."""

    seconds: float
    rows: float
    pairs: float  # its rows' contexts, summed


@dataclass
class _Worker:
    last: pb.StepTimes
    prefill: LinearFit = field(default_factory=LinearFit)
    decode: LinearFit = field(default_factory=LinearFit)
    decode_now: DecodeNow | None = None
    own_prefill: Line | None = None  # the worker's own fit of its prompt steps, as reported
    bytes_sent: float = 0.0
    send_seconds: float = 0.0


class ClusterMeter:
    def __init__(self) -> None:
        self._workers: dict[str, _Worker] = {}
        self._bytes = 0.0  # decayed sums over every prefill worker's reports
        self._seconds = 0.0

    def observe(self, worker_id: str, load: pb.Load) -> None:
        now = load.step_times
        known = self._workers.get(worker_id)
        if known is None or _went_down(now, known.last):
            known = self._workers[worker_id] = _Worker(pb.StepTimes())
            known.last.CopyFrom(now)
            known.bytes_sent, known.send_seconds = load.kv_bytes_sent, load.kv_send_seconds
            return
        was = known.last
        if now.prefill_slope > 0:
            known.own_prefill = Line(
                now.prefill_intercept, now.prefill_slope, now.prefill_attention
            )
        _sample(
            known.prefill,
            now.prefill_steps - was.prefill_steps,
            now.prefill_tokens - was.prefill_tokens,
            now.prefill_seconds - was.prefill_seconds,
            now.prefill_pairs - was.prefill_pairs,
        )
        steps = now.decode_steps - was.decode_steps
        rows, pairs = now.decode_rows - was.decode_rows, now.decode_pairs - was.decode_pairs
        seconds = now.decode_seconds - was.decode_seconds
        _sample(known.decode, steps, rows, seconds, pairs)
        if steps > 0 and seconds >= 0:
            known.decode_now = DecodeNow(seconds / steps, rows / steps, max(0.0, pairs) / steps)
        known.last.CopyFrom(now)
        sent = load.kv_bytes_sent - known.bytes_sent
        seconds = load.kv_send_seconds - known.send_seconds
        known.bytes_sent, known.send_seconds = load.kv_bytes_sent, load.kv_send_seconds
        if sent > 0 and seconds > 0:
            self._bytes = self._bytes * _DECAY + sent
            self._seconds = self._seconds * _DECAY + seconds

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def lines(self, worker_id: str) -> tuple[Line | None, Line | None]:
        """(prefill, decode) lines of the worker; None where it has no sample yet. Its
        prompt-step line is its own fit where it reports one (step by step, as a decode
        worker sizes its own chunks by it), else the fit here of its reports' means."""
        known = self._workers.get(worker_id)
        if known is None:
            return None, None
        return known.own_prefill or _line(known.prefill), _line(known.decode)

    def decode_now(self, worker_id: str) -> DecodeNow | None:
        """The worker's latest mean decode step; None before two reports with decode steps."""
        known = self._workers.get(worker_id)
        return known.decode_now if known is not None else None

    @property
    def transfer_rate(self) -> float | None:
        """Bytes per second of KV sent; None before any transfer was measured."""
        return self._bytes / self._seconds if self._seconds > 0 else None


def _sample(fit: LinearFit, steps: float, size: float, seconds: float, pairs: float = 0.0) -> None:
    if steps > 0 and seconds >= 0:
        fit.add(size / steps, seconds / steps, weight=steps, pairs=max(0.0, pairs) / steps)


def _line(fit: LinearFit) -> Line | None:
    return fit.line() if fit.ready else None


def _went_down(now: pb.StepTimes, was: pb.StepTimes) -> bool:
    return now.prefill_steps < was.prefill_steps or now.decode_steps < was.decode_steps


def bytes_per_token(layout: pb.KVLayout) -> float:
    """KV bytes of one token (K and V, every layer and head) in the layout's dtype."""
    width = _DTYPE_BYTES.get(layout.dtype, 2)
    return 2.0 * layout.num_layers * layout.num_kv_heads * layout.head_dim * width


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
