"""POST /admin/migrate (admin key): `Dispatcher.migrate` over HTTP (`migration.py` says
what a move is and what the answer holds)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from baton.services.router.dispatch import Dispatcher
from baton.services.router.errors import APIError, bad_request
from baton.services.router.migration import NoTarget, UnknownWorker
from baton.services.router.utility import admin_body


class MigrateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field the router does not honor is a 400

    request_ids: list[str] | None = None
    worker_id: str | None = None
    to: str | None = None


def add_migration_routes(app: FastAPI, dispatcher: Dispatcher, admin_api_key: str | None) -> None:
    @app.post("/admin/migrate")
    async def migrate(request: Request) -> JSONResponse:
        body = await admin_body(request, admin_api_key, MigrateBody)
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
