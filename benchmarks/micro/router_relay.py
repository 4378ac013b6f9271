"""The router's CPU per streamed token: a real `baton router` process between a closed-loop
streaming client and fake prefill and decode workers (`fake_worker`), which stream
`--tokens-per-message` tokens a message, as a worker run with `--stream-interval` does.

    python -m baton.benchmarks.micro.router_relay --tokens-per-message 1,4 --out relay.json

The client, the fake workers and the bootstrap share this process; the router is alone in
its own. The figure is the router process's CPU seconds (user + system, from /proc) over
the tokens it relayed: one core relays 1e6 / (us per token) tokens a second, whatever
the client here manages. On 4x H100 the whole cluster topped out at about 7,000 output
tokens/s with one router and one token a message (results/gpu_2026-11-28_s20).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from baton.benchmarks.fake_worker import FakeBehavior, FakeWorker
from baton.common.rpc import baton_pb2 as pb
from baton.services.bootstrap.server import serve as serve_bootstrap
from baton.services.launcher_config import free_port
from baton.services.registry.config import RegistryConfig, open_registry
from baton.services.registry.membership import WorkerRegistration

TOKEN = "router-relay-benchmark"
STEP_S = 0.004  # a fake decode step: each stream gets a token this often


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(
    per_message: int, concurrency: int, requests: int, out_len: int
) -> dict[str, Any]:
    bootstrap, boot_port = await serve_bootstrap("127.0.0.1", 0, lease_ttl=3.0, cluster_token=TOKEN)
    rng = random.Random(0)
    script = [rng.randrange(300, 1900) for _ in range(997)]
    behavior = FakeBehavior(script=script, delay=STEP_S * per_message, tokens_per_chunk=per_message)
    registrations, workers = [], []
    for i, role in enumerate((pb.PREFILL, pb.DECODE)):
        worker = FakeWorker(f"fake-{i}", role, behavior)
        await worker.start(cluster_token=TOKEN)
        workers.append(worker)
        registry = open_registry(RegistryConfig(f"127.0.0.1:{boot_port}"), TOKEN, lease_ttl=3.0)
        registrations.append(WorkerRegistration(registry, worker.info(), 0.2))
        await registrations[-1].start()
    port = free_port()
    router = subprocess.Popen(
        [sys.executable, "-m", "baton.services.cli", "router", "--port", str(port),
         "--registry", f"127.0.0.1:{boot_port}", "--expect-workers", "prefill=1,decode=1",
         "--log-level", "warning"],
        env={**os.environ, "BATON_CLUSTER_TOKEN": TOKEN},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            await _until_up(client)
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            gate = asyncio.Semaphore(concurrency)
            tokens = 0

            async def one() -> None:
                nonlocal tokens
                body = {
                    "model": model,
                    "prompt": [rng.randrange(300, 1900) for _ in range(64)],
                    "max_tokens": out_len,
                    "stream": True,
                    "ignore_eos": True,
                    "stream_options": {"include_usage": True},
                }
                async with gate, client.stream("POST", "/v1/completions", json=body) as r:
                    r.raise_for_status()
                    async for line in r.aiter_lines():
                        if line.startswith("data: {") and '"usage"' in line:
                            usage = json.loads(line[6:]).get("usage")
                            tokens += usage["completion_tokens"] if usage else 0

            await asyncio.gather(*(one() for _ in range(min(requests, 20))))  # warm
            tokens = 0
            cpu0, t0 = cpu_seconds(router.pid), time.monotonic()
            await asyncio.gather(*(one() for _ in range(requests)))
            cpu1, t1 = cpu_seconds(router.pid), time.monotonic()
            metrics = (await client.get("/metrics")).text
    finally:
        router.terminate()
        router.wait(timeout=30)
        for registration in registrations:
            await registration.stop()
            await registration.registry.close()
        for worker in workers:
            await worker.stop()
        await bootstrap.stop(None)
    return {
        "tokens_per_message": per_message,
        "tokens": tokens,
        "wall_s": round(t1 - t0, 2),
        "router_cpu_s": round(cpu1 - cpu0, 2),
        "router_us_per_token": round(1e6 * (cpu1 - cpu0) / tokens, 1),
        "one_core_tokens_per_s": round(tokens / (cpu1 - cpu0)),
        # the router's full garbage collections, warm-up and run (each stops every stream)
        "full_collections": _series(metrics, "_count"),
        "full_collections_s": round(_series(metrics, "_sum"), 3),
    }


def _series(metrics: str, suffix: str) -> float:
    m = re.search(
        rf'^baton_router_gc_pause_seconds{suffix}{{generation="2"}} (\S+)$', metrics, re.M
    )
    return float(m.group(1)) if m else 0.0


async def _until_up(client: httpx.AsyncClient) -> None:
    for _ in range(300):
        try:
            if (await client.get("/health")).json().get("status") == "ok":
                return
        except (httpx.HTTPError, ValueError):
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError("the router did not see both fake workers")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens-per-message", default="1,4", help="comma-separated")
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    rows = []
    for per_message in (int(k) for k in args.tokens_per_message.split(",")):
        rows.append(
            asyncio.run(measure(per_message, args.concurrency, args.requests, args.output_len))
        )
        print(rows[-1], flush=True)
    print(
        "\n| tokens a message | tokens | router CPU s | us a token | one core, tokens/s "
        "| full collections (s) |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['tokens_per_message']} | {r['tokens']} | {r['router_cpu_s']} | "
            f"{r['router_us_per_token']} | {r['one_core_tokens_per_s']} | "
            f"{r['full_collections']:.0f} ({r['full_collections_s']}) |"
        )
    if args.out is not None:
        args.out.write_text(json.dumps({"command": sys.argv, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
