"""Deleting inbox and outbox rows once they can no longer matter (docs/operations.md, "Pruning").

Both tables gain a row per event or command for ever; nothing else deletes them.

* An **inbox** row exists to turn a redelivered record into a no-op. A record is redelivered
  only from the broker, and the broker stops holding it after its topic's retention (plus
  the time until its segment rolls). The row is written when the record was applied, which
  is after the broker stamped it, so a row older than ``ledger.prune_inbox_after_s`` (longer
  than every consumed topic's retention plus a segment's life, checked by
  :class:`coordinator.settings.LedgerSettings`) names a record the broker no longer has.
* A **sent outbox** row has been published; the relay never looks at it again, and a command
  that must go out again is a new row (``coordinator.handlers.resend``). Sent rows older than
  ``ledger.prune_outbox_after_s`` go; an unsent row is never deleted, however old.

Deletes run in batches of ``ledger.prune_batch_size`` rows, each its own short transaction,
so pruning never holds locks or a statement for long next to the ingest.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from sqlalchemy import BigInteger, Float, bindparam, text

from coordinator.ledger.db import Database
from coordinator.metrics import PRUNED_ROWS_TOTAL

log = logging.getLogger(__name__)

_PRUNE_INBOX = text(
    "DELETE FROM inbox WHERE event_id IN ("
    " SELECT event_id FROM inbox WHERE processed_at < now() - make_interval(secs => :after_s) LIMIT :limit)"
).bindparams(bindparam("after_s", type_=Float()), bindparam("limit", type_=BigInteger()))
_PRUNE_OUTBOX = text(
    "DELETE FROM outbox WHERE id IN ("
    " SELECT id FROM outbox WHERE sent_at IS NOT NULL AND sent_at < now() - make_interval(secs => :after_s)"
    " ORDER BY id LIMIT :limit)"
).bindparams(bindparam("after_s", type_=Float()), bindparam("limit", type_=BigInteger()))


@dataclass(frozen=True, slots=True)
class Pruned:
    num_inbox_rows: int
    num_outbox_rows: int


class Pruner:
    """Deletes expired inbox and sent outbox rows, every ``interval_s``; see the module docstring."""

    def __init__(
        self,
        database: Database,
        *,
        inbox_after_s: float,
        outbox_after_s: float,
        batch_size: int,
        interval_s: float,
    ) -> None:
        if inbox_after_s <= 0 or outbox_after_s <= 0 or batch_size < 1 or interval_s <= 0:
            raise ValueError("horizons and interval must be positive, batch_size at least 1")
        self._database = database
        self._inbox_after_s = inbox_after_s
        self._outbox_after_s = outbox_after_s
        self._batch_size = batch_size
        self._interval_s = interval_s

    async def prune_once(self) -> Pruned:
        """Delete every row past its horizon, batch by batch; returns how many rows went per table."""
        num_inbox = await self._prune("inbox", _PRUNE_INBOX, self._inbox_after_s)
        num_outbox = await self._prune("outbox", _PRUNE_OUTBOX, self._outbox_after_s)
        return Pruned(num_inbox, num_outbox)

    async def _prune(self, table: str, statement, after_s: float) -> int:
        num_deleted = 0
        while True:
            async with self._database.session() as session, session.begin():
                result = await session.execute(
                    statement, {"after_s": after_s, "limit": self._batch_size}
                )
            num_batch = result.rowcount
            num_deleted += num_batch
            PRUNED_ROWS_TOTAL.labels(table=table).inc(num_batch)
            if num_batch < self._batch_size:
                return num_deleted

    async def run(self, stop: asyncio.Event) -> None:
        """Prune now and every ``interval_s`` until ``stop``; failures (database down) wait for the
        next round."""
        while not stop.is_set():
            try:
                pruned = await self.prune_once()
                if pruned.num_inbox_rows or pruned.num_outbox_rows:
                    log.info(
                        "pruned %d inbox and %d outbox rows",
                        pruned.num_inbox_rows,
                        pruned.num_outbox_rows,
                    )
            except Exception as exc:  # noqa: BLE001 - pruning must outlive transient outages
                log.warning(
                    "pruning failed (%s); next round in %.0fs", type(exc).__name__, self._interval_s
                )
            try:
                await asyncio.wait_for(stop.wait(), self._interval_s)
            except TimeoutError:
                pass
