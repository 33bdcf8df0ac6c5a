"""Coordinator HTTP API: ledger queries, node liveness, metrics, health (docs/design.md §6).

Errors always have the shape ``{"error": {"message", "type", "code"}}``. Ledger
endpoints need an operator token (``coordinator.api.auth``): any operator role reads
its own tenant's blocks, only ``platform-admin`` sees every tenant and the nodes;
``/healthz`` and ``/readyz`` are open; ``/metrics`` needs the metrics bearer token
(``KVLEDGER_METRICS_TOKEN``) and answers 404 when none is configured.
"""

from __future__ import annotations

import collections
import logging
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import JSONResponse
from sqlalchemy import and_, exists, select
from sqlalchemy.ext.asyncio import AsyncSession

from coordinator import metrics
from coordinator.api.auth import require_tenant
from coordinator.api.dependencies import (
    PlatformAdmin,
    Reader,
    Readiness,
    Session,
    Settings,
    provide_api,
)
from coordinator.api.node_status import node_statuses
from coordinator.api.ops_app import probes
from coordinator.api.routes.dead_letters import router as dead_letters_router
from coordinator.api.routes.erasures import router as erasure_router
from coordinator.api.routes.governance import router as governance_router
from coordinator.api.routes.invalidations import router as invalidation_router
from coordinator.api.routes.keys import router as keys_router
from coordinator.api.routes.peers import router as peers_router
from coordinator.api.routes.producer_keys import router as producer_keys_router
from coordinator.api.routes.router import router as fleet_router_router
from coordinator.api.routes.usage import router as usage_router
from coordinator.api.ui import router as console_router
from coordinator.http import INTERNAL_ERROR_BODY, ApiError, install_error_handlers, iso
from coordinator.ledger.db import Database, DatabaseUnavailableMiddleware, database_lifespan
from coordinator.ledger.migrate import current_revision, head_revision
from coordinator.ledger.models import Block, BlockAuthScope, BlockDocument, Placement, Replica
from coordinator.ledger.states import PlacementState
from coordinator.readiness import ConsumerReadiness
from coordinator.settings import CoordinatorSettings
from events.logs import RequestIdMiddleware
from events.schema import Name, subject_digest
from events.tiers import Tier

log = logging.getLogger(__name__)

MAX_PAGE_SIZE = 1000

router = APIRouter()
"""The ledger's own routes: readiness, blocks and nodes."""


def create_app(
    settings: CoordinatorSettings, consumers: ConsumerReadiness | None = None
) -> FastAPI:
    """The coordinator app. Owns its :class:`Database`: created at startup, disposed at shutdown.

    ``consumers``: the readiness of the consumers running in this process (``--role all``);
    ``/readyz`` then also waits for them to consume. ValueError for a configuration the
    operator has to fix (:func:`coordinator.api.dependencies.provide_api`).
    """
    app = FastAPI(
        title="kvledger coordinator", version="1", lifespan=database_lifespan(settings.database)
    )
    provide_api(app, settings, consumers)
    for routes in (
        keys_router,
        invalidation_router,
        erasure_router,
        console_router,
        usage_router,
        governance_router,
        dead_letters_router,
        producer_keys_router,
        fleet_router_router,
        peers_router,
    ):
        app.include_router(routes)
    app.include_router(probes)
    app.include_router(router)

    app.add_middleware(DatabaseUnavailableMiddleware, retry_after_s=settings.http.retry_after_s)
    # Outermost: the request id is set before any handler logs. It replaces uvicorn's access
    # log, which prints the query string: ?subject= is a raw subject id.
    app.add_middleware(
        RequestIdMiddleware,
        access_logger="coordinator.access",
        error_body=INTERNAL_ERROR_BODY,
        observe=metrics.observe_http,
    )
    install_error_handlers(app)
    return app


@router.get("/readyz")
async def readyz(request: Request, readiness: Readiness) -> JSONResponse:
    database: Database = request.app.state.database
    try:
        async with database.engine.connect() as connection:
            revision = await current_revision(connection)
    except Exception as exc:  # noqa: BLE001 - any failure to reach the ledger means "not ready"
        log.warning("readiness: database unreachable (%s)", type(exc).__name__)
        return JSONResponse(
            status_code=503, content={"status": "not_ready", "reason": "database unreachable"}
        )
    head = head_revision()
    if revision != head:
        reason = f"database schema at {revision or 'no revision'}, migrations head is {head}"
        return JSONResponse(status_code=503, content={"status": "not_ready", "reason": reason})
    problem = None if readiness is None else readiness.problem()
    if problem is not None:
        return JSONResponse(status_code=503, content={"status": "not_ready", "reason": problem})
    return JSONResponse(content={"status": "ready", "revision": revision})


@router.get("/v1/ledger/blocks")
async def ledger_blocks(
    reader: Reader,
    session: Session,
    settings: Settings,
    tenant: Annotated[Name | None, Query()] = None,
    doc_id: Annotated[Name | None, Query()] = None,
    subject: Annotated[Name | None, Query()] = None,
    node: Annotated[Name | None, Query()] = None,
    tier: Tier | None = None,
    include_deleted: bool = False,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE)] = 100,
    after: Annotated[str | None, Query(pattern=r"^(?:[0-9a-f]{2}){1,64}$")] = None,
) -> dict[str, Any]:
    """Blocks matching every given filter, with provenance and placements, ordered by hash.

    A placement of a copy pulled from a peer names its source node and pull time in
    ``replica_of`` (None for a copy computed on its node).

    By default only blocks with a live copy (on ``node``/``tier`` when given) are listed,
    with their live placements; ``include_deleted=true`` lists every block ever
    recorded and every placement with its state. Page with ``after=<next_cursor>``.
    A tenant-bound operator sees only its own tenant (``tenant`` defaults to it).
    """
    if not reader.is_platform_admin:
        tenant = reader.tenant_id if tenant is None else tenant
        require_tenant(reader, tenant)
    query = select(Block).order_by(Block.block_hash).limit(limit)
    if tenant is not None:
        query = query.where(Block.tenant_id == tenant)
    if doc_id is not None:
        query = query.where(
            exists().where(
                BlockDocument.block_hash == Block.block_hash, BlockDocument.doc_id == doc_id
            )
        )
    if subject is not None:
        query = query.where(
            Block.subject_hash == _subject_hash(settings.ledger.subject_key, tenant, subject)
        )
    placement_filter = [Placement.block_hash == Block.block_hash]
    if node is not None:
        placement_filter.append(Placement.node_id == node)
    if tier is not None:
        placement_filter.append(Placement.tier == tier)
    if not include_deleted:
        placement_filter.append(Placement.state == PlacementState.LIVE)
    if len(placement_filter) > 1:
        query = query.where(exists().where(and_(*placement_filter)))
    if after is not None:
        query = query.where(Block.block_hash > bytes.fromhex(after))
    blocks = (await session.scalars(query)).all()
    return {
        "blocks": await _describe_blocks(session, blocks, include_deleted),
        "next_cursor": blocks[-1].block_hash.hex() if len(blocks) == limit else None,
    }


@router.get("/v1/nodes")
async def nodes(_: PlatformAdmin, session: Session, settings: Settings) -> dict[str, Any]:
    """Known nodes, liveness from the age of their last heartbeat or event, live copies per tier."""
    return {"nodes": await node_statuses(session, settings.ledger.heartbeat_timeout_s)}


def _subject_hash(subject_key: Any, tenant: str | None, subject: str) -> bytes:
    """The keyed digest nodes record for ``subject`` (raw subjects never reach the ledger)."""
    if tenant is None:
        raise ApiError(
            400,
            "invalid_request_error",
            "tenant_required",
            "the subject filter needs tenant= as well",
        )
    if subject_key is None:
        raise ApiError(
            503,
            "server_error",
            "subject_key_not_configured",
            "the coordinator has no subject key (KVLEDGER_SUBJECT_KEY)",
        )
    if not subject:
        raise ApiError(
            400, "invalid_request_error", "invalid_parameter", "subject must be non-empty"
        )
    return bytes.fromhex(subject_digest(subject_key.get_secret_value().encode(), tenant, subject))


async def _describe_blocks(
    session: AsyncSession, blocks: list[Block], include_deleted: bool
) -> list[dict[str, Any]]:
    hashes = [block.block_hash for block in blocks]
    if not hashes:
        return []
    auth_scopes: dict[bytes, list[dict]] = collections.defaultdict(list)
    for row in await session.scalars(
        select(BlockAuthScope)
        .where(BlockAuthScope.block_hash.in_(hashes))
        .order_by(BlockAuthScope.auth_scope)
    ):
        auth_scopes[row.block_hash].append(
            {"auth_scope": row.auth_scope, "policy_version": row.policy_version}
        )
    documents: dict[bytes, list[dict]] = collections.defaultdict(list)
    for row in await session.scalars(
        select(BlockDocument)
        .where(BlockDocument.block_hash.in_(hashes))
        .order_by(BlockDocument.doc_id, BlockDocument.version)
    ):
        documents[row.block_hash].append({"doc_id": row.doc_id, "version": row.version})
    replicas = {
        (row.block_hash, row.node_id): {
            "source_node_id": row.source_node_id,
            "pulled_at": iso(row.pulled_at),
        }
        for row in await session.scalars(select(Replica).where(Replica.block_hash.in_(hashes)))
    }
    placements: dict[bytes, list[dict]] = collections.defaultdict(list)
    placement_query = select(Placement).where(Placement.block_hash.in_(hashes))
    if not include_deleted:
        placement_query = placement_query.where(Placement.state == PlacementState.LIVE)
    for row in await session.scalars(
        placement_query.order_by(Placement.node_id, Placement.tier, Placement.snapshot_id)
    ):
        placements[row.block_hash].append(
            {
                "node_id": row.node_id,
                "tier": row.tier,
                "snapshot_id": row.snapshot_id,
                "state": row.state,
                "epoch": row.epoch,
                "reason": row.reason,
                "updated_at": iso(row.updated_at),
                "replica_of": replicas.get((row.block_hash, row.node_id)),
            }
        )
    return [
        {
            "block_hash": block.block_hash.hex(),
            "parent_hash": block.parent_hash.hex() if block.parent_hash is not None else None,
            "namespace": block.namespace,
            "tenant_id": block.tenant_id,
            "scope": block.scope,
            "subject_hash": block.subject_hash.hex() if block.subject_hash is not None else None,
            "token_offset": block.token_offset,
            "created_at": iso(block.created_at),
            "auth_scopes": auth_scopes[block.block_hash],
            "documents": documents[block.block_hash],
            "placements": placements[block.block_hash],
        }
        for block in blocks
    ]
