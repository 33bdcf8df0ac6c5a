"""Privacy erasure in the coordinator: start, progress, verification and receipts (docs/design.md §6).

An erasure starts from ``POST /v1/erasures`` (``coordinator.api.routes.erasures``) or an
``ErasureRequested`` on ``kvledger.erasures`` (the invalidation consumer calls
:meth:`ErasureService.start_from_event`). :func:`start_erasure` does everything in the
caller's transaction, under the decision lock: the subject becomes its keyed digest
(the raw id is used for nothing else and stored nowhere), its data keys are destroyed
(cryptographic erase of every sealed copy), and a ``subject`` ``Invalidate`` with
cutoff = now is decided (:func:`coordinator.handlers.decisions.decide`), so the erasure row,
the destroyed keys and the command in the outbox exist together or not at all.

Verification (:meth:`ErasureService.verify`) runs after every ack batch and
periodically (:meth:`ErasureService.run`), so an erasure left behind by a crashed
coordinator is finished by whichever replica looks next. An erasure is ``verified``
only when the subject command and every late-block re-send of it are complete (every
node registered at the decision acked with verified evidence), the ledger holds no
live copy of the subject's blocks that the erasure waits for in any tier or snapshot on
any node — every copy on a node that has not acked, and on one that has, every copy
recorded no later than its ack (:func:`progress`; no node's clock is compared with the
database's) — and the subject's keys are destroyed. A node that is down keeps
it ``partial``: never verified early.

The receipt is built, signed and appended to the audit log, and a new tree head is
signed, in the one transaction that marks the erasure ``verified``. That transaction
holds the decision lock exclusively (no kv-events or ack batch is half-applied while
the ledger is checked) and the audit log lock (:func:`coordinator.audit.audit_log.append_receipt`:
appends never interleave, so the log never forks); the erasure row is re-read under those locks, so two coordinators, or
one restarted mid-way, issue exactly one receipt per erasure.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import LargeBinary, and_, any_, bindparam, exists, func, or_, select
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncSession

from coordinator import metrics
from coordinator.audit import receipts
from coordinator.audit.audit_log import (
    AuditLogCorrupted,
    ReceiptKeys,
    ReceiptKeyUnavailable,
    append_receipt,
)
from coordinator.handlers.decisions import Decision, created_blocks, decide, user_blocks
from coordinator.keys.data_keys import DataKey, destroy_keys, subject_keys
from coordinator.ledger.db import Database
from coordinator.ledger.models import Block, Erasure, Invalidation, InvalidationTarget, Placement
from coordinator.ledger.states import (
    ErasureStatus,
    InvalidationStatus,
    PlacementState,
    TargetStatus,
)
from coordinator.ledger.transactions import begin_ledger_transaction, lock_decisions
from events.fault_points import fault_point
from events.schema import Envelope, ErasureRequested, SubjectPredicate, subject_digest
from identity.signing import EnvelopeSigner

log = logging.getLogger(__name__)

_MAX_ID_CHARS = 512
_MAX_REASON_CHARS = 2000

_METHOD_STRENGTH = {"clear-unlink": 0, "clear": 1, "purge-crypto-erase": 2}
"""When one node × tier was erased by several commands with different methods the receipt names the
weakest."""

POSTGRES_KEY_CAVEAT = (
    "Destroyed data keys were zero-filled in the coordinator database; PostgreSQL keeps superseded row versions "
    "(still wrapped under the master key) until VACUUM reclaims them, and WAL archives keep them while retained."
)

STARTED = "applied"
DUPLICATE = "duplicate"
CONFLICT = "conflict"
UNCONFIGURED = "unconfigured"


class IdempotencyConflict(ValueError):
    """The idempotency key (or erasure id) already names an erasure of another subject or tenant."""


def _text(name: str, value: Any, limit: int) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > limit:
        raise ValueError(f"{name} must be a non-empty string of at most {limit} characters")
    return value


@dataclass(frozen=True, slots=True)
class Started:
    """What :func:`start_erasure` did: ``decision`` is None when the key named an existing erasure."""

    erasure: Erasure
    decision: Decision | None


async def start_erasure(
    session: AsyncSession,
    *,
    subject_key: bytes,
    command_signer: EnvelopeSigner,
    tenant_id: str,
    subject_id: str,
    reason: str,
    idempotency_key: str,
    now: datetime,
    trigger: str,
    requested_at: datetime | None = None,
    erasure_id: uuid.UUID | None = None,
    source_event_id: uuid.UUID | None = None,
) -> Started:
    """Start (or find) the erasure of ``subject_id`` in ``tenant_id``, in the caller's transaction.

    The caller holds :func:`coordinator.ledger.transactions.lock_decisions` and commits; ``now``
    is the transaction's database time and becomes the cutoff. The same
    ``idempotency_key`` in the same tenant returns the existing erasure and starts
    nothing; for another subject it raises :class:`IdempotencyConflict`. ``erasure_id``
    (an event's own id for the erasure) becomes the row id so the publisher can look
    it up. ValueError for bad input — never echoing the subject.
    """
    _text("tenant_id", tenant_id, _MAX_ID_CHARS)
    _text("subject_id", subject_id, _MAX_ID_CHARS)
    _text("reason", reason, _MAX_REASON_CHARS)
    _text("idempotency_key", idempotency_key, _MAX_ID_CHARS)
    digest = subject_digest(subject_key, tenant_id, subject_id)
    existing = await session.scalar(
        select(Erasure).where(
            Erasure.tenant_id == tenant_id, Erasure.idempotency_key == idempotency_key
        )
    )
    if existing is not None:
        if existing.subject_hash != bytes.fromhex(digest):
            raise IdempotencyConflict(
                "this idempotency key already names an erasure of another subject"
            )
        return Started(existing, None)
    if erasure_id is not None and await session.get(Erasure, erasure_id) is not None:
        raise IdempotencyConflict("this erasure id is already used by another tenant's erasure")
    key_ids = await destroy_keys(session, subject_keys(tenant_id, digest))
    decision = await decide(
        session,
        SubjectPredicate(tenant=tenant_id, subject_id=digest),
        signer=command_signer,
        now=now,
        trigger=trigger,
        requested_at=requested_at or now,
        source_event_id=source_event_id,
    )
    erasure = Erasure(
        id=erasure_id or uuid.uuid4(),
        tenant_id=tenant_id,
        subject_hash=bytes.fromhex(digest),
        reason=reason,
        idempotency_key=idempotency_key,
        status=ErasureStatus.PENDING,
        command_id=decision.command_id,
        cutoff=now,
        requested_at=requested_at or now,
        key_ids_destroyed=key_ids,
        updated_at=now,
    )
    session.add(erasure)
    await session.flush()
    log.info(
        "erasure %s started in tenant %s: command %s to %d node(s), %d data key(s) destroyed",
        erasure.id,
        tenant_id,
        decision.command_id,
        decision.num_targets,
        len(key_ids),
    )
    return Started(erasure, decision)


# ---------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------


@dataclass(slots=True)
class Progress:
    """Where an erasure stands, from its commands' targets, their evidence and the ledger.

    ``status`` is what the erasure's status should be now; ``verified`` means every
    condition for a receipt holds (the receipt transaction re-checks it under its locks).
    """

    status: str
    commands: list[Invalidation]
    targets: list[InvalidationTarget]
    live: dict[tuple[str, str], int]
    contradicted_key_ids: list[str] = field(default_factory=list)
    """Key ids a node reported destroying that the coordinator still holds live: not a cryptographic
    erase."""
    resend_needed: bool = False
    """Every command is complete, yet a live copy was recorded after the newest one was decided (a node that
    registered later, a snapshot or inventory listing the subject's blocks): the subject command must go out again."""

    @property
    def complete(self) -> bool:
        return all(command.status == InvalidationStatus.COMPLETE for command in self.commands)


def subject_predicate(erasure: Erasure) -> SubjectPredicate:
    return SubjectPredicate(tenant=erasure.tenant_id, subject_id=erasure.subject_hash.hex())


async def progress(session: AsyncSession, erasure: Erasure) -> Progress:
    """The erasure's commands (the subject command and its late-block re-sends), targets and live
    copies."""
    commands = list(
        (
            await session.scalars(
                select(Invalidation)
                .where(
                    or_(
                        Invalidation.command_id == erasure.command_id,
                        Invalidation.parent_command_id == erasure.command_id,
                    )
                )
                .order_by(Invalidation.seq)
            )
        ).all()
    )
    assert commands and commands[0].command_id == erasure.command_id, (
        f"erasure {erasure.id} without its command"
    )
    order = {command.command_id: position for position, command in enumerate(commands)}
    targets = sorted(
        (
            await session.scalars(
                select(InvalidationTarget).where(InvalidationTarget.command_id.in_(order))
            )
        ).all(),
        key=lambda target: (order[target.command_id], target.node_id),
    )
    # The copies the erasure waits for, by the ledger's own order (docs/design.md §6, "Erasure"):
    # every live copy of the subject's user blocks on a node that has not acked, and on a node that
    # has, those recorded no later than its ack. A copy recorded after the node's ack is one it
    # built after applying the command: the subject's new data. A shared (public or tenant) block
    # the subject created is waited for on every node until that node acks: the ledger knows who
    # created *a* copy of it, not which node's copy (each node's own may be another subject's, and
    # stays), so past its ack the node's evidence says which of its copies were the subject's.
    predicate = subject_predicate(erasure)
    acked = exists().where(
        InvalidationTarget.command_id.in_(order),
        InvalidationTarget.node_id == Placement.node_id,
        InvalidationTarget.status == TargetStatus.ACKED,
    )
    waited_for = and_(
        Placement.state == PlacementState.LIVE,
        or_(
            and_(
                Placement.block_hash.in_(user_blocks(predicate)),
                ~acked.where(InvalidationTarget.acked_at < Placement.updated_at),
            ),
            and_(Placement.block_hash.in_(created_blocks(predicate)), ~acked),
        ),
    )
    live = {
        (node_id, tier): count
        for node_id, tier, count in await session.execute(
            select(Placement.node_id, Placement.tier, func.count())
            .where(waited_for)
            .group_by(Placement.node_id, Placement.tier)
        )
    }
    newest_live = (
        await session.scalar(select(func.max(Placement.updated_at)).where(waited_for))
        if live
        else None
    )
    reported = sorted(
        {
            key_id
            for target in targets
            for item in target.evidence or []
            for key_id in item.get("key_ids", [])
        }
    )
    contradicted = (
        list(
            (
                await session.scalars(
                    select(DataKey.key_id)
                    .where(DataKey.key_id.in_(reported), DataKey.destroyed_at.is_(None))
                    .order_by(DataKey.key_id)
                )
            ).all()
        )
        if reported
        else []
    )
    result = Progress(ErasureStatus.PENDING, commands, targets, live, contradicted)
    result.resend_needed = (
        result.complete and newest_live is not None and newest_live > commands[-1].created_at
    )
    statuses = collections.Counter(target.status for target in targets)
    if statuses[TargetStatus.FAILED]:
        result.status = ErasureStatus.FAILED
    elif result.complete and not live and not contradicted:
        result.status = ErasureStatus.VERIFIED
    elif statuses[TargetStatus.ACKED]:
        result.status = ErasureStatus.PARTIAL
    return result


def receipt_tiers(
    targets: Iterable[InvalidationTarget],
) -> tuple[list[receipts.TierErasure], set[str], set[str]]:
    """Per node × tier entries, the removed block hashes and the key ids nodes reported, from acked
    evidence.

    A node × tier touched by several commands (the subject command and late-block
    re-sends) is one entry: counts add up, the evidence digest covers the list of
    evidence items in command order, and the method is the weakest one used.
    """
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = collections.defaultdict(list)
    hashes: set[str] = set()
    key_ids: set[str] = set()
    for target in targets:
        assert target.status == TargetStatus.ACKED, "a receipt is only built from verified acks"
        for item in target.evidence or []:
            grouped[(target.node_id, item["tier"])].append(item)
            hashes.update(item["block_hashes"])
            key_ids.update(item.get("key_ids", []))
    entries = []
    for (node_id, tier), items in grouped.items():
        methods = {receipts.receipt_method(item["method"]) for item in items}
        entries.append(
            receipts.TierErasure(
                node_id=node_id,
                tier=tier,
                count=sum(item["removed"] for item in items),
                method=min(methods, key=_METHOD_STRENGTH.__getitem__),
                evidence=items,
            )
        )
    return entries, hashes, key_ids


async def blocks_by_scope(session: AsyncSession, block_hashes: set[str]) -> dict[str, int]:
    """How many of the erased blocks (hex hashes) the ledger records in each cache scope
    (``receipts.SCOPE_COVERAGE_KEYS``).

    ``unrecorded``: blocks a node removed that the ledger holds no provenance for (their
    ``BlockStored`` not ingested yet, or never sent); their scope is not known here.
    """
    counts = dict.fromkeys(receipts.SCOPE_COVERAGE_KEYS, 0)
    hashes = [bytes.fromhex(block_hash) for block_hash in sorted(block_hashes)]
    # One array parameter, not a bind per hash: an erasure can remove thousands of blocks.
    erased = Block.block_hash == any_(bindparam("erased", hashes, type_=ARRAY(LargeBinary)))
    for scope, count in await session.execute(
        select(Block.scope, func.count()).where(erased).group_by(Block.scope)
    ):
        counts[scope] = count
    counts["unrecorded"] = len(hashes) - sum(counts.values())
    return counts


# ---------------------------------------------------------------------------
# The service the consumers run
# ---------------------------------------------------------------------------


class ErasureService:
    """Starts erasures from events and verifies erasures; shared by the consumers of one coordinator
    process."""

    def __init__(
        self,
        database: Database,
        *,
        subject_key: bytes | None,
        receipt_keys: ReceiptKeys,
        command_signer: EnvelopeSigner,
    ) -> None:
        self._database = database
        self._command_signer = command_signer
        self._subject_key = subject_key
        self._receipt_keys = receipt_keys
        self._reported_unavailable = False

    async def start_from_event(
        self, session: AsyncSession, envelope: Envelope, now: datetime
    ) -> tuple[str, Decision | None]:
        """Start the erasure an ``ErasureRequested`` asks for, in the consumer's transaction: outcome and decision.

        The idempotency key is the event's ``erasure_id`` or, without one, its event id
        (which also becomes the erasure id), so a redelivered or re-published request
        is the same erasure.
        """
        payload = envelope.payload
        assert isinstance(payload, ErasureRequested) and envelope.tenant_id is not None, (
            "not an erasure request"
        )
        if self._subject_key is None:
            log.error(
                "erasure request %s dropped: this coordinator has no KVLEDGER_SUBJECT_KEY to digest subjects with",
                envelope.event_id,
            )
            return UNCONFIGURED, None
        erasure_id = payload.erasure_id or envelope.event_id
        try:
            started = await start_erasure(
                session,
                subject_key=self._subject_key,
                command_signer=self._command_signer,
                tenant_id=envelope.tenant_id,
                subject_id=payload.subject_id,
                reason=payload.reason,
                idempotency_key=str(erasure_id),
                now=now,
                trigger="event",
                requested_at=envelope.occurred_at,
                erasure_id=erasure_id,
                source_event_id=envelope.event_id,
            )
        except IdempotencyConflict as conflict:
            log.error("erasure request %s refused: %s", envelope.event_id, conflict)
            return CONFLICT, None
        return (STARTED if started.decision is not None else DUPLICATE), started.decision

    async def acks_applied(self, command_ids: Iterable[uuid.UUID]) -> None:
        """Verify the erasures whose commands just got acks (after the ack batch committed).

        A failure here is logged and left to the periodic pass: the acks are committed,
        and failing the batch would only redeliver records the inbox already holds.
        """
        command_ids = list(command_ids)
        if not command_ids:
            return
        try:
            await self._verify_for(command_ids)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            log.warning(
                "erasure verification after acks failed (%s); the periodic pass retries",
                type(exc).__name__,
            )

    async def _verify_for(self, command_ids: list[uuid.UUID]) -> None:
        async with self._database.session() as session:
            parents = select(Invalidation.parent_command_id).where(
                Invalidation.command_id.in_(command_ids)
            )
            erasure_ids = (
                await session.scalars(
                    select(Erasure.id).where(
                        Erasure.status != ErasureStatus.VERIFIED,
                        or_(Erasure.command_id.in_(command_ids), Erasure.command_id.in_(parents)),
                    )
                )
            ).all()
        for erasure_id in erasure_ids:
            await self.verify(erasure_id)

    async def verify_unfinished(self) -> None:
        """Verify every erasure not yet verified (the periodic pass; also what finishes a crashed
        replica's work)."""
        async with self._database.session() as session:
            erasure_ids = (
                await session.scalars(
                    select(Erasure.id)
                    .where(Erasure.status != ErasureStatus.VERIFIED)
                    .order_by(Erasure.requested_at)
                )
            ).all()
        for erasure_id in erasure_ids:
            await self.verify(erasure_id)

    async def run(self, stop: asyncio.Event, interval_s: float) -> None:
        """:meth:`verify_unfinished` every ``interval_s`` until ``stop``; failures are retried, never fatal."""
        while not stop.is_set():
            try:
                await self.verify_unfinished()
            except Exception as exc:  # noqa: BLE001 - the verifier must outlive transient database outages
                log.warning("erasure verification pass failed (%s); retrying", type(exc).__name__)
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except TimeoutError:
                pass

    async def verify(self, erasure_id: uuid.UUID) -> str:
        """Bring one erasure's status up to date; issue its receipt when every condition holds. Returns the status.

        A cheap unlocked look first; only an erasure that looks verifiable takes the
        exclusive locks, re-reads everything and issues the receipt.
        """
        async with self._database.session() as session, session.begin():
            erasure = await session.get(Erasure, erasure_id, with_for_update=True)
            assert erasure is not None, f"no erasure {erasure_id}"
            if erasure.status == ErasureStatus.VERIFIED:
                return erasure.status
            state = await progress(session, erasure)
            fault_point("coordinator.mid_erasure_verification")
            if state.status != ErasureStatus.VERIFIED and not state.resend_needed:
                if state.status != erasure.status:
                    log.info("erasure %s is %s (was %s)", erasure.id, state.status, erasure.status)
                    erasure.status = state.status
                    erasure.updated_at = func.now()
                return state.status
        try:
            return await self._issue(erasure_id)
        except ReceiptKeyUnavailable as error:
            if not self._reported_unavailable:
                log.error("cannot issue erasure receipts: %s", error)
                self._reported_unavailable = True
            return erasure.status
        except AuditLogCorrupted as error:
            log.error("erasure %s not verified: %s", erasure_id, error)
            return erasure.status

    async def _issue(self, erasure_id: uuid.UUID) -> str:
        """The receipt transaction (see the module docstring for its locks)."""
        async with self._database.session() as session, session.begin():
            now = await begin_ledger_transaction(session)
            await lock_decisions(session)
            erasure = await session.get(
                Erasure, erasure_id, with_for_update=True, populate_existing=True
            )
            assert erasure is not None, f"no erasure {erasure_id}"
            if erasure.status == ErasureStatus.VERIFIED:
                return erasure.status
            state = await progress(session, erasure)
            if state.resend_needed:
                decision = await decide(
                    session,
                    subject_predicate(erasure),
                    signer=self._command_signer,
                    now=now,
                    trigger="late_block",
                    requested_at=now,
                    parent_command_id=erasure.command_id,
                )
                log.info(
                    "erasure %s: copies recorded after its last command; re-sent as %s",
                    erasure.id,
                    decision.command_id,
                )
                erasure.status = (
                    ErasureStatus.PARTIAL
                    if any(t.status == TargetStatus.ACKED for t in state.targets)
                    else ErasureStatus.PENDING
                )
                erasure.updated_at = now
                return erasure.status
            if state.status != ErasureStatus.VERIFIED:
                erasure.status = state.status
                erasure.updated_at = now
                return state.status
            # Keys created before the cutoff by a resolve that committed after the start are
            # destroyed too.
            key_ids = await destroy_keys(
                session,
                and_(
                    subject_keys(erasure.tenant_id, erasure.subject_hash.hex()),
                    DataKey.created_at < erasure.cutoff,
                ),
            )
            tiers, block_hashes, reported_key_ids = receipt_tiers(state.targets)
            coverage = await blocks_by_scope(session, block_hashes)
            signer = await self._receipt_keys.signer(session)
            body = receipts.build_receipt(
                receipt_id=str(uuid.uuid4()),
                erasure_id=str(erasure.id),
                tenant_id=erasure.tenant_id,
                subject_hash=erasure.subject_hash.hex(),
                requested_at=erasure.requested_at,
                verified_at=max(now, erasure.requested_at),
                tiers=tiers,
                block_hashes=block_hashes,
                key_ids_destroyed={*erasure.key_ids_destroyed, *key_ids, *reported_key_ids},
                node_keys={
                    (t.node_id, t.ack_key_id) for t in state.targets if t.ack_key_id is not None
                },
                caveats=[POSTGRES_KEY_CAVEAT],
                blocks_by_scope=coverage,
            )
            signed = receipts.sign_receipt(body, signer)
            receipt, head = await append_receipt(session, signed, erasure.id, signer, now)
            fault_point("coordinator.during_receipt_issue")
            erasure.status = ErasureStatus.VERIFIED
            erasure.verified_at = now
            erasure.key_ids_destroyed = sorted({*erasure.key_ids_destroyed, *key_ids})
            erasure.updated_at = now
        metrics.RECEIPTS_TOTAL.inc()
        metrics.ERASURE_SECONDS.observe(
            max(0.0, (erasure.verified_at - erasure.requested_at).total_seconds())
        )
        log.info(
            "erasure %s verified: receipt %s is leaf %d of the audit log (tree size %d)",
            erasure_id,
            receipt.receipt_id,
            receipt.leaf_index,
            head.tree_size,
        )
        return ErasureStatus.VERIFIED
