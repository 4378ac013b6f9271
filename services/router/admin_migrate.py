"""POST /admin/migrate (admin key): `Dispatcher.migrate` over HTTP (`migration.py` says
what a move is and what the answer holds)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from baton.services.router.dispatch import Dispatcher
from baton.services.router.errors import APIError, bad_request
from baton.services.router.migration import NoTarget, UnknownWorker
from baton.services.router.utility import check_admin


class MigrateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field the router does not honor is a 400

    request_ids: list[str] | None = None
    worker_id: str | None = None
    to: str | None = None


def add_migration_routes(app: FastAPI, dispatcher: Dispatcher, admin_api_key: str | None) -> None:
    @app.post("/admin/migrate")
    async def migrate(request: Request) -> JSONResponse:
        check_admin(request, admin_api_key)  # before the body: a stranger learns nothing
        try:
            body = MigrateBody.model_validate_json(await request.body())
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or None
            raise bad_request(f"{where or 'body'}: {first['msg']}", where) from None
        try:
            report = await dispatcher.migrate(body.request_ids, body.worker_id, body.to)
        except ValueError as e:
            raise bad_request(str(e), None) from None
        except UnknownWorker as e:
            raise APIError(404, str(e), code="not_found") from None
        except NoTarget as e:
            raise APIError(409, str(e), type="conflict", code="conflict") from None
        except TimeoutError as e:
            raise APIError(504, str(e), type="timeout") from None
        return JSONResponse(report.as_dict())
