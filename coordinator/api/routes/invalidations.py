"""HTTP API of invalidations and namespace rollout.

* ``GET /v1/invalidations/{command_id}`` — one command: predicate, cutoff, status, timings and, per
  expected node × tier, the node's evidence and what the ledger shows (live copies the predicate
  still covers, copies the command deleted).
* ``GET /v1/invalidations?tenant=&doc_id=&status=&kind=&limit=&before=`` — newest first, paged by
  ``seq``.
* ``GET /v1/namespaces`` (``platform-admin``) — namespaces, lifecycle status, nodes serving each.
* ``POST /v1/namespaces/{namespace}/retire`` (``platform-admin``) — the namespace turns ``draining``
  and a namespace-wide ``Invalidate`` goes out through the outbox; it is ``retired`` once every node
  acked. Refused (409 ``namespace_in_use``) while a live node still serves it: that node would keep
  rebuilding what is being deleted.

Invalidation reads take any operator role; a tenant-bound operator sees only the
commands whose predicate names its tenant and gets 403 ``tenant_forbidden`` for any
other id, existing or not (namespace-wide commands belong to no tenant: ``platform-admin``
only). Errors use the API's
``{"error": {"message", "type", "code"}}`` shape. Times are the ledger database's clock.
"""

from __future__ import annotations

import collections
import uuid
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query
from fastapi.responses import JSONResponse
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from coordinator.api.auth import require_tenant
from coordinator.api.dependencies import CommandSigner, PlatformAdmin, Reader, Session, Settings
from coordinator.handlers.decisions import decide, deleted_by, live_copies_matching, parse_predicate
from coordinator.http import error_response, iso
from coordinator.ledger.models import Invalidation, InvalidationTarget, Namespace, Node
from coordinator.ledger.states import InvalidationStatus, NamespaceStatus, TargetStatus
from coordinator.ledger.transactions import begin_ledger_transaction, lock_decisions
from events.schema import Name, NamespacePredicate
from events.tiers import Tier
from identity.tokens import Operator

MAX_PAGE_SIZE = 1000


def _ms(start: datetime, end: datetime | None) -> float | None:
    return None if end is None else round((end - start).total_seconds() * 1000, 3)


router = APIRouter()


@router.get("/v1/invalidations/{command_id}")
async def get_invalidation(command_id: uuid.UUID, reader: Reader, session: Session) -> Any:
    invalidation = await session.get(Invalidation, command_id)
    require_tenant(reader, None if invalidation is None else invalidation.predicate.get("tenant"))
    if invalidation is None:
        return error_response(
            404, "invalid_request_error", "invalidation_not_found", f"no invalidation {command_id}"
        )
    return await describe_invalidation(session, invalidation)


@router.get("/v1/invalidations")
async def get_invalidations(
    reader: Reader,
    session: Session,
    tenant: Annotated[Name | None, Query()] = None,
    doc_id: Annotated[Name | None, Query()] = None,
    status: InvalidationStatus | None = None,
    kind: Literal["document", "policy", "subject", "namespace", "tenant"] | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE)] = 100,
    before: Annotated[int | None, Query(ge=1)] = None,
) -> dict[str, Any]:
    """Newest first; page with ``before=<next_cursor>``. ``tenant`` defaults to a tenant-bound caller's own."""
    return await list_invalidations(
        session,
        reader,
        tenant=tenant,
        doc_id=doc_id,
        status=status,
        kind=kind,
        limit=limit,
        before=before,
    )


@router.get("/v1/namespaces")
async def list_namespaces(_: PlatformAdmin, session: Session) -> dict[str, Any]:
    namespaces = (await session.scalars(select(Namespace).order_by(Namespace.namespace))).all()
    serving = await _serving_nodes(session)
    return {"namespaces": [_namespace(ns, serving[ns.namespace]) for ns in namespaces]}


@router.post("/v1/namespaces/{namespace}/retire")
async def retire_namespace(
    namespace: Annotated[Name, Path()],
    _: PlatformAdmin,
    session: Session,
    settings: Settings,
    command_signer: CommandSigner,
) -> JSONResponse:
    """Start draining ``namespace`` (202), or report the retirement already under way or done (200)."""
    async with session.begin():
        now = await begin_ledger_transaction(session)
        await lock_decisions(session)
        row = await session.get(Namespace, namespace, with_for_update=True)
        if row is None:
            return error_response(
                404,
                "invalid_request_error",
                "namespace_not_found",
                "no such namespace in the ledger",
            )
        serving = (await _serving_nodes(session))[namespace]
        if row.status != NamespaceStatus.ACTIVE:
            return JSONResponse(status_code=200, content=_namespace(row, serving))
        alive = await session.scalars(
            select(Node.node_id)
            .where(
                Node.namespace == namespace,
                func.extract(
                    "epoch", func.now() - func.greatest(Node.last_heartbeat, Node.last_event_at)
                )
                < settings.ledger.heartbeat_timeout_s,
            )
            .order_by(Node.node_id)
        )
        in_use = alive.all()
        if in_use:
            return error_response(
                409,
                "invalid_request_error",
                "namespace_in_use",
                f"live nodes still serve this namespace: {', '.join(in_use)}; roll them to the new one first",
            )
        decision = await decide(
            session,
            NamespacePredicate(ns=namespace),
            signer=command_signer,
            now=now,
            trigger="api",
            requested_at=now,
        )
        row.status = NamespaceStatus.DRAINING if decision.num_targets else NamespaceStatus.RETIRED
        row.invalidation_id = decision.command_id
        row.updated_at = now
    return JSONResponse(status_code=202, content=_namespace(row, serving))


async def list_invalidations(
    session: AsyncSession,
    reader: Operator,
    *,
    tenant: str | None = None,
    doc_id: str | None = None,
    status: str | None = None,
    kind: str | None = None,
    limit: int = 100,
    before: int | None = None,
) -> dict[str, Any]:
    """Invalidations newest first with their ack counts, as ``GET /v1/invalidations`` and the console list them.

    ``tenant`` defaults to a tenant-bound ``reader``'s own; another tenant raises
    :class:`coordinator.api.auth.TenantForbiddenError`. ``doc_id`` matches document predicates.
    """
    if not reader.is_platform_admin:
        tenant = reader.tenant_id if tenant is None else tenant
        require_tenant(reader, tenant)
    counts = (
        select(
            InvalidationTarget.command_id,
            func.count().label("num_targets"),
            func.count().filter(InvalidationTarget.status == TargetStatus.ACKED).label("num_acked"),
        )
        .group_by(InvalidationTarget.command_id)
        .subquery()
    )
    query = (
        select(Invalidation, counts.c.num_targets, counts.c.num_acked)
        .outerjoin(counts, counts.c.command_id == Invalidation.command_id)
        .order_by(Invalidation.seq.desc())
        .limit(limit)
    )
    if tenant is not None:
        query = query.where(Invalidation.predicate["tenant"].astext == tenant)
    if doc_id is not None:
        query = query.where(Invalidation.predicate["doc_id"].astext == doc_id)
    if status is not None:
        query = query.where(Invalidation.status == status)
    if kind is not None:
        query = query.where(Invalidation.kind == kind)
    if before is not None:
        query = query.where(Invalidation.seq < before)
    rows = (await session.execute(query)).all()
    return {
        "invalidations": [
            {
                **_summary(row.Invalidation),
                "num_targets": row.num_targets or 0,
                "num_acked": row.num_acked or 0,
            }
            for row in rows
        ],
        "next_cursor": rows[-1].Invalidation.seq if len(rows) == limit else None,
    }


async def _serving_nodes(session: AsyncSession) -> collections.defaultdict[str, list[str]]:
    serving: collections.defaultdict[str, list[str]] = collections.defaultdict(list)
    for node_id, namespace in await session.execute(
        select(Node.node_id, Node.namespace)
        .where(Node.namespace.is_not(None))
        .order_by(Node.node_id)
    ):
        serving[namespace].append(node_id)
    return serving


def _namespace(row: Namespace, nodes: list[str]) -> dict[str, Any]:
    return {
        "namespace": row.namespace,
        "status": row.status,
        "first_seen_at": iso(row.first_seen_at),
        "updated_at": iso(row.updated_at),
        "invalidation_id": None if row.invalidation_id is None else str(row.invalidation_id),
        "nodes": nodes,
    }


def _summary(invalidation: Invalidation) -> dict[str, Any]:
    return {
        "command_id": str(invalidation.command_id),
        "seq": invalidation.seq,
        "kind": invalidation.kind,
        "predicate": invalidation.predicate,
        "cutoff": iso(invalidation.cutoff),
        "trigger": invalidation.trigger,
        "source_event_id": None
        if invalidation.source_event_id is None
        else str(invalidation.source_event_id),
        "parent_command_id": None
        if invalidation.parent_command_id is None
        else str(invalidation.parent_command_id),
        "status": invalidation.status,
        "requested_at": iso(invalidation.requested_at),
        "created_at": iso(invalidation.created_at),
        "completed_at": iso(invalidation.completed_at),
        "latency_ms": _ms(invalidation.created_at, invalidation.completed_at),
        "end_to_end_ms": _ms(invalidation.requested_at, invalidation.completed_at),
    }


async def describe_invalidation(
    session: AsyncSession, invalidation: Invalidation
) -> dict[str, Any]:
    """The summary plus, per expected node × tier: status, evidence, and the ledger's live/deleted
    counts.

    ``latency_ms`` runs from the decision to completion (or to a node's ack);
    ``end_to_end_ms`` from ``requested_at`` (the user's event), which is on the publisher's clock.
    """
    predicate = parse_predicate(invalidation.predicate)
    live = {
        (node_id, tier): count
        for node_id, tier, count in await session.execute(live_copies_matching(predicate))
    }
    deleted = {
        (node_id, tier): count
        for node_id, tier, count in await session.execute(deleted_by(invalidation.command_id))
    }
    targets = (
        await session.scalars(
            select(InvalidationTarget)
            .where(InvalidationTarget.command_id == invalidation.command_id)
            .order_by(InvalidationTarget.node_id)
        )
    ).all()
    described = []
    for target in targets:
        evidence = {item["tier"]: item for item in target.evidence or []}
        tiers = {}
        for tier in Tier:
            item = evidence.get(tier)
            if target.status == TargetStatus.PENDING:
                tier_status = "pending"
            elif item is None:
                tier_status = "untouched"
            else:
                tier_status = "verified" if item["verified"] else "failed"
            tiers[tier] = {
                "status": tier_status,
                "evidence": item,
                "ledger": {
                    "live": live.get((target.node_id, tier), 0),
                    "deleted": deleted.get((target.node_id, tier), 0),
                },
            }
        described.append(
            {
                "node_id": target.node_id,
                "status": target.status,
                "epoch": target.epoch,
                "acked_at": iso(target.acked_at),
                "latency_ms": _ms(invalidation.created_at, target.acked_at),
                "tiers": tiers,
            }
        )
    return {**_summary(invalidation), "targets": described}
