"""Command re-send: per target, how often its command went out again and when it is due next.

``invalidation_targets.resend_count`` counts the re-sends of the target's command made
because this node had not acked, ``last_resent_at`` when the last one was queued and
``next_resend_at`` when the next one is due (NULL:
the first is due ``command_resend_after_s`` after the decision). The partial index keeps
the re-sender's look-up of due targets to the pending ones (``coordinator.handlers.resend``).

Revision ID: 0008_command_resend
Revises: 0007_node_keys
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008_command_resend"
down_revision: str | Sequence[str] | None = "0007_node_keys"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "invalidation_targets",
        sa.Column("resend_count", sa.Integer(), server_default=sa.text("0"), nullable=False),
    )
    op.add_column(
        "invalidation_targets",
        sa.Column("last_resent_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.add_column(
        "invalidation_targets",
        sa.Column("next_resend_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index(
        "ix_invalidation_targets_pending",
        "invalidation_targets",
        ["command_id"],
        postgresql_where=sa.text("status = 'pending'"),
    )


def downgrade() -> None:
    op.drop_index("ix_invalidation_targets_pending", table_name="invalidation_targets")
    op.drop_column("invalidation_targets", "next_resend_at")
    op.drop_column("invalidation_targets", "last_resent_at")
    op.drop_column("invalidation_targets", "resend_count")
