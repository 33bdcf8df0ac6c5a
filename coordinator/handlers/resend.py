"""Command re-send: an ``Invalidate`` goes out again to nodes that have not acked it
(docs/operations.md).

A command is published once by the outbox; a node that misses it (its consumer was
positioned past it, a record was lost) or whose ack was lost would keep the command
``pending`` forever. So a target still ``pending`` ``command_resend_after_s`` after the
decision has its command re-sent, and again after twice that wait, and so on up to
``command_resend_max_s`` between two re-sends — per target, stored on the target row
(``resend_count``, ``last_resent_at``, ``next_resend_at``) so whichever coordinator
replica looks next does it: due targets are claimed with ``FOR UPDATE SKIP LOCKED``,
and an ack batch holding a target row makes the re-sender skip it rather than wait.

The re-sent record is a new envelope (its own ``event_id``) carrying the *same command*
(``command_id``, predicate, cutoff) rebuilt from the ``invalidations`` row, signed with
the command key and written to the outbox in the same transaction that advances the
targets' schedule — exactly the path of the original, so it needs no outbox row of the
original to still exist. Commands go to every node (one partition, read by all): a node
that already applied the command does not apply it again and re-sends its ack
(``gpu_node.governance.commands``), which the coordinator records once (a second ack of an acked
target is a duplicate). One record per command per pass, however many of its targets
are due.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from sqlalchemy import BigInteger, Double, Integer, Text, Uuid, bindparam, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert

from coordinator import metrics
from coordinator.handlers.decisions import parse_predicate
from coordinator.handlers.outbox import outbox_row
from coordinator.ledger.db import Database
from coordinator.ledger.models import Invalidation, OutboxEntry
from events.schema import Invalidate, make_event
from identity.signing import EnvelopeSigner

log = logging.getLogger(__name__)

MAX_TARGETS_PER_PASS = 1000
"""Due targets claimed by one transaction; a larger backlog is worked off over the next passes."""

_CLAIM_DUE = (
    text(
        "WITH due AS ("
        " SELECT t.command_id, t.node_id FROM invalidation_targets t"
        " JOIN invalidations i ON i.command_id = t.command_id"
        " WHERE t.status = 'pending'"
        " AND coalesce(t.next_resend_at, i.created_at + make_interval(secs => :after_s)) <= now()"
        " ORDER BY i.seq, t.node_id LIMIT :limit FOR UPDATE OF t SKIP LOCKED"
        ")"
        " UPDATE invalidation_targets t SET resend_count = t.resend_count + 1, last_resent_at = now(),"
        " next_resend_at = now() + make_interval(secs => least(:after_s * power(2, t.resend_count + 1), :max_s))"
        " FROM due WHERE t.command_id = due.command_id AND t.node_id = due.node_id"
        " RETURNING t.command_id, t.node_id, t.resend_count"
    )
    .bindparams(
        bindparam("after_s", type_=Double()),
        bindparam("max_s", type_=Double()),
        bindparam("limit", type_=BigInteger()),
    )
    .columns(command_id=Uuid(), node_id=Text(), resend_count=Integer())
)
"""Claims the due pending targets and moves each one's next re-send out (doubling, capped) in one
statement."""


class CommandResender:
    """Re-sends the commands of pending targets whose re-send is due; run by the consumers process."""

    def __init__(
        self,
        database: Database,
        *,
        command_signer: EnvelopeSigner,
        resend_after_s: float,
        resend_max_s: float,
        poll_s: float,
        on_outbox: Callable[[], None] | None = None,
    ) -> None:
        if resend_after_s <= 0 or resend_max_s < resend_after_s or poll_s <= 0:
            raise ValueError(
                "resend_after_s and poll_s must be positive and resend_max_s at least resend_after_s"
            )
        self._database = database
        self._sign = command_signer
        self._after_s = resend_after_s
        self._max_s = resend_max_s
        self._poll_s = poll_s
        self._on_outbox = on_outbox

    async def resend_due(self) -> int:
        """One pass: queue a re-send of every command with a due target; returns the number of commands queued."""
        async with self._database.session() as session, session.begin():
            claimed = (
                await session.execute(
                    _CLAIM_DUE,
                    {"after_s": self._after_s, "max_s": self._max_s, "limit": MAX_TARGETS_PER_PASS},
                )
            ).all()
            if not claimed:
                return 0
            command_ids = sorted({row.command_id for row in claimed})
            invalidations = (
                await session.scalars(
                    select(Invalidation)
                    .where(Invalidation.command_id.in_(command_ids))
                    .order_by(Invalidation.seq)
                )
            ).all()
            assert len(invalidations) == len(command_ids), (
                "a claimed target without its invalidation"
            )
            commands = []
            for invalidation in invalidations:
                predicate = parse_predicate(invalidation.predicate)
                payload = Invalidate(
                    command_id=invalidation.command_id,
                    predicate=predicate,
                    cutoff=invalidation.cutoff,
                )
                commands.append(
                    self._sign(make_event(payload, tenant_id=getattr(predicate, "tenant", None)))
                )
            await session.execute(
                pg_insert(OutboxEntry).values([outbox_row(command) for command in commands])
            )
        for invalidation in invalidations:
            metrics.COMMAND_RESENDS_TOTAL.labels(kind=invalidation.kind).inc()
        log.info(
            "re-sending %d commands to %d targets that have not acked", len(commands), len(claimed)
        )
        if self._on_outbox is not None:
            self._on_outbox()
        return len(commands)

    async def run(self, stop: asyncio.Event) -> None:
        """Re-send until ``stop`` is set. Failures (database down) are retried at the next poll, never fatal."""
        while not stop.is_set():
            try:
                await self.resend_due()
            except Exception as exc:  # noqa: BLE001 - the re-sender must outlive transient outages
                log.warning("command re-send failed (%s); retrying", type(exc).__name__)
            try:
                await asyncio.wait_for(stop.wait(), self._poll_s)
            except TimeoutError:
                pass
