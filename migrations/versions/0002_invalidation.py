"""Invalidations: one row per ``Invalidate`` command, one per expected node, and the links
from documents, policies, namespaces and placements to the command that enforces them.

Expected nodes are the nodes registered when the command was decided; a command is
``complete`` once every one of them acked with verified evidence. The checked-in
schema must equal ``coordinator.ledger.models`` (the migration test compares them).

Revision ID: 0002_invalidation
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0002_invalidation"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TIMESTAMP = sa.DateTime(timezone=True)
LINKED_TABLES = ("namespaces", "placements", "documents", "policies")
"""Tables that get an ``invalidation_id`` pointing at the command that enforces (or enforced) their
state."""


def upgrade() -> None:
    op.create_table(
        "invalidations",
        sa.Column("command_id", sa.Uuid(), nullable=False),
        sa.Column("seq", sa.BigInteger(), sa.Identity(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("predicate", postgresql.JSONB(), nullable=False),
        sa.Column("cutoff", TIMESTAMP, nullable=False),
        sa.Column("trigger", sa.Text(), nullable=False),
        sa.Column("source_event_id", sa.Uuid(), nullable=True),
        sa.Column("parent_command_id", sa.Uuid(), nullable=True),
        sa.Column("requested_at", TIMESTAMP, nullable=False),
        sa.Column("created_at", TIMESTAMP, server_default=sa.func.now(), nullable=False),
        sa.Column("completed_at", TIMESTAMP, nullable=True),
        sa.Column("status", sa.Text(), server_default="pending", nullable=False),
        sa.CheckConstraint(
            "kind IN ('document', 'policy', 'subject', 'namespace', 'tenant')",
            name=op.f("ck_invalidations_kind"),
        ),
        sa.CheckConstraint(
            "status IN ('pending', 'complete', 'failed')", name=op.f("ck_invalidations_status")
        ),
        sa.CheckConstraint(
            "trigger IN ('event', 'api', 'late_block')", name=op.f("ck_invalidations_trigger")
        ),
        sa.ForeignKeyConstraint(
            ["parent_command_id"],
            ["invalidations.command_id"],
            name=op.f("fk_invalidations_parent_command_id_invalidations"),
        ),
        sa.PrimaryKeyConstraint("command_id", name=op.f("pk_invalidations")),
        sa.UniqueConstraint("seq", name=op.f("uq_invalidations_seq")),
    )
    op.create_index(op.f("ix_invalidations_status_seq"), "invalidations", ["status", "seq"])
    op.create_table(
        "invalidation_targets",
        sa.Column("command_id", sa.Uuid(), nullable=False),
        sa.Column("node_id", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), server_default="pending", nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=True),
        sa.Column("acked_at", TIMESTAMP, nullable=True),
        sa.Column("evidence", postgresql.JSONB(), nullable=True),
        sa.CheckConstraint(
            "status IN ('pending', 'acked', 'failed')", name=op.f("ck_invalidation_targets_status")
        ),
        sa.ForeignKeyConstraint(
            ["command_id"],
            ["invalidations.command_id"],
            ondelete="CASCADE",
            name=op.f("fk_invalidation_targets_command_id_invalidations"),
        ),
        sa.ForeignKeyConstraint(
            ["node_id"], ["nodes.node_id"], name=op.f("fk_invalidation_targets_node_id_nodes")
        ),
        sa.PrimaryKeyConstraint("command_id", "node_id", name=op.f("pk_invalidation_targets")),
    )
    op.create_index(
        op.f("ix_invalidation_targets_node_id_status"),
        "invalidation_targets",
        ["node_id", "status"],
    )
    for table in LINKED_TABLES:
        op.add_column(table, sa.Column("invalidation_id", sa.Uuid(), nullable=True))
        op.create_foreign_key(
            op.f(f"fk_{table}_invalidation_id_invalidations"),
            table,
            "invalidations",
            ["invalidation_id"],
            ["command_id"],
        )
    op.create_index(
        op.f("ix_placements_invalidation_id"),
        "placements",
        ["invalidation_id"],
        postgresql_where=sa.text("invalidation_id IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_placements_invalidation_id"), table_name="placements")
    for table in LINKED_TABLES:
        op.drop_constraint(
            op.f(f"fk_{table}_invalidation_id_invalidations"), table, type_="foreignkey"
        )
        op.drop_column(table, "invalidation_id")
    op.drop_table("invalidation_targets")
    op.drop_table("invalidations")
