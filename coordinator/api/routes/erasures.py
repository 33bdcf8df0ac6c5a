"""HTTP API of privacy erasures, receipts and the audit log (docs/design.md §6; documents in
docs/receipts.md).

* ``POST /v1/erasures {tenant_id, subject_id, reason[, request_id]}`` (role ``privacy-officer`` of
  that tenant, or ``platform-admin``) → 202 ``{id, status}``. Idempotent on the ``Idempotency-Key``
  header or the body's ``request_id``: a retry returns the same erasure and starts nothing (409
  ``idempotency_conflict`` if the key named another subject). Without either, every call is a new
  erasure. The body is never logged or echoed in an error: ``subject_id`` is a person's identifier.
* ``GET /v1/erasures?tenant=&status=&limit=&before=`` (any operator role; ``tenant`` defaults to a
  tenant-bound caller's own) — newest first, paged with ``before=<next_cursor>``.
* ``GET /v1/erasures/{id}`` (any operator role of the erasure's tenant, or ``platform-admin``) —
  status and per node × tier progress: what each node reported (removed, method, verified) and the
  subject's live copies the ledger still shows.
* ``GET /v1/erasures/{id}/receipt[?tree_size=N]`` and ``GET
  /v1/audit/proof/{receipt_id}[?tree_size=N]`` (same roles) — the served receipt: the signed
  receipt, its inclusion proof in the latest (or size-N) signed tree head and the consistency proof
  from the tree head at issue.
* ``GET /v1/audit/checkpoint`` (open) — the latest signed tree head.
* ``GET /v1/receipts/keys`` (open) — every key that ever signed a receipt or tree head.

``kvledger verify-receipt`` takes these documents exactly as served. A tenant-bound
operator gets 403 ``tenant_forbidden`` for an erasure or receipt outside its tenant and
for an id that does not exist alike (``coordinator.api.auth``); only ``platform-admin`` sees 404s.
"""

from __future__ import annotations

import collections
import logging
import uuid
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from sqlalchemy import select, tuple_
from sqlalchemy.ext.asyncio import AsyncSession

from coordinator.api.auth import require_tenant
from coordinator.api.dependencies import CommandSigner, ErasureRequester, Reader, Session, Settings
from coordinator.audit import receipts
from coordinator.audit.audit_log import (
    AuditLogCorrupted,
    latest_tree_head,
    leaf_hashes,
    tree_head_document,
)
from coordinator.handlers.erasure import IdempotencyConflict, Progress, progress, start_erasure
from coordinator.http import error_response, iso
from coordinator.ledger.models import Erasure, Receipt, ReceiptKey, TreeHead
from coordinator.ledger.states import ErasureStatus, TargetStatus
from coordinator.ledger.transactions import begin_ledger_transaction, lock_decisions
from events.schema import Name, ReasonText
from events.tiers import Tier
from identity.tokens import Operator

log = logging.getLogger(__name__)

MAX_PAGE_SIZE = 1000


class ErasureRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant_id: Name
    subject_id: Name
    reason: ReasonText
    request_id: Name | None = None
    """The caller's id for this request; the ``Idempotency-Key`` header does the same."""


TreeSize = Annotated[int | None, Query(ge=1)]


router = APIRouter()


@router.post("/v1/erasures")
async def request_erasure(
    body: ErasureRequest,
    requester: ErasureRequester,
    session: Session,
    settings: Settings,
    command_signer: CommandSigner,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=512)] = None,
) -> JSONResponse:
    """Start an erasure (202); a retry with the same key answers with the same erasure."""
    require_tenant(requester, body.tenant_id)
    subject_key = settings.ledger.subject_key
    if subject_key is None:
        return error_response(
            503,
            "server_error",
            "subject_key_not_configured",
            "the coordinator has no subject key (KVLEDGER_SUBJECT_KEY)",
        )
    if (
        idempotency_key is not None
        and body.request_id is not None
        and idempotency_key != body.request_id
    ):
        return error_response(
            400,
            "invalid_request_error",
            "idempotency_key_mismatch",
            "the Idempotency-Key header and request_id differ; send one of them",
        )
    key = idempotency_key or body.request_id or str(uuid.uuid4())
    try:
        async with session.begin():
            now = await begin_ledger_transaction(session)
            await lock_decisions(session)
            started = await start_erasure(
                session,
                subject_key=subject_key.get_secret_value().encode(),
                command_signer=command_signer,
                tenant_id=body.tenant_id,
                subject_id=body.subject_id,
                reason=body.reason,
                idempotency_key=key,
                now=now,
                trigger="api",
            )
    except IdempotencyConflict as conflict:
        return error_response(409, "invalid_request_error", "idempotency_conflict", str(conflict))
    except ValueError as error:
        # start_erasure's messages name the field, never its value.
        return error_response(400, "invalid_request_error", "invalid_parameter", str(error))
    erasure = started.erasure
    return JSONResponse(status_code=202, content={"id": str(erasure.id), "status": erasure.status})


@router.get("/v1/erasures")
async def get_erasures(
    reader: Reader,
    session: Session,
    tenant: Annotated[Name | None, Query()] = None,
    status: ErasureStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE)] = 100,
    before: Annotated[str | None, Query(max_length=80)] = None,
) -> Any:
    """Newest first; page with ``before=<next_cursor>``. ``tenant`` defaults to a tenant-bound caller's own."""
    try:
        return await list_erasures(
            session, reader, tenant=tenant, status=status, limit=limit, before=before
        )
    except ValueError as error:
        return error_response(400, "invalid_request_error", "invalid_parameter", str(error))


@router.get("/v1/erasures/{erasure_id}")
async def get_erasure(erasure_id: uuid.UUID, reader: Reader, session: Session) -> Any:
    erasure = await readable_erasure(session, reader, erasure_id)
    if erasure is None:
        return error_response(
            404, "invalid_request_error", "erasure_not_found", f"no erasure {erasure_id}"
        )
    return await describe_erasure(session, erasure)


@router.get("/v1/erasures/{erasure_id}/receipt")
async def get_receipt(
    erasure_id: uuid.UUID, reader: Reader, session: Session, tree_size: TreeSize = None
) -> Any:
    erasure = await readable_erasure(session, reader, erasure_id)
    if erasure is None:
        return error_response(
            404, "invalid_request_error", "erasure_not_found", f"no erasure {erasure_id}"
        )
    receipt = await session.scalar(select(Receipt).where(Receipt.erasure_id == erasure.id))
    if receipt is None:
        return error_response(
            404,
            "invalid_request_error",
            "receipt_not_issued",
            f"the erasure is {erasure.status}; no receipt yet",
        )
    return await served_receipt(session, receipt, tree_size)


@router.get("/v1/audit/proof/{receipt_id}")
async def get_proof(
    receipt_id: uuid.UUID, reader: Reader, session: Session, tree_size: TreeSize = None
) -> Any:
    receipt = await session.get(Receipt, receipt_id)
    erasure = None if receipt is None else await session.get(Erasure, receipt.erasure_id)
    require_tenant(reader, None if erasure is None else erasure.tenant_id)
    if receipt is None:
        return error_response(
            404, "invalid_request_error", "receipt_not_found", f"no receipt {receipt_id}"
        )
    return await served_receipt(session, receipt, tree_size)


@router.get("/v1/audit/checkpoint")
async def checkpoint(session: Session) -> Any:
    head = await latest_tree_head(session)
    if head is None:
        return error_response(
            404, "invalid_request_error", "audit_log_empty", "no receipt has been issued yet"
        )
    return tree_head_document(head)


@router.get("/v1/receipts/keys")
async def receipt_keys(session: Session) -> dict[str, Any]:
    rows = (
        await session.scalars(select(ReceiptKey).order_by(ReceiptKey.created_at, ReceiptKey.key_id))
    ).all()
    return receipts.public_key_document(
        receipts.ReceiptPublicKey(row.public_key, receipts.rfc3339(row.created_at)) for row in rows
    )


async def readable_erasure(
    session: AsyncSession, reader: Operator, erasure_id: uuid.UUID
) -> Erasure | None:
    """The erasure, None if there is none (only a platform admin learns that); another tenant's raises
    :class:`coordinator.api.auth.TenantForbiddenError`, as a missing one does for a tenant-bound reader."""
    erasure = await session.get(Erasure, erasure_id)
    require_tenant(reader, None if erasure is None else erasure.tenant_id)
    return erasure


def _cursor(requested_at: datetime, erasure_id: uuid.UUID) -> str:
    return f"{requested_at.isoformat()}~{erasure_id}"


async def list_erasures(
    session: AsyncSession,
    reader: Operator,
    *,
    tenant: str | None = None,
    status: str | None = None,
    limit: int = 100,
    before: str | None = None,
) -> dict[str, Any]:
    """Erasures newest first, as ``GET /v1/erasures`` and the console list them; ``before`` is a
    ``next_cursor``.

    ``tenant`` defaults to a tenant-bound ``reader``'s own; another tenant raises
    :class:`coordinator.api.auth.TenantForbiddenError`. ValueError for a malformed cursor.
    """
    if not reader.is_platform_admin:
        tenant = reader.tenant_id if tenant is None else tenant
        require_tenant(reader, tenant)
    query = select(Erasure).order_by(Erasure.requested_at.desc(), Erasure.id.desc()).limit(limit)
    if tenant is not None:
        query = query.where(Erasure.tenant_id == tenant)
    if status is not None:
        query = query.where(Erasure.status == status)
    if before is not None:
        at, _, last_id = before.partition("~")
        try:
            position = (datetime.fromisoformat(at), uuid.UUID(last_id))
        except ValueError:
            raise ValueError("before: not a cursor this API returned") from None
        query = query.where(tuple_(Erasure.requested_at, Erasure.id) < position)
    erasures = (await session.scalars(query)).all()
    receipt_ids = dict(
        (
            await session.execute(
                select(Receipt.erasure_id, Receipt.receipt_id).where(
                    Receipt.erasure_id.in_([e.id for e in erasures])
                )
            )
        ).all()
    )
    return {
        "erasures": [
            {
                "id": str(erasure.id),
                "tenant_id": erasure.tenant_id,
                "reason": erasure.reason,
                "status": erasure.status,
                "requested_at": iso(erasure.requested_at),
                "verified_at": iso(erasure.verified_at),
                "receipt_id": None
                if erasure.id not in receipt_ids
                else str(receipt_ids[erasure.id]),
            }
            for erasure in erasures
        ],
        "next_cursor": _cursor(erasures[-1].requested_at, erasures[-1].id)
        if len(erasures) == limit
        else None,
    }


async def describe_erasure(session: AsyncSession, erasure: Erasure) -> dict[str, Any]:
    """What ``GET /v1/erasures/{id}`` answers: status, commands and per node × tier progress."""
    receipt_id = await session.scalar(
        select(Receipt.receipt_id).where(Receipt.erasure_id == erasure.id)
    )
    return _describe(erasure, await progress(session, erasure), receipt_id)


async def served_receipt(session: AsyncSession, receipt: Receipt, tree_size: int | None) -> Any:
    """The served receipt with proofs into the latest tree head, or the one of ``tree_size``."""
    at_issue = await session.get(TreeHead, receipt.leaf_index + 1)
    assert at_issue is not None, f"receipt {receipt.receipt_id} without the tree head that added it"
    head = (
        await latest_tree_head(session)
        if tree_size is None
        else await session.get(TreeHead, tree_size)
    )
    if head is None:
        return error_response(
            404,
            "invalid_request_error",
            "tree_size_not_found",
            f"the audit log has no tree of size {tree_size}",
        )
    if head.tree_size < at_issue.tree_size:
        return error_response(
            400,
            "invalid_request_error",
            "tree_size_before_receipt",
            f"the receipt entered the log at tree size {at_issue.tree_size}; ask for that size or a later one",
        )
    try:
        leaves = await leaf_hashes(session, head.tree_size)
        return receipts.serve_receipt(
            receipt.document,
            receipt.leaf_index,
            tree_head_document(at_issue),
            tree_head_document(head),
            leaves,
        )
    except (AuditLogCorrupted, ValueError) as error:
        log.error("receipt %s cannot be served: %s", receipt.receipt_id, error)
        return error_response(
            500,
            "server_error",
            "audit_log_inconsistent",
            "the stored audit log does not hold this receipt",
        )


def _describe(erasure: Erasure, state: Progress, receipt_id: uuid.UUID | None) -> dict[str, Any]:
    """Status plus, per node × tier, what the nodes reported for every command and the ledger's live
    copies."""
    reported: dict[str, dict[str, list[dict[str, Any]]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )
    node_status: dict[str, set[str]] = collections.defaultdict(set)
    for target in state.targets:
        node_status[target.node_id].add(target.status)
        for item in target.evidence or []:
            reported[target.node_id][item["tier"]].append(item)
    nodes = []
    for node_id in sorted(set(node_status) | {node for node, _ in state.live}):
        statuses = node_status.get(node_id, set())
        status = next(
            (
                s
                for s in (TargetStatus.FAILED, TargetStatus.PENDING, TargetStatus.ACKED)
                if s in statuses
            ),
            "not_targeted",
        )
        tiers = {}
        for tier in Tier:
            items = reported[node_id][tier]
            tiers[tier] = {
                "removed": sum(item["removed"] for item in items),
                "methods": sorted({item["method"] for item in items}),
                "verified": all(item["verified"] for item in items) if items else None,
                "live": state.live.get((node_id, tier), 0),
            }
        nodes.append({"node_id": node_id, "status": status, "tiers": tiers})
    return {
        "id": str(erasure.id),
        "tenant_id": erasure.tenant_id,
        "subject_hash": erasure.subject_hash.hex(),
        "reason": erasure.reason,
        "status": erasure.status,
        "requested_at": iso(erasure.requested_at),
        "cutoff": iso(erasure.cutoff),
        "verified_at": iso(erasure.verified_at),
        "key_ids_destroyed": erasure.key_ids_destroyed,
        "receipt_id": None if receipt_id is None else str(receipt_id),
        "commands": [
            {"command_id": str(c.command_id), "trigger": c.trigger, "status": c.status}
            for c in state.commands
        ],
        "live_copies": sum(state.live.values()),
        "reported_key_ids_not_destroyed": state.contradicted_key_ids,
        "nodes": nodes,
    }
