"""The HTTP face of ``kvledger coordinator --role consumers``: health, readiness, metrics.

A consumers-only process serves no ledger API, but the operator still has to scrape it
and a supervisor still has to probe it: ``/healthz`` (the process answers), ``/readyz``
(its consumer groups hold their partitions and know their positions, so records are being ingested) and ``/metrics``
behind the metrics bearer token, exactly as on the API (docs/operations.md).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from coordinator import metrics
from coordinator.consumers import ConsumerReadiness
from coordinator.db import Database, DatabaseUnavailableMiddleware, database_lifespan
from coordinator.http import INTERNAL_ERROR_BODY, error_response
from coordinator.settings import CoordinatorSettings
from events.logs import RequestIdMiddleware
from identity.metrics_access import scrape_refusal


def create_ops_app(settings: CoordinatorSettings, readiness: ConsumerReadiness) -> FastAPI:
    """``readiness`` is the one the process's consumers report to: ``/readyz`` is 200 once they consume."""

    app = FastAPI(
        title="kvledger coordinator consumers",
        lifespan=database_lifespan(settings.database),
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        problem = readiness.problem()
        if problem is not None:
            return JSONResponse(status_code=503, content={"status": "not_ready", "reason": problem})
        return JSONResponse(content={"status": "ready"})

    @app.get("/metrics")
    async def metrics_endpoint(request: Request) -> Response:
        refusal = scrape_refusal(request.headers.get("authorization"), settings.metrics.token)
        if refusal is not None:
            status_code, code, message = refusal
            error_type = "authentication_error" if status_code == 401 else "invalid_request_error"
            return error_response(status_code, error_type, code, message)
        database: Database = request.app.state.database
        async with database.session() as session:
            body = await metrics.exposition(session, settings.ledger.heartbeat_timeout_s)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(DatabaseUnavailableMiddleware, retry_after_s=settings.http.retry_after_s)
    app.add_middleware(
        RequestIdMiddleware, access_logger="coordinator.access", error_body=INTERNAL_ERROR_BODY, observe=metrics.observe_http
    )
    return app
