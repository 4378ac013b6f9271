"""The endpoints clients call besides generation, in vLLM's and SGLang's shapes.

GET  /version                 {"version"}
GET  /v1/models[/{id}]        model cards with `root` (the model folder) and `parent`
POST /tokenize                a prompt or chat messages -> {"count", "max_model_len",
                              "tokens", "token_strs"}
POST /detokenize              {"tokens"} -> {"prompt"}
POST /flush_cache             empties every worker's prefix cache (admin key; refused
                              while requests run)
"""

from __future__ import annotations

import asyncio
from importlib import metadata
from typing import Any, TypeVar

import grpc.aio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from baton.common.rpc import baton_pb2 as pb
from baton.services.router.auth import bearer_matches
from baton.services.router.config import ModelInfo
from baton.services.router.errors import APIError, bad_request, model_not_found
from baton.services.router.params import RequestPreparer
from baton.services.router.schemas import DetokenizeRequest, TokenizeRequest
from baton.services.router.tools import template_messages
from baton.services.router.workers import WorkerPool

BodyModel = TypeVar("BodyModel", bound=BaseModel)

FLUSH_TIMEOUT_S = 10.0


def model_card(model: ModelInfo) -> dict[str, Any]:
    return {
        "id": model.name,
        "object": "model",
        "created": 0,
        "owned_by": "baton",
        "root": str(model.path),
        "parent": None,
        "max_model_len": model.context_len,
    }


def add_utility_routes(
    app: FastAPI, preparer: RequestPreparer, pool: WorkerPool, admin_api_key: str | None
) -> None:
    model = preparer.model
    tokenizer = preparer.tokenizer

    def check_model(name: str | None) -> None:
        if name is not None:
            preparer.check_model(name)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": metadata.version("baton")}

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        return {"object": "list", "data": [model_card(model)]}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str) -> dict[str, object]:
        if model_id != model.name:
            raise model_not_found(model_id, model.name)
        return model_card(model)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, object]:
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if body.prompt is not None and preparer.prompt_limit.too_long(body.prompt):
            raise bad_request("prompt is longer than the model's context could hold", "prompt")
        ids = await run_in_threadpool(_tokenize, body)
        strs = tokenizer.hf.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": model.context_len,
            "tokens": ids,
            "token_strs": strs,
        }

    def _tokenize(body: TokenizeRequest) -> list[int]:
        """The token ids of the prompt, or of the rendered chat (off the event loop); what
        the tokenizer or the template refuses is the request's fault (400)."""
        param = "prompt" if body.prompt is not None else "messages"
        try:
            if body.messages is not None:
                tools = [t.model_dump(exclude_none=True) for t in body.tools or []] or None
                text = tokenizer.render_chat(
                    template_messages(body.messages),
                    tools,
                    body.add_generation_prompt,
                    **(body.chat_template_kwargs or {}),
                )
                return tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
            assert body.prompt is not None
            return tokenizer.encode(
                body.prompt, add_special_tokens=body.add_special_tokens is not False
            )
        except Exception as e:
            raise bad_request(f"{param}: the tokenizer refused it: {e}", param) from e

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, object]:
        hf = tokenizer.hf
        return {
            "tokenizer_class": type(hf).__name__,
            "eos_token": hf.eos_token,
            "bos_token": hf.bos_token,
            "pad_token": hf.pad_token,
            "unk_token": hf.unk_token,
            "chat_template": hf.chat_template,
            "model_max_length": model.context_len,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, object]:
        check_model(body.model)
        preparer.check_token_ids(body.tokens, "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> JSONResponse:
        check_admin(request, admin_api_key)
        handles = [w for role in (pb.BOTH, pb.PREFILL, pb.DECODE) for w in pool.workers(role)]
        results = await asyncio.gather(*(_flush(w.stub) for w in handles))
        refused = {w.worker_id: why for w, why in zip(handles, results, strict=True) if why}
        if refused:
            detail = "; ".join(f"{wid}: {why}" for wid, why in sorted(refused.items()))
            raise bad_request(f"cache not flushed on every worker ({detail})")
        return JSONResponse({"flushed": True, "workers": len(handles)})


async def _flush(stub: Any) -> str:
    """'' when the worker flushed its cache, else why not."""
    try:
        reply = await stub.FlushCache(pb.FlushCacheRequest(), timeout=FLUSH_TIMEOUT_S)
    except grpc.aio.AioRpcError as e:
        return f"{e.code().name}: {e.details()}"
    return "" if reply.flushed else reply.message or "refused"


async def admin_body(
    request: Request, admin_api_key: str | None, model: type[BodyModel]
) -> BodyModel:
    """An admin endpoint's JSON body as `model`, after the key is checked (so that a
    stranger learns nothing of the body's shape); a body that does not fit is a 400 naming
    the first field at fault."""
    check_admin(request, admin_api_key)
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or None
        raise bad_request(f"{where or 'body'}: {first['msg']}", where) from None


def check_admin(request: Request, admin_api_key: str | None) -> None:
    if admin_api_key is None:
        raise APIError(
            403,
            "admin endpoints are disabled; start the router with an admin API key",
            type="permission_error",
        )
    presented = request.headers.get("authorization", "").encode()
    if not bearer_matches(presented, admin_api_key.encode()):
        raise APIError(
            401,
            "missing or invalid admin API key: send 'Authorization: Bearer <admin key>'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
