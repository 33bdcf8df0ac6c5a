"""The decisions consumer's batch handler: user events become decisions, acks complete them
(docs/design.md §5, §6).

Users publish ``DocumentUpdated``/``DocumentDeleted`` (``kvledger.documents``),
``PermissionRevoked`` (``kvledger.permissions``) and ``ErasureRequested`` (``kvledger.erasures``).
For each batch, one database transaction claims the events in the inbox and decides them in order
(:mod:`coordinator.handlers.decisions`; an erasure request through
:meth:`coordinator.handlers.erasure.ErasureService.start_from_event`), so redelivery is a no-op.
Nodes answer on ``kvledger.acks``; a second transaction applies the acks
(:mod:`coordinator.handlers.acks`), and the erasure service then verifies the erasures they
advanced. An ack that overtook its node's kv-events is deferred there;
:meth:`InvalidationHandler.run_releases` applies it once the kv-events consumer, which wakes it
after every batch, has caught the node up.

Dependencies point one way: this handler composes decisions, erasures and acks; none of
them imports it (an import-linter contract in ``pyproject.toml`` keeps it so).

Locking: a decision holds the ledger's decision lock exclusively, so no kv-events or ack batch
interleaves with it (:mod:`coordinator.ledger.transactions` states the lock order and why)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy.ext.asyncio import AsyncSession

from coordinator import metrics
from coordinator.handlers.acks import AppliedAcks, Finished, apply_acks, release_deferred_acks
from coordinator.handlers.decisions import Decision, decide_many
from coordinator.handlers.erasure import ErasureService
from coordinator.ledger import inbox
from coordinator.ledger.db import Database
from coordinator.ledger.states import PlacementState
from coordinator.ledger.transactions import begin_ledger_transaction, lock_decisions
from events.fault_points import fault_point
from events.kafka.consumer import ConsumedEvent
from events.schema import (
    CommandAck,
    DocumentDeleted,
    DocumentUpdated,
    Envelope,
    ErasureRequested,
    PermissionRevoked,
)
from events.topics import ACKS
from identity.signing import EnvelopeSigner

log = logging.getLogger(__name__)

IGNORED = "ignored"

_DECISION_EVENTS = (DocumentUpdated, DocumentDeleted, PermissionRevoked, ErasureRequested)


@dataclass(slots=True)
class _BatchResult:
    outcomes: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    decisions: list[Decision] = field(default_factory=list)
    leased: list[tuple[int, Envelope]] = field(default_factory=list)
    """Outbox rows (id, command) this process publishes itself once the batch committed."""
    finished: Finished = field(default_factory=Finished)
    num_copies_deleted: int = 0


def _record_metrics(result: _BatchResult) -> None:
    """Only after the commit: a rolled-back batch is redelivered and counted then."""
    for (event_type, outcome), count in result.outcomes.items():
        metrics.INVALIDATION_EVENTS_TOTAL.labels(type=event_type, outcome=outcome).inc(count)
    for decision in result.decisions:
        metrics.INVALIDATIONS_TOTAL.labels(kind=decision.kind, trigger=decision.trigger).inc()
    for seconds in result.finished.completed_s:
        metrics.INVALIDATION_SECONDS.observe(seconds)
    metrics.PLACEMENT_CHANGES_TOTAL.labels(state=PlacementState.DELETED, cause="invalidation").inc(
        result.num_copies_deleted
    )


class InvalidationHandler:
    """Batch handler of the coordinator's decisions consumer (documents, permissions, erasures) and of its ack
    consumer; commits before returning.

    Erasure requests are decided like the other user events (decision lock, same
    transaction as their inbox rows) by ``erasures``, which is also told about every
    committed ack batch so it can verify the erasures those acks advance.
    """

    def __init__(
        self,
        database: Database,
        *,
        erasures: ErasureService,
        command_signer: EnvelopeSigner,
        on_outbox: Callable[[], None] | None = None,
        publish_leased: Callable[[list[tuple[int, Envelope]]], None] | None = None,
        outbox_lease_s: float = 10.0,
    ) -> None:
        """``publish_leased`` (the relay's): the document and permission commands are leased in the
        deciding transaction and handed to it after the commit, instead of waiting for the relay."""
        if outbox_lease_s <= 0:
            raise ValueError("outbox_lease_s must be positive")
        self._database = database
        self._erasures = erasures
        self._sign = command_signer
        self._on_outbox = on_outbox
        self._publish_leased = publish_leased
        self._outbox_lease = timedelta(seconds=outbox_lease_s)
        self._release_wanted = asyncio.Event()

    async def __call__(self, events: list[ConsumedEvent]) -> None:
        """Decide the batch's user events in one transaction, then apply its acks in another.

        Two transactions so the commands are published (the outbox relay is woken) as soon as
        the decisions commit, not after the acks that arrived with them; and so an ack batch
        holds the ledger-writes lock only for its own statements. Redelivery after a failure
        between the two is safe: the inbox turns the committed half into duplicates.

        Only acks read from ``kvledger.acks`` are acks: that consumer passes on only those
        signed by their node's enrolled key (``coordinator.keys.node_keys.VerifiedRecords``). A
        ``CommandAck`` put on a customer topic is ignored like any other misplaced type.
        """
        if not events:
            return
        started = time.perf_counter()
        acks, others = [], []
        for event in events:
            is_ack = event.topic == ACKS and isinstance(event.envelope.payload, CommandAck)
            (acks if is_ack else others).append(event)
        if others:
            await self._decide_batch(others)
        if acks:
            await self._ack_batch(acks)
        metrics.INVALIDATION_BATCH_SECONDS.observe(time.perf_counter() - started)

    async def _decide_batch(self, events: list[ConsumedEvent]) -> None:
        result = _BatchResult()
        async with self._database.session() as session, session.begin():
            now = await begin_ledger_transaction(session)
            fresh = await inbox.claim(session, events, result.outcomes)
            deciding = [e for e in fresh if isinstance(e.payload, _DECISION_EVENTS)]
            for envelope in fresh:
                if not isinstance(envelope.payload, _DECISION_EVENTS):
                    log.warning("ignoring %s event on an invalidation topic", envelope.type)
                    result.outcomes[(envelope.type, IGNORED)] += 1
            if deciding:
                await lock_decisions(session)
            # Consecutive document/permission events are decided together (a few statements for
            # the whole run); an erasure in between is decided on its own, so the order holds.
            run: list[Envelope] = []
            for envelope in deciding:
                if isinstance(envelope.payload, ErasureRequested):
                    await self._decide_run(session, run, now, result)
                    run = []
                    outcome, decision = await self._erasures.start_from_event(
                        session, envelope, now
                    )
                    result.decisions.extend([decision] if decision is not None else [])
                    result.outcomes[(envelope.type, outcome)] += 1
                else:
                    run.append(envelope)
            await self._decide_run(session, run, now, result)
        fault_point("coordinator.after_decision_commit")
        _record_metrics(result)
        if result.leased:
            self._publish_leased(result.leased)
        if len(result.decisions) > len(result.leased) and self._on_outbox is not None:
            self._on_outbox()

    async def _ack_batch(self, events: list[ConsumedEvent]) -> None:
        async def claimed_and_applied(
            session: AsyncSession, now: datetime, result: _BatchResult
        ) -> AppliedAcks:
            acks = await inbox.claim(session, events, result.outcomes)
            return await apply_acks(session, acks, now, result.outcomes) if acks else AppliedAcks()

        await self._applying_acks(claimed_and_applied)

    async def release_deferred_acks(self) -> None:
        """Apply, in one transaction, the deferred acks whose nodes' kv-events the ledger now holds."""
        await self._applying_acks(
            lambda session, now, result: release_deferred_acks(session, now, result.outcomes)
        )

    async def _applying_acks(
        self, apply: Callable[[AsyncSession, datetime, _BatchResult], Awaitable[AppliedAcks]]
    ) -> None:
        result = _BatchResult()
        async with self._database.session() as session, session.begin():
            now = await begin_ledger_transaction(session)
            applied = await apply(session, now, result)
            result.num_copies_deleted, result.finished = (
                applied.num_copies_deleted,
                applied.finished,
            )
        _record_metrics(result)
        await self._erasures.acks_applied(result.finished.subject_command_ids)

    def wake_releases(self) -> None:
        """A kv-events batch committed: a node's ledger row may have reached a deferred ack's fence."""
        self._release_wanted.set()

    async def run_releases(self, stop: asyncio.Event, poll_s: float) -> None:
        """Release deferred acks when woken (:meth:`wake_releases`) and every ``poll_s`` until
        ``stop``.

        The poll covers a wake lost to a crash between a kv-events commit and the release; the
        kv-events consumer of any replica wakes its own process, and any process may release
        any node's acks (each is taken once, under the node's row lock).
        """
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._release_wanted.wait(), poll_s)
            self._release_wanted.clear()
            try:
                await self.release_deferred_acks()
            except Exception as exc:  # noqa: BLE001 - the acks stay deferred and the next wake or poll retries
                log.warning("releasing deferred acks failed (%s)", type(exc).__name__)

    async def _decide_run(
        self, session: AsyncSession, run: list[Envelope], now: datetime, result: _BatchResult
    ) -> None:
        """Decide consecutive document/permission events at once; lease their commands when this
        process publishes them."""
        lease_until = None if self._publish_leased is None else now + self._outbox_lease
        bulk = await decide_many(
            session, run, now, signer=self._sign, lease_until=lease_until, outcomes=result.outcomes
        )
        result.decisions.extend(bulk.decisions)
        if self._publish_leased is not None:
            result.leased.extend(bulk.queued)
