"""The governance state a node must enforce, for a starting node (docs/design.md §6, "Governance
state").

``GET /v1/governance?nonce=…[&cursor=…][&limit=…]`` answers, for the calling node:

* ``decisions``: what the node must refuse older than — every retired (or draining)
  namespace, the current policy version of every tenant's auth scope and the current
  version of every tenant's document (a deleted one as ``below_version`` =
  ``ANY_VERSION``) — each as the predicate of the decision that made it current and
  that decision's time (its command's ``cutoff``), exactly what the node's version
  registry records from a command;
* ``pending_commands``: the commands this node is a target of and has not acked, in
  decision order, each a signed ``Invalidate`` envelope as the outbox would publish it;
* ``as_of_decision``: the last decision (``invalidations.seq``) the database held when
  the page was read.

A node does not learn the topic position from here: it notes the end offsets of
``kvledger.commands`` *before* its first request and consumes from them. Every
decision not in the state it fetched is committed after that request's snapshot, so
its command (published only after the commit, by the outbox) lies at or past those
offsets; one that is both in the state and on the topic is applied once and acked
again (``gpu_node.governance.commands``), and the registry keeps the latest decision by time,
so nothing is missed and nothing moves back.

Paging: at most ``limit`` (default and maximum :data:`MAX_PAGE_ENTRIES`) entries per
answer, sections in a fixed order (namespaces, policies, documents, commands), each in
its primary-key (or decision) order; ``next_cursor`` continues after the last entry,
null on the last page. Pages are read from separate snapshots; that is safe for the
same reason as above — what changed after the first page is on the topic past the
node's offsets, and versions never move back.

Only nodes may call it, with the credential the key service takes (an EdDSA JWT made
by the node's enrolled, unrevoked key, ``coordinator.keys.node_keys``); anything else is
401. The answer holds the node id and the node's ``nonce`` and is signed with the
command key (``identity.signing.sign_document``, context :data:`GOVERNANCE_CONTEXT`),
which nodes pin: a man in the middle can neither relax it nor replay an older one.
Responses carry ``Cache-Control: no-store``.
"""

from __future__ import annotations

import base64
import binascii
import json
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from sqlalchemy import func, select, tuple_
from sqlalchemy.ext.asyncio import AsyncSession

from coordinator.api.dependencies import CommandSigner, GovernanceCaller, Session
from coordinator.handlers.decisions import parse_predicate
from coordinator.http import error_response
from coordinator.ledger.models import Document, Invalidation, InvalidationTarget, Namespace, Policy
from coordinator.ledger.states import NamespaceStatus, TargetStatus
from events.schema import (
    ANY_VERSION,
    DocumentPredicate,
    Invalidate,
    NamespacePredicate,
    PolicyPredicate,
    Predicate,
    make_event,
)
from identity.signing import GOVERNANCE_CONTEXT, EnvelopeSigner, sign_document

MAX_PAGE_ENTRIES = 1000
"""Entries (decisions and commands together) in one answer: bounds its size (a command is under 2
KiB)."""
NONCE_PATTERN = r"^[A-Za-z0-9_-]{16,128}$"
SECTIONS = ("namespaces", "policies", "documents", "commands")
_RETIRED = (NamespaceStatus.DRAINING, NamespaceStatus.RETIRED)
_NO_STORE = {"Cache-Control": "no-store"}


class Cursor(BaseModel):
    """Where the next page starts: after ``after`` (the last key returned) in section ``section``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    section: int
    after: list[str | int]

    def encode(self) -> str:
        return base64.urlsafe_b64encode(self.model_dump_json().encode()).decode().rstrip("=")

    @classmethod
    def decode(cls, text: str) -> Cursor:
        """ValueError for anything :meth:`encode` did not make."""
        try:
            cursor = cls.model_validate_json(
                base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
            )
        except (ValidationError, binascii.Error, ValueError):
            raise ValueError("cursor: not a cursor this endpoint returned") from None
        # Per section: the key of its entries (names, or a decision's seq); an empty ``after``
        # starts the section.
        shapes = ((str,), (str, str), (str, str), (int,))
        if not 0 <= cursor.section < len(SECTIONS):
            raise ValueError("cursor: not a cursor this endpoint returned")
        shape = shapes[cursor.section]
        if cursor.after and (
            len(cursor.after) != len(shape)
            or not all(type(value) is kind for value, kind in zip(cursor.after, shape, strict=True))
        ):
            raise ValueError("cursor: not a cursor this endpoint returned")
        return cursor


def _decision(predicate: Predicate, decided_at: datetime) -> dict:
    return {"predicate": predicate.model_dump(mode="json"), "decided_at": decided_at.isoformat()}


async def namespace_decisions(
    session: AsyncSession, after: list, limit: int
) -> list[tuple[list, dict]]:
    query = (
        select(Namespace.namespace, func.coalesce(Invalidation.cutoff, Namespace.updated_at))
        .outerjoin(Invalidation, Invalidation.command_id == Namespace.invalidation_id)
        .where(Namespace.status.in_(_RETIRED))
        .order_by(Namespace.namespace)
        .limit(limit)
    )
    if after:
        query = query.where(Namespace.namespace > after[0])
    return [
        ([name], _decision(NamespacePredicate(ns=name), at))
        for name, at in await session.execute(query)
    ]


async def policy_decisions(
    session: AsyncSession, after: list, limit: int
) -> list[tuple[list, dict]]:
    query = (
        select(
            Policy.tenant_id,
            Policy.auth_scope,
            Policy.policy_version,
            func.coalesce(Invalidation.cutoff, Policy.updated_at),
        )
        .outerjoin(Invalidation, Invalidation.command_id == Policy.invalidation_id)
        .order_by(Policy.tenant_id, Policy.auth_scope)
        .limit(limit)
    )
    if after:
        query = query.where(tuple_(Policy.tenant_id, Policy.auth_scope) > tuple_(*after))
    return [
        (
            [tenant, scope],
            _decision(PolicyPredicate(tenant=tenant, auth_scope=scope, below_version=version), at),
        )
        for tenant, scope, version, at in await session.execute(query)
    ]


async def document_decisions(
    session: AsyncSession, after: list, limit: int
) -> list[tuple[list, dict]]:
    query = (
        select(
            Document.tenant_id,
            Document.doc_id,
            Document.version,
            Document.deleted,
            func.coalesce(Invalidation.cutoff, Document.updated_at),
        )
        .outerjoin(Invalidation, Invalidation.command_id == Document.invalidation_id)
        .order_by(Document.tenant_id, Document.doc_id)
        .limit(limit)
    )
    if after:
        query = query.where(tuple_(Document.tenant_id, Document.doc_id) > tuple_(*after))
    return [
        (
            [tenant, doc_id],
            _decision(
                DocumentPredicate(
                    tenant=tenant, doc_id=doc_id, below_version=ANY_VERSION if deleted else version
                ),
                at,
            ),
        )
        for tenant, doc_id, version, deleted, at in await session.execute(query)
    ]


async def _commands(
    session: AsyncSession, node_id: str, after: list, limit: int, command_signer: EnvelopeSigner
) -> list[tuple[list, dict]]:
    query = (
        select(
            Invalidation.seq, Invalidation.command_id, Invalidation.predicate, Invalidation.cutoff
        )
        .join(InvalidationTarget, InvalidationTarget.command_id == Invalidation.command_id)
        .where(
            InvalidationTarget.node_id == node_id, InvalidationTarget.status == TargetStatus.PENDING
        )
        .order_by(Invalidation.seq)
        .limit(limit)
    )
    if after:
        query = query.where(Invalidation.seq > after[0])
    entries = []
    for seq, command_id, stored, cutoff in await session.execute(query):
        predicate = parse_predicate(stored)
        command = make_event(
            Invalidate(command_id=command_id, predicate=predicate, cutoff=cutoff),
            tenant_id=getattr(predicate, "tenant", None),
        )
        entries.append(([seq], command_signer(command).model_dump(mode="json")))
    return entries


DECISION_READERS = {
    "namespaces": namespace_decisions,
    "policies": policy_decisions,
    "documents": document_decisions,
}
"""Each registry section's reader: ``(session, after key, limit) -> [(key, decision)]`` in key order
(also ``/v1/router/versions``)."""

router = APIRouter()


@router.get("/v1/governance")
async def governance(
    nonce: Annotated[str, Query(pattern=NONCE_PATTERN)],
    node: GovernanceCaller,
    session: Session,
    command_signer: CommandSigner,
    cursor: Annotated[str | None, Query(max_length=2048)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE_ENTRIES)] = MAX_PAGE_ENTRIES,
) -> JSONResponse:
    """One signed page of the governance state the calling node must enforce (see the module
    docstring)."""
    try:
        position = Cursor(section=0, after=[]) if cursor is None else Cursor.decode(cursor)
    except ValueError as error:
        return error_response(
            400, "invalid_request_error", "invalid_parameter", str(error), _NO_STORE
        )
    as_of = await session.scalar(select(func.coalesce(func.max(Invalidation.seq), 0)))
    decisions: list[dict] = []
    commands: list[dict] = []
    next_cursor: str | None = None
    section, after = position.section, list(position.after)
    while section < len(SECTIONS):
        room = limit - len(decisions) - len(commands)
        if SECTIONS[section] == "commands":
            entries = await _commands(session, node.node_id, after, room + 1, command_signer)
        else:
            reader = DECISION_READERS[SECTIONS[section]]
            entries = await reader(session, after, room + 1)
        page, more = entries[:room], len(entries) > room
        (commands if SECTIONS[section] == "commands" else decisions).extend(
            entry for _, entry in page
        )
        if more:
            # An empty page of a section (no room left) starts it again from the same key.
            next_cursor = Cursor(section=section, after=page[-1][0] if page else after).encode()
            break
        section, after = section + 1, []
    body = {
        "node_id": node.node_id,
        "nonce": nonce,
        "as_of_decision": as_of,
        "decisions": decisions,
        "pending_commands": commands,
        "next_cursor": next_cursor,
    }
    # The canonical form is computed over the JSON values the node will parse (no datetime objects).
    body = json.loads(json.dumps(body))
    body["signature"] = sign_document(body, command_signer.private_key, GOVERNANCE_CONTEXT)
    return JSONResponse(content=body, headers=_NO_STORE)
