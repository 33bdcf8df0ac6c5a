"""The HTTP face of ``kvledger coordinator --role consumers``: health, readiness, metrics.

A consumers-only process serves no ledger API, but the operator still has to scrape it and a
supervisor still has to probe it: ``/healthz`` (the process answers), ``/readyz`` (its consumer
groups hold their partitions and know their positions, so records are being ingested) and
``/metrics`` behind the metrics bearer token, exactly as on the API (docs/operations.md).
:data:`probes` (``/healthz``, ``/metrics``) is the same on both apps; each has its own ``/readyz``.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from coordinator import metrics
from coordinator.api.dependencies import Readiness, Session, Settings, provide, require_scraper
from coordinator.http import INTERNAL_ERROR_BODY, install_error_handlers
from coordinator.ledger.db import DatabaseUnavailableMiddleware, database_lifespan
from coordinator.readiness import ConsumerReadiness
from coordinator.settings import CoordinatorSettings
from events.logs import RequestIdMiddleware

probes = APIRouter()
"""What every coordinator process answers: liveness and metrics."""
router = APIRouter()
"""The consumers-only process's readiness."""


def create_ops_app(settings: CoordinatorSettings, readiness: ConsumerReadiness) -> FastAPI:
    """``readiness`` is the one the process's consumers report to: ``/readyz`` is 200 once they
    consume."""
    app = FastAPI(
        title="kvledger coordinator consumers",
        lifespan=database_lifespan(settings.database),
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    provide(app, settings, readiness)
    app.include_router(probes)
    app.include_router(router)
    app.add_middleware(DatabaseUnavailableMiddleware, retry_after_s=settings.http.retry_after_s)
    app.add_middleware(
        RequestIdMiddleware,
        access_logger="coordinator.access",
        error_body=INTERNAL_ERROR_BODY,
        observe=metrics.observe_http,
    )
    install_error_handlers(app)
    return app


@probes.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@probes.get("/metrics", dependencies=[Depends(require_scraper)])
async def metrics_endpoint(session: Session, settings: Settings) -> Response:
    return Response(
        await metrics.exposition(session, settings.ledger.heartbeat_timeout_s),
        media_type=CONTENT_TYPE_LATEST,
    )


@router.get("/readyz")
async def readyz(readiness: Readiness) -> JSONResponse:
    problem = None if readiness is None else readiness.problem()
    if problem is not None:
        return JSONResponse(status_code=503, content={"status": "not_ready", "reason": problem})
    return JSONResponse(content={"status": "ready"})
