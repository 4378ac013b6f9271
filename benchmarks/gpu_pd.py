"""KV handoff between two processes on one GPU (prefill → decode), through the transfer layer.

    python -m baton.benchmarks.gpu_pd [--tokens 2048] [--backend ucx] [--out pd.json]

Two processes each hold a Llama-3.1-8B-shaped KV pool on the same GPU; the prefill side
sends one request's pages (page-major pool: one region per contiguous run) and the
decode side waits for Success. Reported: handoff time (send → Success on the receiver),
GB/s, and a same-process device-to-device copy of the same bytes as the limit.
Coordination between the two processes goes through files in a temp dir (no pickling).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from baton.services.worker.scheduler_proc import GIL_SWITCH_INTERVAL_S

LAYERS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
# Poll like a worker's loop does (it yields the GIL): a busy spin here would starve the
# transfer threads and measure CPython's thread switching instead of the handoff.
POLL_S = 5e-5


def _pool(num_pages: int) -> torch.Tensor:
    return torch.zeros(
        num_pages,
        LAYERS,
        2,
        PAGE,
        KV_HEADS,
        HEAD_DIM,
        dtype=torch.bfloat16,
        device=torch.device("cuda", torch.cuda.current_device()),
    )


def _wait_file(path: Path, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.005)
    time.sleep(0.01)
    return path.read_text()


def _manager(buf: torch.Tensor, role: str, backend: str):  # type: ignore[no-untyped-def]
    from baton.common.transfer.base import KVArgs
    from baton.common.transfer.manager import TransferManager

    page_bytes = buf[0].numel() * buf.element_size()
    return TransferManager(
        KVArgs(buffer=buf, page_bytes=page_bytes, num_pages=buf.shape[0]), role, backend
    )  # type: ignore[arg-type]


def run_decode(work: Path, pages: int, rounds: int, backend: str) -> None:
    from baton.common.transfer.base import KVPoll

    buf = _pool(pages + 8)
    mgr = _manager(buf, "decode", backend)
    (work / "d_addr").write_text(mgr.control_address)
    p_addr = _wait_file(work / "p_addr")
    times = []
    for r in range(rounds):
        rx = mgr.create_receiver(1000 + r, p_addr)
        rx.init(list(range(4, 4 + pages)), 0)
        (work / f"init{r}").write_text("1")
        while rx.poll() not in (KVPoll.Success, KVPoll.Failed):
            time.sleep(POLL_S)
        done = time.perf_counter()
        assert rx.poll() == KVPoll.Success, rx.failure_reason
        sent = float(_wait_file(work / f"sent{r}"))
        times.append(done - sent)
        rx.release()
    checksum = float(buf[4 : 4 + pages].float().sum())
    (work / "d_result").write_text(json.dumps({"times": times, "checksum": checksum}))
    mgr.shutdown()


def run_prefill(work: Path, pages: int, rounds: int, backend: str) -> None:
    from baton.common.transfer.base import KVPoll

    buf = _pool(pages + 8)
    buf.normal_()
    mgr = _manager(buf, "prefill", backend)
    (work / "p_addr").write_text(mgr.control_address)
    d_addr = _wait_file(work / "d_addr")
    for r in range(rounds):
        tx = mgr.create_sender(1000 + r, d_addr)
        _wait_file(work / f"init{r}")
        while tx.poll() != KVPoll.WaitingForInput:
            time.sleep(POLL_S)
        torch.cuda.synchronize()
        t = time.perf_counter()
        tx.send(list(range(2, 2 + pages)), 0)
        tx.finish(b"")
        (work / f"sent{r}").write_text(repr(t))
        while not tx.poll().terminal:
            time.sleep(POLL_S)
        tx.release()
    (work / "p_result").write_text(
        json.dumps({"checksum": float(buf[2 : 2 + pages].float().sum()), "regions": 1})
    )
    _wait_file(work / "d_result")
    mgr.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--backend", default="ucx")
    ap.add_argument("--role", choices=["prefill", "decode"], default=None)
    ap.add_argument("--work", default=None)
    ap.add_argument("--devices", default="0", help="P's GPU,D's GPU (e.g. 0,1); one = same GPU")
    ap.add_argument("--out", default="benchmarks/results/gpu_pd.json")
    args = ap.parse_args(argv)
    pages = -(-args.tokens // PAGE)
    devices = [int(d) for d in args.devices.split(",")]
    if args.role:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # as in a worker's scheduler process
        torch.cuda.set_device(devices[0] if args.role == "prefill" else devices[-1])
        fn = run_prefill if args.role == "prefill" else run_decode
        fn(Path(args.work), pages, args.rounds, args.backend)
        return 0
    work = Path(tempfile.mkdtemp(prefix="gpu-pd-"))
    cmd = [
        sys.executable,
        "-m",
        "baton.benchmarks.gpu_pd",
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
    a = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{devices[0]}")
    b = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{devices[-1]}")
    b.copy_(a)
    for dev in set(devices):
        torch.cuda.synchronize(dev)
    t = time.perf_counter()
    for _ in range(20):
        b.copy_(a)
    for dev in set(devices):
        torch.cuda.synchronize(dev)
    copy = (time.perf_counter() - t) / 20
    best = min(d["times"][1:] or d["times"])
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0),
        "command": "python -m baton.benchmarks.gpu_pd " + " ".join(sys.argv[1:]),
        "backend": args.backend,
        "tokens": args.tokens,
        "bytes": nbytes,
        "devices": args.devices,
        "handoff_ms_best": best * 1e3,
        "handoff_ms_all": [x * 1e3 for x in d["times"]],
        "handoff_GBps": nbytes / best / 1e9,
        "d2d_copy_ms": copy * 1e3,
        "x_copy_limit": best / copy,
        "checksum_ok": abs(d["checksum"] - p["checksum"]) < 1e-3,
    }
    print(
        f"| KV handoff, {args.tokens} tokens ({nbytes / 2**20:.0f} MiB), {args.backend} | "
        f"{best * 1e3:.3f} ms | {nbytes / best / 1e9:.0f} GB/s | d2d copy {copy * 1e3:.3f} ms "
        f"| {best / copy:.1f}x | checksum {'ok' if result['checksum_ok'] else 'BAD'} |"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
