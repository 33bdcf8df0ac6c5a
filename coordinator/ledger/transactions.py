"""Ledger transactions and their locks: how every ledger-writing transaction starts, and the lock
order.

Every transaction that writes the ledger (a kv-events batch, a batch of user events or
acks, an erasure, an API decision) begins with :func:`begin_ledger_transaction`, which
gives it the database's time — one clock for every coordinator replica.

Locking: a decision must not interleave with a kv-events batch, or a block stored
concurrently could escape both the decision's marking and the batch's late-block
check (:func:`coordinator.handlers.decisions.reissue_for_late_blocks`). Decisions take a
transaction-level advisory lock exclusively (:func:`lock_decisions`); ledger writers
(kv-events batches, ack batches) take it shared (:func:`lock_ledger_writes`), so they
run concurrently with each other and each waits at most for one short decision
transaction. A kv-events batch that only removes copies (or only beats) adds nothing a
decision could miss and takes no advisory lock at all.

Lock order: node rows, advisory lock, placements.
Writers take the advisory lock only once their node rows (and an ack batch's target
rows) are locked, right before they touch placements: a writer queued behind another
one's node lock holds nothing a decision waits for, so decisions wait only for the
writers actually running. Decisions lock no node rows (their foreign-key checks take
``KEY SHARE``, which the writers' ``NO KEY UPDATE`` does not block). The one exception
to the order is a late-block re-issue inside a kv-events batch, which marks other
nodes' placements too; a deadlock that could cause is detected by PostgreSQL, rolls
the batch back and the consumer re-delivers it, so it costs time, never correctness.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

_DECISION_LOCK_KEY = 0x6B766C2D696E76  # "kvl-inv"; arbitrary, constant across releases

_BEGIN_LEDGER_TRANSACTION = text(
    "SELECT now(), set_config('plan_cache_mode', 'force_custom_plan', true)"
)
_PLAN_CACHE_MODE = text("SELECT set_config('plan_cache_mode', :mode, true)")
_LOCK_DECISIONS = text("SELECT pg_advisory_xact_lock(:key)")
_LOCK_LEDGER_WRITES = text("SELECT pg_advisory_xact_lock_shared(:key)")


async def begin_ledger_transaction(session: AsyncSession) -> datetime:
    """First statement of every ledger-writing transaction: returns its database time (``now()``, UTC).

    It also switches the rest of the transaction to custom plans: the batch statements
    take arrays, which a generic plan of a prepared statement (PostgreSQL switches to one
    after five runs) cannot see into. Generic plans scanned every live placement for an
    ack's copy deletion (~200 ms a batch, not ~5) and for a kv-events batch's removals.
    One round trip for both, before any lock is taken.
    """
    return (await session.scalar(_BEGIN_LEDGER_TRANSACTION)).astimezone(UTC)


@contextlib.asynccontextmanager
async def generic_plans(session: AsyncSession) -> AsyncIterator[None]:
    """Cached plans as PostgreSQL chooses them (its default) for the enclosed statements, custom plans again after.

    For bulk ``COPY``: every copied row runs the foreign-key triggers' cached plans, and the
    custom plans :func:`begin_ledger_transaction` forces are made anew for every row (a raw
    ``COPY`` of the ledger bench's rows ran 1.7–2.6x slower with them). A failure inside leaves
    the setting as it is; the transaction (or its savepoint) is rolled back anyway.
    """
    await session.execute(_PLAN_CACHE_MODE, {"mode": "auto"})
    yield
    await session.execute(_PLAN_CACHE_MODE, {"mode": "force_custom_plan"})


async def lock_decisions(session: AsyncSession) -> None:
    """Exclusive: no kv-events or ack batch is between its start and commit while this transaction
    decides."""
    await session.execute(_LOCK_DECISIONS, {"key": _DECISION_LOCK_KEY})


async def lock_ledger_writes(session: AsyncSession) -> None:
    """Shared: many ledger writers at once, but never concurrently with a decision.

    Taken after the writer's node rows are locked (lock order in the module docstring).
    """
    await session.execute(_LOCK_LEDGER_WRITES, {"key": _DECISION_LOCK_KEY})
