"""Fenced acks: an ack names the node's last kv-event seq and waits here until the ledger has applied it.

Revision ID: 0013_deferred_acks
Revises: 0012_ack_parts
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0013_deferred_acks"
down_revision: str | Sequence[str] | None = "0012_ack_parts"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("ack_parts", sa.Column("after_seq", sa.BigInteger(), nullable=True))
    op.create_table(
        "deferred_acks",
        sa.Column("command_id", sa.Uuid(), nullable=False),
        sa.Column("node_id", sa.Text(), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("after_seq", sa.BigInteger(), nullable=False),
        sa.Column("evidence", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("key_id", sa.Text(), nullable=True),
        sa.Column(
            "deferred_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["command_id", "node_id"],
            ["invalidation_targets.command_id", "invalidation_targets.node_id"],
            name=op.f("fk_deferred_acks_command_id_invalidation_targets"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("command_id", "node_id", name=op.f("pk_deferred_acks")),
    )


def downgrade() -> None:
    op.drop_table("deferred_acks")
    op.drop_column("ack_parts", "after_seq")
