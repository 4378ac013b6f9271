"""The scheduler process of a worker: owns the engine, talks to the frontend over ZMQ IPC.

`run` starts the tensor-parallel followers, then the scheduler with its role plugged in
(`start`, `baton.common.disagg.start.start_role`), and serves (`SchedulerProcess.serve`):
receive (block only when idle) → role queues advance → one scheduler step → send this
step's outputs as one message (`collector.py` gathers them).
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
    SwitchRoleOut,
    SwitchRoleReq,
    ToScheduler,
    decode_to_scheduler,
    encode,
)
from baton.services.worker.collector import OutputCollector
from baton.services.worker.config import SchedulerProcArgs
from baton.services.worker.stats import stats_message

if TYPE_CHECKING:
    from baton.common.attention.prebuild import Prebuild
    from baton.common.cache.radix import RadixCache
    from baton.common.disagg.aggregated_role import Role
    from baton.common.engine.process import GcPauses

log = logging.getLogger("baton.scheduler")

STATS_INTERVAL = 0.25
# The scheduler thread is busy in Python most of the time; the KV transfer threads (control
# messages, page copies) must still get the GIL within a fraction of a millisecond, not
# after CPython's default 5 ms switch interval.
GIL_SWITCH_INTERVAL_S = 0.0005
CONNECT_WAIT_S = 10.0  # a ConnectReq is answered by then (the frontend waits 4.5 s)
# (transfer address, its connections opening or None, answer by then)
Connecting = tuple[str, "Future[None] | None", float]


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
    process = start(args, send)
    exit_code = 0
    if process is not None:
        handler = process.handler
        ready = ReadyOut(
            handler.kv_control_address, handler.transfer_address, process.scheduler.cfg.num_pages
        )
        send.send(encode(ready))
        log.info(
            "scheduler ready (pid %d, role %s) %.1f s after its start",
            os.getpid(),
            args.engine.role,
            time.monotonic() - started,
        )
        exit_code = process.serve(recv)
        process.shutdown()
    send.close(linger=1000)
    recv.close(linger=0)
    ctx.term()
    if exit_code:
        sys.exit(exit_code)


def start(args: SchedulerProcArgs, send: zmq.Socket[bytes]) -> SchedulerProcess | None:
    """The engine started with its role, warmed up and its heap frozen; None once a failure
    to start was reported to the frontend (what had started is stopped)."""
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
        # (TP followers, daemons, end with this process: a stop broadcast could wait on
        # one that never joined)
        send.send(encode(ReadyOut(error=f"{type(e).__name__}: {e}")))
        return None
    return SchedulerProcess(
        args, model_cfg, scheduler, handler, collector, send, followers, gc_pauses, radix
    )


class SchedulerProcess:
    """The started engine and its role, served until the frontend says stop: receive
    (block only when idle) → role queues advance → one scheduler step → this step's KV
    events, then outputs, one message each → answers and reports that are due."""

    def __init__(
        self,
        args: SchedulerProcArgs,
        model_cfg: ModelConfig,
        scheduler: Scheduler,
        handler: Role,
        collector: OutputCollector,
        send: zmq.Socket[bytes],
        followers: list,
        gc_pauses: GcPauses,
        radix: RadixCache | None,
    ) -> None:
        self.args, self.model_cfg = args, model_cfg
        self.scheduler, self.handler, self.collector = scheduler, handler, collector
        self.send = send
        self.role: str = args.engine.role  # (a role change sets any the scheduler takes)
        self._followers, self._gc_pauses, self._radix = followers, gc_pauses, radix
        self._switch: tuple[SwitchRoleReq, float] | None = None  # asked for, and until when
        self._connecting: list[Connecting] = []  # ConnectReqs not answered yet
        self._running = True
        self._last_stats = 0.0

    def serve(self, recv: zmq.Socket[bytes]) -> int:
        """Until a `ShutdownReq`, the engine's end or the frontend's; the exit code."""
        poller = zmq.Poller()
        poller.register(recv, zmq.POLLIN)
        parent = os.getppid()
        scheduler = self.scheduler
        while self._running:
            busy = scheduler.has_work() or self.handler.has_work()
            waits = 1 if self.handler.has_work() or self._connecting else 50
            if dict(poller.poll(0 if scheduler.has_work() else waits)).get(recv):
                self._receive(recv)
            if not self._step():
                return 1
            self._send_outputs()
            if self._switch is not None:
                self._maybe_switch()
            now = time.monotonic()
            if now - self._last_stats > STATS_INTERVAL or (
                not busy and now - self._last_stats > 0.05
            ):
                stats = stats_message(scheduler, self.handler.stats(), self._gc_pauses.take())
                self.send.send(encode(stats))
                self._last_stats = now
                if os.getppid() != parent:
                    log.error("the worker frontend died; the scheduler exits")
                    break
        return 0

    def _receive(self, recv: zmq.Socket[bytes]) -> None:
        while True:
            try:
                raw = recv.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode_to_scheduler(raw)
            except msgspec.DecodeError as e:
                log.warning("dropped a malformed message: %s", e)
                continue
            self._take(msg)

    def _take(self, msg: ToScheduler) -> None:
        handler = self.handler
        if isinstance(msg, GenerateReq):
            handler.on_generate(msg)
        elif isinstance(msg, AbortReq):
            handler.on_abort(msg.rid)
        elif isinstance(msg, MigrateReq):
            refused = handler.on_migrate(msg)
            self.send.send(encode(MigrateOut(msg.room, refused or "")))
        elif isinstance(msg, ConnectReq):
            opening = handler.connect(msg.peer)  # (None: it hands nothing off)
            deadline = time.monotonic() + CONNECT_WAIT_S
            self._connecting.append((msg.peer.transfer_address, opening, deadline))
        elif isinstance(msg, PeerLostReq):
            handler.on_peer_lost(msg.kv_control_address)
        elif isinstance(msg, FlushCacheReq):
            self.send.send(encode(flush_cache(self.scheduler, handler.has_work())))
        elif isinstance(msg, SwitchRoleReq):
            self._switch = msg, time.monotonic() + msg.timeout
        elif isinstance(msg, ShutdownReq):
            self._running = False

    def _step(self) -> bool:
        """The role's queues and one scheduler step; False when the engine cannot go on
        (its requests failed and sent)."""
        try:
            self.handler.poll()
            if self.scheduler.has_work():
                self.scheduler.step()  # a failed step fails no innocent request (recovery)
            self.handler.poll()
        except FatalEngineError as e:
            log.critical("the engine cannot go on: %s; failing its requests and exiting", e)
            self.handler.fail_all(f"the worker failed: {e}")
            self.send.send(encode(OutputBatch(self.collector.take())))
            return False
        except Exception:
            log.exception("role queues failed; failing the requests")
            self.handler.fail_all("internal error in the worker")
        return True

    def _send_outputs(self) -> None:
        collector = self.collector
        if self._radix is not None and (events := self._radix.take_events()):
            # before the outputs: a client's next turn finds its prefix already indexed
            self.send.send(encode(KVEventsOut(time.time(), events)))
        if (late := self.handler.take_spans()) is not None:
            collector.spans += late
        if collector.items or collector.spans:
            self.send.send(encode(OutputBatch(collector.take(), collector.take_spans())))
        if self._connecting:
            self._connecting = answer_connects(self._connecting, self.send, time.monotonic())

    def _maybe_switch(self) -> None:
        """The role change asked for, once idle, or its refusal once the wait is over."""
        assert self._switch is not None
        msg, until = self._switch
        scheduler = self.scheduler
        idle = not (scheduler.has_work() or self.handler.has_work() or scheduler.requests)
        if not idle and time.monotonic() <= until:
            return
        out = SwitchRoleOut(self.role, error="requests or rooms outlasted the wait")
        if idle:
            self.handler, out = switch_role_now(
                scheduler, self.handler, self.role, msg, self.model_cfg, self.args
            )
        self.role = out.role
        self.send.send(encode(out))
        self._switch = None

    def shutdown(self) -> None:
        self.handler.shutdown()
        self.scheduler.shutdown()
        stop_followers(self._followers)


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
