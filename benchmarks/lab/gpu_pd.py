"""KV handoff between two processes (prefill → decode), through the transfer layer.

    python -m baton.benchmarks.lab.gpu_pd [--tokens 2048] [--backend ucx] [--devices 0,1] [--out pd.json]

Two processes each hold a Llama-3.1-8B-shaped KV pool (on GPUs, or with `--devices cpu` in
a memfd, for the `ipc` backend's host path); the prefill side sends one request's pages
(page-major pool: one region per contiguous run) and the decode side waits for Success.
Reported: handoff time (send → Success on the receiver), GB/s, a same-process copy of the
same bytes as the limit, and where the handoff's time went (median over rounds): P's
transfer thread waking, the copy, the final status leaving P's control thread, reaching
D's control thread, and D's loop seeing it. Where the tree has it, "queue" (P's thread queuing the send and
launching its copies) comes before "wake". With D's doorbells (see transfer/doorbell) the
status leaves before the copies end, and the parts are: queue, announce (P's thread queuing
the bell and sending the status), status_in, and bell (D waiting for the copies and the bell
after the status arrived). Clocks are CLOCK_MONOTONIC, one per host.
Coordination between the two processes goes through files in a temp dir (no pickling).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from baton.common.transfer.base import Role
from baton.services.worker.scheduler_proc import GIL_SWITCH_INTERVAL_S

LAYERS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
# Poll like a worker's loop does (it yields the GIL): a busy spin here would starve the
# transfer threads and measure CPython's thread switching instead of the handoff.
POLL_S = 5e-5


SHAPE = (LAYERS, 2, PAGE, KV_HEADS, HEAD_DIM)
STAGES = ("wake", "copy", "status_out", "status_in", "seen")  # the breakdown's parts
BELL_STAGES = ("queue", "announce", "status_in", "bell")  # ... where D's doorbells ring


def _pool(num_pages: int, cpu: bool) -> torch.Tensor:
    if cpu:
        from baton.common.devices import shared_host_zeros

        nbytes = num_pages * LAYERS * 2 * PAGE * KV_HEADS * HEAD_DIM * 2
        return shared_host_zeros(nbytes).view(torch.bfloat16).view(num_pages, *SHAPE)
    device = torch.device("cuda", torch.cuda.current_device())
    return torch.zeros(num_pages, *SHAPE, dtype=torch.bfloat16, device=device)


def _stamp_calls(
    stamps: dict[str, list[float]], owner: type, method: str, key: str, on_return: bool = False
) -> None:
    """Record when ``owner.method`` is entered (or returns); a method the tree lacks is left
    out (an older tree run side by side). This process only: a benchmark's probe."""
    original = getattr(owner, method, None)
    if original is None:
        return

    def stamped(self, *args, **kwargs):
        if not on_return:
            stamps.setdefault(key, []).append(time.perf_counter())
        result = original(self, *args, **kwargs)
        if on_return:
            stamps.setdefault(key, []).append(time.perf_counter())
        return result

    setattr(owner, method, stamped)


def _stamp_prefill(stamps: dict[str, list[float]]) -> None:
    from baton.common.transfer import workers
    from baton.common.transfer.control import ControlPlane
    from baton.common.transfer.messages import KVDone, decode_control
    from baton.common.transfer.sender import SenderRoom

    # P's thread has queued the send (and launched its copies, where it does)
    _stamp_calls(stamps, workers._Lane, "_launch", "queued", on_return=True)
    _stamp_calls(stamps, workers._Lane, "_process", "wake")
    _stamp_calls(stamps, workers._Lane, "_landed", "landed")  # copies the sender launched
    _stamp_calls(stamps, SenderRoom, "complete", "copied")
    _stamp_calls(stamps, SenderRoom, "announce", "announced")  # the status left early

    def is_done(payload: bytes | None) -> bool:
        return payload is not None and isinstance(decode_control(payload), KVDone)

    send_now = ControlPlane._send_now  # every thread's send of a control message

    def sent(peer, dealer, payload):
        send_now(peer, dealer, payload)
        if is_done(payload):
            stamps.setdefault("flushed", []).append(time.perf_counter())

    ControlPlane._send_now = staticmethod(sent)  # type: ignore[method-assign]


def _stamp_decode(stamps: dict[str, list[float]]) -> None:
    from baton.common.transfer.receiver import ReceiverRoom

    _stamp_calls(stamps, ReceiverRoom, "on_done", "received")


def _wait_file(path: Path, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.005)
    time.sleep(0.01)
    return path.read_text()


def _manager(buf: torch.Tensor, role: Role, backend: str):
    from baton.common.transfer.base import KVArgs
    from baton.common.transfer.manager import TransferManager

    page_bytes = buf[0].numel() * buf.element_size()
    return TransferManager(
        KVArgs(buffer=buf, page_bytes=page_bytes, num_pages=buf.shape[0]), role, backend
    )


def run_decode(work: Path, pages: int, rounds: int, backend: str, cpu: bool) -> None:
    from baton.common.transfer.base import KVPoll

    buf = _pool(pages + 8, cpu)
    stamps: dict[str, list[float]] = {}
    _stamp_decode(stamps)
    mgr = _manager(buf, "decode", backend)
    (work / "d_addr").write_text(mgr.control_address)
    p_addr = _wait_file(work / "p_addr")
    times, seen, sums = [], [], []
    for r in range(rounds):
        rx = mgr.create_receiver(1000 + r, p_addr)
        rx.init(list(range(4, 4 + pages)), 0)
        (work / f"init{r}").write_text("1")
        while rx.poll() not in (KVPoll.Success, KVPoll.Failed):
            time.sleep(POLL_S)
        done = time.perf_counter()
        seen.append(done)
        assert rx.poll() == KVPoll.Success, rx.failure_reason
        sent = float(_wait_file(work / f"sent{r}"))
        times.append(done - sent)
        rx.release()
        sums.append(float(buf[4 : 4 + pages].float().sum()))  # what this round delivered
        buf[4 : 4 + pages].zero_()
    result = {"times": times, "checksums": sums, "seen": seen, **stamps}
    (work / "d_result").write_text(json.dumps(result))
    mgr.shutdown()


def run_prefill(work: Path, pages: int, rounds: int, backend: str, cpu: bool) -> None:
    from baton.common.transfer.base import KVPoll

    buf = _pool(pages + 8, cpu)
    buf.normal_()
    stamps: dict[str, list[float]] = {"sent": []}
    _stamp_prefill(stamps)
    mgr = _manager(buf, "prefill", backend)
    (work / "p_addr").write_text(mgr.control_address)
    d_addr = _wait_file(work / "d_addr")
    for r in range(rounds):
        tx = mgr.create_sender(1000 + r, d_addr)
        _wait_file(work / f"init{r}")
        while tx.poll() != KVPoll.WaitingForInput:
            time.sleep(POLL_S)
        if not cpu:
            torch.cuda.synchronize()
        t = time.perf_counter()
        stamps["sent"].append(t)
        tx.send(list(range(2, 2 + pages)), 0)
        tx.finish(b"")
        (work / f"sent{r}").write_text(repr(t))
        while not tx.poll().terminal:
            time.sleep(POLL_S)
        tx.release()
    checksum = float(buf[2 : 2 + pages].float().sum())
    bells = mgr.stats().get("bells_launched", 0)  # rung by the copy stream, behind the copies
    (work / "p_result").write_text(json.dumps({"checksum": checksum, "bells": bells, **stamps}))
    _wait_file(work / "d_result")
    mgr.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--backend", default="ucx")
    ap.add_argument("--role", choices=["prefill", "decode"], default=None)
    ap.add_argument("--work", default=None)
    ap.add_argument(
        "--devices", default="0", help="P's GPU,D's GPU (e.g. 0,1); one = same GPU; cpu = memfd"
    )
    ap.add_argument(
        "--switch-interval",
        type=float,
        default=GIL_SWITCH_INTERVAL_S,
        help="sys.setswitchinterval of both processes (default: a worker's)",
    )
    ap.add_argument("--out", default="benchmarks/results/gpu_pd.json")
    args = ap.parse_args(argv)
    pages = -(-args.tokens // PAGE)
    cpu = args.devices == "cpu"
    devices = [] if cpu else [int(d) for d in args.devices.split(",")]
    if args.role:
        sys.setswitchinterval(args.switch_interval)  # a worker's scheduler process: the default
        if not cpu:
            torch.cuda.set_device(devices[0] if args.role == "prefill" else devices[-1])
        fn = run_prefill if args.role == "prefill" else run_decode
        fn(Path(args.work), pages, args.rounds, args.backend, cpu)
        return 0
    work = Path(tempfile.mkdtemp(prefix="gpu-pd-"))
    cmd = [
        sys.executable,
        "-m",
        "baton.benchmarks.lab.gpu_pd",
        "--tokens",
        str(args.tokens),
        "--rounds",
        str(args.rounds),
        "--backend",
        args.backend,
        "--work",
        str(work),
        "--devices",
        args.devices,
        "--switch-interval",
        str(args.switch_interval),
    ]
    procs = [
        subprocess.Popen([*cmd, "--role", role], env=os.environ.copy())
        for role in ("decode", "prefill")
    ]
    for p in procs:
        p.wait(timeout=300)
    d = json.loads((work / "d_result").read_text())
    p = json.loads((work / "p_result").read_text())
    nbytes = pages * LAYERS * 2 * PAGE * KV_HEADS * HEAD_DIM * 2
    copy = _copy_seconds(nbytes, devices)
    best = min(d["times"][1:] or d["times"])
    parts = _breakdown(p, d)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(devices[0]) if devices else "cpu (memfd)",
        "command": "python -m baton.benchmarks.lab.gpu_pd " + " ".join(sys.argv[1:]),
        "backend": args.backend,
        "tokens": args.tokens,
        "bytes": nbytes,
        "devices": args.devices,
        "switch_interval_s": args.switch_interval,
        "handoff_ms_best": best * 1e3,
        "handoff_ms_all": [x * 1e3 for x in d["times"]],
        "handoff_GBps": nbytes / best / 1e9,
        "d2d_copy_ms": copy * 1e3,
        "breakdown_ms_median": parts,
        "x_copy_limit": best / copy,
        "checksum_ok": all(abs(c - p["checksum"]) < 1e-3 for c in d["checksums"]),
        "launched_rounds": len(p.get("landed", [])),  # copies queued by the sending thread
        "belled_rounds": len(p.get("announced", [])),  # the status left before the copies ended
        "bells_launched": p.get("bells", 0),  # of those, rung by the GPU's copy stream
    }
    print(
        f"| KV handoff, {args.tokens} tokens ({nbytes / 2**20:.0f} MiB), {args.backend} | "
        f"{best * 1e3:.3f} ms | {nbytes / best / 1e9:.0f} GB/s | d2d copy {copy * 1e3:.3f} ms "
        f"| {best / copy:.1f}x | checksum {'ok' if result['checksum_ok'] else 'BAD'} "
        f"| launched by the sender in {result['launched_rounds']} rounds "
        f"| doorbell in {result['belled_rounds']} ({result['bells_launched']} rung by the GPU) |"
    )
    print("| median ms | " + " | ".join(f"{k} {v:.3f}" for k, v in parts.items()) + " |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


def _copy_seconds(nbytes: int, devices: list[int]) -> float:
    """One copy of ``nbytes`` in this process: device to device, or host memcpy for cpu."""
    where = [f"cuda:{devices[0]}", f"cuda:{devices[-1]}"] if devices else ["cpu", "cpu"]
    a = torch.empty(nbytes, dtype=torch.uint8, device=where[0])
    b = torch.empty(nbytes, dtype=torch.uint8, device=where[1])

    def sync() -> None:
        for dev in set(devices):
            torch.cuda.synchronize(dev)

    b.copy_(a)
    sync()
    t = time.perf_counter()
    for _ in range(20):
        b.copy_(a)
    sync()
    return (time.perf_counter() - t) / 20


def _breakdown(p: dict[str, list[float]], d: dict[str, list[float]]) -> dict[str, float]:
    """Median milliseconds of each part of a handoff, from the two sides' stamps (one per
    round, in order; the first round is left out as warm-up where there are more)."""
    if p.get("announced"):  # the status travelled while the copies ran
        stages = list(BELL_STAGES)
        marks = [p["sent"], p.get("queued", []), p.get("flushed", [])]
    else:
        stages = list(STAGES)
        marks = [p["sent"], p.get("wake", []), p.get("copied", []), p.get("flushed", [])]
        if len(p.get("queued", [])) == len(p["sent"]):  # "wake" splits: P's thread queues,
            stages.insert(0, "queue")  # then the lane wakes
            marks.insert(1, p["queued"])
    marks += [d.get("received", []), d["seen"]]
    rounds = min(len(m) for m in marks)
    if rounds == 0 or any(len(m) != len(p["sent"]) for m in marks):
        return {}  # a backend that takes another path (or stamps that do not pair up)
    first = 1 if rounds > 1 else 0
    return {
        name: statistics.median(b[r] - a[r] for r in range(first, rounds)) * 1e3
        for name, a, b in zip(stages, marks, marks[1:], strict=False)
    }


if __name__ == "__main__":
    sys.exit(main())
