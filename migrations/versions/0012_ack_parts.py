"""Ack parts: a command ack split over several records is staged here until every part arrived.

Revision ID: 0012_ack_parts
Revises: 0011_block_creators
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0012_ack_parts"
down_revision: str | Sequence[str] | None = "0011_block_creators"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "ack_parts",
        sa.Column("command_id", sa.Uuid(), nullable=False),
        sa.Column("node_id", sa.Text(), nullable=False),
        sa.Column("ack_id", sa.Uuid(), nullable=False),
        sa.Column("part", sa.Integer(), nullable=False),
        sa.Column("num_parts", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("evidence", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("key_id", sa.Text(), nullable=True),
        sa.Column(
            "received_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["command_id", "node_id"],
            ["invalidation_targets.command_id", "invalidation_targets.node_id"],
            name=op.f("fk_ack_parts_command_id_invalidation_targets"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint(
            "command_id", "node_id", "ack_id", "part", name=op.f("pk_ack_parts")
        ),
    )


def downgrade() -> None:
    op.drop_table("ack_parts")
