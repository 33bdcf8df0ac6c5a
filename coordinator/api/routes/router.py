"""What a fleet router is built from (``kvledger router``, docs/architecture.md "Fleet router").

A router keeps an in-memory index of which node holds which block; it builds it here at start and
whenever it missed a node's kv-event:

* ``GET /v1/router/nodes``: every node's epoch, last applied kv-event seq, namespace and
  liveness, and the enrolled, unrevoked node keys (raw Ed25519, base64url) the router verifies
  kv-events with — the keys the coordinator's own consumers trust (``coordinator.keys.node_keys``);
* ``GET /v1/router/placements?node=…[&after=…][&limit=…]``: the node's live copies in its
  serving tiers (device, host, disk; snapshots are not served from) with the provenance a
  decision is matched against, ordered by placement id and paged with ``next_cursor``. A copy
  that a decision marked and whose target on this node has not acked is left out: it is being
  deleted, and must not attract traffic. Each page repeats the node's ``epoch`` and ``last_seq``
  as of that page; the router replays its own records after the first page's.
* ``GET /v1/router/versions[?cursor=…][&limit=…]``: the decisions a version registry holds —
  retired namespaces, current policy and document versions, each as its predicate and decision
  time — exactly the ``decisions`` a starting node gets from ``/v1/governance`` (the same
  readers), paged with ``next_cursor``. The router refuses stale versions with them from its start.

Callers: an operator token with the ``router`` role (or ``platform-admin``): the answer spans
every tenant, but holds block hashes, scopes and keyed digests only — no text, no raw subject.
"""

from __future__ import annotations

import base64
import collections
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from sqlalchemy import and_, exists, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from coordinator.api.auth import requires
from coordinator.api.dependencies import Session, Settings
from coordinator.api.node_status import node_statuses
from coordinator.api.routes.governance import DECISION_READERS, Cursor
from coordinator.http import ApiError
from coordinator.ledger.models import (
    Block,
    BlockAuthScope,
    BlockCreator,
    BlockDocument,
    InvalidationTarget,
    Node,
    NodeKey,
    Placement,
)
from coordinator.ledger.states import PlacementState, TargetStatus
from events.schema import Name
from events.tiers import STORAGE_TIERS
from identity.roles import ROUTER_READERS
from identity.tokens import Operator

MAX_PAGE_SIZE = 5000
MAX_VERSION_PAGE = 1000

router = APIRouter()
RouterReader = Annotated[Operator, Depends(requires(ROUTER_READERS))]


@router.get("/v1/router/nodes")
async def router_nodes(_: RouterReader, session: Session, settings: Settings) -> dict[str, Any]:
    keys = await session.scalars(
        select(NodeKey).where(NodeKey.revoked_at.is_(None)).order_by(NodeKey.key_id)
    )
    return {
        "nodes": [
            {
                name: status[name]
                for name in (
                    "node_id",
                    "epoch",
                    "last_seq",
                    "namespace",
                    "alive",
                    "last_seen_age_s",
                )
            }
            for status in await node_statuses(session, settings.ledger.heartbeat_timeout_s)
        ],
        "node_keys": [
            {
                "key_id": key.key_id,
                "node_id": key.node_id,
                "public_key": base64.urlsafe_b64encode(key.public_key).decode().rstrip("="),
            }
            for key in keys
        ],
    }


@router.get("/v1/router/versions")
async def router_versions(
    _: RouterReader,
    session: Session,
    cursor: Annotated[str | None, Query(max_length=2048)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_VERSION_PAGE)] = MAX_VERSION_PAGE,
) -> dict[str, Any]:
    try:
        position = Cursor(section=0, after=[]) if cursor is None else Cursor.decode(cursor)
    except ValueError as error:
        raise ApiError(400, "invalid_request_error", "invalid_parameter", str(error)) from None
    sections = list(DECISION_READERS)
    decisions: list[dict] = []
    section, after = position.section, list(position.after)
    while section < len(sections):
        room = limit - len(decisions)
        entries = await DECISION_READERS[sections[section]](session, after, room + 1)
        decisions.extend(decision for _, decision in entries[:room])
        if len(entries) > room:
            last = entries[room - 1][0] if room else after
            return {
                "decisions": decisions,
                "next_cursor": Cursor(section=section, after=last).encode(),
            }
        section, after = section + 1, []
    return {"decisions": decisions, "next_cursor": None}


@router.get("/v1/router/placements")
async def router_placements(
    _: RouterReader,
    session: Session,
    node: Annotated[Name, Query()],
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE)] = 1000,
    after: Annotated[int, Query(ge=0)] = 0,
) -> dict[str, Any]:
    row = await session.get(Node, node)
    if row is None:
        raise ApiError(404, "invalid_request_error", "unknown_node", "no such node in the ledger")
    pending_deletion = exists().where(
        and_(
            InvalidationTarget.command_id == Placement.invalidation_id,
            InvalidationTarget.node_id == Placement.node_id,
            InvalidationTarget.status != TargetStatus.ACKED,
        )
    )
    page = (
        await session.execute(
            select(Placement.id, Placement.block_hash, Placement.tier)
            .where(
                Placement.node_id == node,
                Placement.state == PlacementState.LIVE,
                Placement.tier.in_([str(tier) for tier in STORAGE_TIERS]),
                Placement.id > after,
                ~pending_deletion,
            )
            .order_by(Placement.id)
            .limit(limit)
        )
    ).all()
    provenance = await _provenance(session, list({block_hash for _, block_hash, _ in page}))
    return {
        "node_id": node,
        "epoch": row.epoch,
        "last_seq": row.last_seq,
        "placements": [
            {"block_hash": block_hash.hex(), "tier": tier, **provenance[block_hash]}
            for _, block_hash, tier in page
        ],
        "next_cursor": page[-1][0] if len(page) == limit else None,
    }


async def _provenance(session: AsyncSession, hashes: list[bytes]) -> dict[bytes, dict[str, Any]]:
    if not hashes:
        return {}
    documents: dict[bytes, list[list]] = collections.defaultdict(list)
    for block_hash, doc_id, version in await session.execute(
        select(BlockDocument.block_hash, BlockDocument.doc_id, BlockDocument.version).where(
            BlockDocument.block_hash.in_(hashes)
        )
    ):
        documents[block_hash].append([doc_id, version])
    auth_scopes: dict[bytes, list[list]] = collections.defaultdict(list)
    for block_hash, auth_scope, version in await session.execute(
        select(
            BlockAuthScope.block_hash, BlockAuthScope.auth_scope, BlockAuthScope.policy_version
        ).where(BlockAuthScope.block_hash.in_(hashes))
    ):
        auth_scopes[block_hash].append([auth_scope, version])
    creators: dict[bytes, list[str]] = collections.defaultdict(list)
    for block_hash, subject_hash in await session.execute(
        select(BlockCreator.block_hash, BlockCreator.subject_hash).where(
            BlockCreator.block_hash.in_(hashes)
        )
    ):
        creators[block_hash].append(subject_hash.hex())
    blocks = await session.execute(
        select(
            Block.block_hash,
            Block.namespace,
            Block.tenant_id,
            Block.subject_hash,
            func.extract("epoch", Block.created_at),
        ).where(Block.block_hash.in_(hashes))
    )
    return {
        block_hash: {
            "namespace": namespace,
            "tenant_id": tenant_id,
            "subject_id": None if subject_hash is None else subject_hash.hex(),
            "created_at": float(created_at),
            "documents": sorted(documents[block_hash]),
            "auth_scopes": sorted(auth_scopes[block_hash]),
            "creators": sorted(creators[block_hash]),
        }
        for block_hash, namespace, tenant_id, subject_hash, created_at in blocks
    }
