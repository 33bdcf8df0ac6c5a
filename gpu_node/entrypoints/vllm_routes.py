"""vLLM's operational routes, served beside the node's own (``/healthz``, ``/readyz``).

Clients built for vLLM probe a server with vLLM's routes before they send any
request: the vLLM project's benchmark ``guidellm`` refuses a server whose
``GET /health`` fails, and SageMaker-style hosts poll ``/ping``. Both answer
200 only once the node is ready (it has replayed pending invalidations), the
same condition as ``/readyz``, and 503 in OpenAI's error shape before — so a
load balancer or benchmark that trusts them never reaches a node that still
holds blocks it must not serve. Like ``/healthz``/``/readyz`` they need no
token: they reveal only readiness.

``GET /version`` names the node's software version. That helps an attacker
pick known flaws, so unlike vLLM it answers authenticated end users only.

guidellm's default request type is chat completions (``/v1/chat/completions``,
streamed, with ``stream_options.include_usage``), which the node serves with
full governance; the legacy text-completions route is not served.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Depends, Response


def node_version() -> str:
    """The installed ``kvledger`` distribution's version ("unknown" when run from an uninstalled
    tree)."""
    try:
        return version("kvledger")
    except PackageNotFoundError:
        return "unknown"


def vllm_router(require_ready, caller) -> APIRouter:
    """Routes that answer as vLLM's do.

    ``require_ready`` raises the node's 503 ``not_ready`` error until the engine is
    ready; ``caller`` is the dependency that authenticates an end user's token.
    Both come from the node's app, so the answers and errors are exactly its own.
    """
    router = APIRouter()

    @router.get("/health", dependencies=[Depends(require_ready)])
    async def health() -> Response:
        """vLLM answers an empty 200 when the engine can serve."""
        return Response(status_code=200)

    @router.api_route("/ping", methods=["GET", "POST"], dependencies=[Depends(require_ready)])
    async def ping() -> dict:
        """SageMaker's health check (it POSTs or GETs ``/ping``); vLLM answers it as ``/health``."""
        return {}

    @router.get("/version", dependencies=[Depends(caller)])
    async def node_software_version() -> dict:
        return {"version": node_version()}

    return router
