"""SGLang's native HTTP API on the router, so that SGLang's own clients (its frontend
language's `RuntimeEndpoint`, its benchmarks) talk to baton unchanged.

POST /generate                      text or token ids in (a list: a batch), SGLang's answer
                                    out (`sglang.py`)
GET  /model_info, /get_model_info   the model: its path (SGLang's frontend picks its chat
                                    template by it), served name, tokenizer, type
GET  /server_info, /get_server_info the router: version, model, context length, workers
GET  /health_generate               200 once one token came back through the cluster (a
                                    prompt of one token, greedy), 503 saying why not. A
                                    router whose every slot is taken answers 200 "busy"
                                    at once, as SGLang skips its probe while it serves:
                                    the probe would only wait in line, and a load balancer
                                    must not drop a cluster for being loaded
"""

from __future__ import annotations

import asyncio
import json
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from baton.services.router.admission import Admission
from baton.services.router.errors import APIError
from baton.services.router.params import ChoiceSpec, PreparedRequest, RequestPreparer
from baton.services.router.schemas import GenerateRequest
from baton.services.router.serving import Server
from baton.services.router.sglang import GenerateFormat, GenerateShape, prepare_generate
from baton.services.router.workers import WorkerPool

HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's own bound on its health generation
_ONE_TOKEN = GenerateShape(
    batch=False,
    item_ids=None,
    prefill_only=False,
    logprobs=False,
    logprob_start_len=-1,
    text_in_logprobs=False,
)


def add_sglang_routes(
    app: FastAPI,
    server: Server,
    preparer: RequestPreparer,
    pool: WorkerPool,
    admission: Admission,
) -> None:
    model = preparer.model
    tokenizer = preparer.tokenizer
    info = _model_info(preparer)

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        arrival = time.monotonic()
        prepared, shape = await run_in_threadpool(prepare_generate, preparer, body)
        fmt = GenerateFormat(model.name, tokenizer, prepared, shape, arrival)
        return await server.serve(request, "/generate", prepared, fmt, arrival)

    @app.get("/model_info")
    @app.get("/get_model_info")  # SGLang's older name, which its frontend still calls
    async def model_info() -> dict[str, Any]:
        return info

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return {
            "version": metadata.version("baton"),
            "frontend": "baton",
            "model_path": info["model_path"],
            "served_model_name": model.name,
            "tokenizer_path": info["tokenizer_path"],
            "context_length": model.context_len,
            "workers": pool.counts_by_role(),
            "worker_ids": pool.worker_ids(),
        }

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        if admission.queued or admission.active >= admission.limit():
            return JSONResponse({"status": "busy"})
        arrival = time.monotonic()
        sampling = preparer.sampling({"max_new_tokens": 1, "temperature": 0.0})
        prepared = PreparedRequest(
            choices=[ChoiceSpec(0, [0], sampling)],  # SGLang's probe: token 0, one token
            prompt_count=1,
            stop_strings=[],
            stream=False,
            include_usage=False,
            top_logprobs=None,
        )
        fmt = GenerateFormat(model.name, tokenizer, prepared, _ONE_TOKEN, arrival)
        try:
            async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):
                response = await server.serve(request, "/health_generate", prepared, fmt, arrival)
        except TimeoutError:
            return _unhealthy(f"no token within {HEALTH_GENERATE_TIMEOUT_S:g}s")
        except APIError as e:
            if e.status == 429:  # the slots filled meanwhile: the cluster is serving
                return JSONResponse({"status": "busy"})
            return _unhealthy(e.message)
        if response.status_code != 200:
            return response  # the client left (499)
        return JSONResponse({"status": "ok"})


def _unhealthy(why: str) -> JSONResponse:
    return JSONResponse(
        {"status": "unhealthy", "detail": why}, status_code=503, headers={"Retry-After": "1"}
    )


def _model_info(preparer: RequestPreparer) -> dict[str, Any]:
    """SGLang's /model_info fields, those baton can fill truthfully."""
    path = preparer.model.path
    config = _hf_config(path)
    return {
        "model_path": str(path),
        "served_model_name": preparer.model.name,
        "tokenizer_path": str(path),
        "is_generation": True,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": config.get("model_type"),
        "architectures": config.get("architectures"),
        "context_length": preparer.model.context_len,
    }


def _hf_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}
