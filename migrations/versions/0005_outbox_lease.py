"""Outbox rows their own process publishes right after the commit.

``outbox.lease_until``: a transaction that will publish its outbox rows itself as soon
as it commits (the invalidation decisions, whose commands are on the latency path of
every invalidation) sets it a few seconds ahead; the relay leaves a leased row alone
until then, so the row is not published twice in the normal case. A process that
dies between its commit and the publish leaves the row unsent and the relay
publishes it once the lease ran out. NULL (every other writer): relayed at once.

Revision ID: 0005_outbox_lease
Revises: 0004_erasure
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_outbox_lease"
down_revision: str | Sequence[str] | None = "0004_erasure"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("outbox", sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("outbox", "lease_until")
