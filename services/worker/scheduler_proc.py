"""The scheduler process of a worker: owns the engine, talks to the frontend over ZMQ IPC.

Loop: receive (block only when idle) → role queues advance → one scheduler step → send
this step's outputs as one message. The process entry point starts the tensor-parallel
followers, then the scheduler with its role plugged in (`baton.common.disagg.start.start_role`).
A failed step fails no innocent request; an engine that cannot go on fails what it holds
and the process exits non-zero.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

import msgspec
import zmq

from baton.common.config import EngineConfig, ModelConfig
from baton.common.engine.recovery import FatalEngineError
from baton.common.engine.scheduler import Scheduler
from baton.common.engine.tp import stop_followers
from baton.common.protocol import (
    AbortReq,
    ConnectOut,
    ConnectReq,
    FlushCacheOut,
    FlushCacheReq,
    GenerateReq,
    KVEventsOut,
    MigrateOut,
    MigrateReq,
    OutputBatch,
    PeerLostReq,
    ReadyOut,
    ShutdownReq,
    SpansOut,
    SwitchRoleOut,
    SwitchRoleReq,
    TokenOut,
    decode_to_scheduler,
    encode,
)
from baton.common.state import Req, TokenLogprob
from baton.services.worker.config import SchedulerProcArgs
from baton.services.worker.stats import stats_message

if TYPE_CHECKING:
    from baton.common.attention.prebuild import Prebuild
    from baton.common.disagg.aggregated_role import Role

log = logging.getLogger("baton.scheduler")

STATS_INTERVAL = 0.25
# The scheduler thread is busy in Python most of the time; the KV transfer threads (control
# messages, page copies) must still get the GIL within a fraction of a millisecond, not
# after CPython's default 5 ms switch interval.
GIL_SWITCH_INTERVAL_S = 0.0005
CONNECT_WAIT_S = 10.0  # a ConnectReq is answered by then (the frontend waits 4.5 s)
# (transfer address, its connections opening or None, answer by then)
Connecting = tuple[str, "Future[None] | None", float]


class OutputCollector:
    """Collects one step's outputs, to send them as a single message. A request's timings
    are taken with the message that carries its finish, and its first token's `emit` stamp
    when the message that carries it is taken (just before it is sent)."""

    def __init__(self) -> None:
        self.items: dict[str, TokenOut] = {}
        self.spans: list[SpansOut] = []  # of traced requests that finished
        self._first: list[Req] = []  # requests whose first token is among the items
        self._finished: list[tuple[TokenOut, Req]] = []

    def __call__(
        self, req: Req, tokens: list[int], lps: list[TokenLogprob], finished: bool
    ) -> None:
        out = self.items.get(req.rid)
        if out is None:
            out = self.items[req.rid] = TokenOut(req.rid, [], [])
        out.token_ids.extend(tokens)
        out.logprobs.extend(lps)
        if tokens and len(req.output_ids) == 1:
            self._first.append(req)
            if req.prompt_logprobs:
                # with the first token (on P in PD, which returns it to the router)
                out.prompt_logprobs = list(req.prompt_logprobs)
        out.completion_tokens = len(req.output_ids)
        if finished:
            out.finished = True
            out.finish_reason = req.finish_reason.value if req.finish_reason else ""
            out.error = req.error
            out.prompt_tokens = len(req.input_ids)
            out.cached_tokens = req.prefix_hit_tokens
            self._finished.append((out, req))
            if req.trace is not None:
                self.spans.append(SpansOut(req.rid, req.trace.traceparent, req.trace.take()))

    def take(self) -> list[TokenOut]:
        now = time.monotonic()
        for req in self._first:
            req.times["first_token_sent"] = now
        for out, req in self._finished:
            out.timings = request_timings(req)
        self._first.clear()
        self._finished.clear()
        items = list(self.items.values())
        self.items.clear()
        return items

    def take_spans(self) -> list[SpansOut]:
        spans, self.spans = self.spans, []
        return spans


def request_timings(req: Req) -> dict[str, float]:
    """Seconds per phase on this worker: `ingress` (the frontend got the request → the
    scheduler took it off its socket, which it does between steps), `queue`, `prefill`
    (to the first token's stamp, once its step's results are processed) and `emit` (that
    stamp → its message taken to be sent), then the transfer's phases."""
    t = req.times
    out = {}
    if "received" in t:
        out["ingress"] = max(0.0, t["arrival"] - t["received"])
    if "admitted" in t:
        out["queue"] = t["admitted"] - t["arrival"]
    if "first_token" in t and "admitted" in t:
        out["prefill"] = t["first_token"] - t["admitted"]
    if "first_token_sent" in t and "first_token" in t:
        out["emit"] = t["first_token_sent"] - t["first_token"]
    for key in ("kv_transfer", "decode_admission"):
        if key in t:
            out[key] = t[key]
    return out


def prebuild_kernels(cfg: EngineConfig, model_cfg: ModelConfig) -> Prebuild | None:
    """Start compiling flashinfer's prefill kernels in a child process, where it serves
    them, before anything else (`common/attention/prebuild.py`)."""
    prefill_backend = cfg.prefill_attention_backend or cfg.attention_backend
    if not cfg.device.startswith("cuda") or prefill_backend != "flashinfer":
        return None
    from baton.common.attention.prebuild import start_flashinfer_prebuild

    return start_flashinfer_prebuild(model_cfg.head_dim, cfg.dtype, cfg.device)


def run(args: SchedulerProcArgs) -> None:
    started = time.monotonic()
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s scheduler: %(message)s"
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend decides when we stop
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.connect(args.to_scheduler)
    send = ctx.socket(zmq.PUSH)
    send.connect(args.from_scheduler)
    followers: list = []
    prebuild: Prebuild | None = None
    try:
        from baton.common.disagg.start import start_role
        from baton.common.engine.process import GcPauses, freeze_heap
        from baton.common.engine.tp import start_followers
        from baton.services.worker.warm_up import warm_up

        model_cfg = ModelConfig.from_pretrained(args.engine.model_path)
        prebuild = prebuild_kernels(args.engine, model_cfg)
        collector = OutputCollector()
        followers = start_followers(args.engine, model_cfg)
        scheduler, handler = start_role(
            args.engine.role, args.engine, model_cfg, collector, args.transfer
        )
        if args.engine.device.startswith("cuda"):
            built = set[str]()
            if prebuild is not None:
                prebuild.wait()
                built = prebuild.compiled()
            warm_up(scheduler, collector)
            if prebuild is not None and (missed := prebuild.unexpected(built)):
                log.warning("the warm-up compiled flashinfer modules not prebuilt: %s", missed)
        radix = scheduler.cache.radix if args.kv_events else None
        if radix is not None:
            radix.publish_events()  # after the warm-up, which leaves nothing cached
        freeze_heap()
        gc_pauses = GcPauses().start()  # reported with the stats
    except Exception as e:  # report start-up failures to the frontend, then exit
        log.exception("scheduler failed to start")
        if prebuild is not None:
            prebuild.stop()
        send.send(encode(ReadyOut(error=f"{type(e).__name__}: {e}")))
        send.close(linger=1000)
        return
    send.send(
        encode(
            ReadyOut(handler.kv_control_address, handler.transfer_address, scheduler.cfg.num_pages)
        )
    )
    log.info(
        "scheduler ready (pid %d, role %s) %.1f s after its start",
        os.getpid(),
        args.engine.role,
        time.monotonic() - started,
    )
    last_stats = 0.0
    poller = zmq.Poller()
    poller.register(recv, zmq.POLLIN)
    running = True
    exit_code = 0
    parent = os.getppid()
    role = args.engine.role
    switch: tuple[SwitchRoleReq, float] | None = None  # asked for, and until when to wait
    connecting: list[Connecting] = []  # ConnectReqs not answered yet
    while running:
        busy = scheduler.has_work() or handler.has_work()
        timeout = 0 if scheduler.has_work() else (1 if handler.has_work() or connecting else 50)
        if dict(poller.poll(timeout)).get(recv):
            while True:
                try:
                    raw = recv.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    msg = decode_to_scheduler(raw)
                except msgspec.DecodeError as e:
                    log.warning("dropped a malformed message: %s", e)
                    continue
                if isinstance(msg, GenerateReq):
                    handler.on_generate(msg)
                elif isinstance(msg, AbortReq):
                    handler.on_abort(msg.rid)
                elif isinstance(msg, MigrateReq):
                    refused = handler.on_migrate(msg)
                    send.send(encode(MigrateOut(msg.room, refused or "")))
                elif isinstance(msg, ConnectReq):
                    opening = handler.connect(msg.peer)  # (None: it hands nothing off)
                    deadline = time.monotonic() + CONNECT_WAIT_S
                    connecting.append((msg.peer.transfer_address, opening, deadline))
                elif isinstance(msg, PeerLostReq):
                    handler.on_peer_lost(msg.kv_control_address)
                elif isinstance(msg, FlushCacheReq):
                    send.send(encode(flush_cache(scheduler, handler.has_work())))
                elif isinstance(msg, SwitchRoleReq):
                    switch = msg, time.monotonic() + msg.timeout
                elif isinstance(msg, ShutdownReq):
                    running = False
        try:
            handler.poll()
            if scheduler.has_work():
                scheduler.step()  # a failed step fails no innocent request (recovery)
            handler.poll()
        except FatalEngineError as e:
            log.critical("the engine cannot go on: %s; failing its requests and exiting", e)
            handler.fail_all(f"the worker failed: {e}")
            send.send(encode(OutputBatch(collector.take())))
            exit_code = 1
            break
        except Exception:
            log.exception("role queues failed; failing the requests")
            handler.fail_all("internal error in the worker")
        if radix is not None and (events := radix.take_events()):
            # before the outputs: a client's next turn finds its prefix already indexed
            send.send(encode(KVEventsOut(time.time(), events)))
        if (late := handler.take_spans()) is not None:
            collector.spans += late
        if collector.items or collector.spans:
            send.send(encode(OutputBatch(collector.take(), collector.take_spans())))
        if connecting:
            connecting = answer_connects(connecting, send, time.monotonic())
        if switch is not None:
            idle = not (scheduler.has_work() or handler.has_work() or scheduler.requests)
            if idle or time.monotonic() > switch[1]:
                out = SwitchRoleOut(role, error="requests or rooms outlasted the wait")
                if idle:
                    handler, out = switch_role_now(
                        scheduler, handler, role, switch[0], model_cfg, args
                    )
                role = out.role
                send.send(encode(out))
                switch = None
        now = time.monotonic()
        if now - last_stats > STATS_INTERVAL or (not busy and now - last_stats > 0.05):
            send.send(encode(stats_message(scheduler, handler.stats(), gc_pauses.take())))
            last_stats = now
            if os.getppid() != parent:
                log.error("the worker frontend died; the scheduler exits")
                break
    handler.shutdown()
    scheduler.shutdown()
    stop_followers(followers)
    send.close(linger=1000)
    recv.close(linger=0)
    ctx.term()
    if exit_code:
        sys.exit(exit_code)


def answer_connects(
    pending: list[Connecting], send: zmq.Socket[bytes], now: float
) -> list[Connecting]:
    """Answer each `ConnectReq` whose connections opened or failed, or that waited past
    its deadline (time.monotonic(); its lanes connect on regardless); those still opening
    (while there are any, the loop polls every millisecond)."""
    left: list[Connecting] = []
    for address, opening, deadline in pending:
        if opening is None:
            send.send(encode(ConnectOut(address, "this worker hands no request off")))
        elif not opening.done() and now < deadline:
            left.append((address, opening, deadline))
        elif not opening.done():
            send.send(encode(ConnectOut(address, "still connecting")))
        elif (error := opening.exception()) is not None:
            send.send(encode(ConnectOut(address, str(error) or type(error).__name__)))
        else:
            send.send(encode(ConnectOut(address)))
    return left


def switch_role_now(
    scheduler: Scheduler,
    handler: Role,
    role: str,
    msg: SwitchRoleReq,
    model_cfg: ModelConfig,
    args: SchedulerProcArgs,
) -> tuple[Role, SwitchRoleOut]:
    """The idle scheduler's role changed to `msg.role` (or kept, and why), and the answer."""
    from baton.common.disagg.start import switch_role

    if msg.role == role:
        return handler, SwitchRoleOut(role, handler.kv_control_address, handler.transfer_address)
    try:
        handler, error = switch_role(scheduler, handler, role, msg.role, model_cfg, args.transfer)
    except ValueError as e:
        return handler, SwitchRoleOut(role, error=str(e))
    now = role if error else msg.role
    if error:
        log.error("role change %s -> %s failed: %s", role, msg.role, error)
    else:
        log.info("role changed in place: %s -> %s", role, msg.role)
    return handler, SwitchRoleOut(now, handler.kv_control_address, handler.transfer_address, error)


def flush_cache(scheduler: Scheduler, role_busy: bool) -> FlushCacheOut:
    """Empty the prefix cache; refused while any request is running or queued (their
    pages are locked in it)."""
    if role_busy or scheduler.has_work() or scheduler.requests:
        return FlushCacheOut(False, "requests are running or queued")
    radix = scheduler.cache.radix
    if radix is not None:
        radix.reset()
    log.info("prefix cache flushed")
    return FlushCacheOut(True)
