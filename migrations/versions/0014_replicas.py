"""Replicas: where a node's pulled copy of a block came from (``replica_of`` of ``BlockStored``).

A node may pull a prefix's blocks from the peer holding them instead of computing them
(docs/architecture.md, "Replicas"). Its copies are ordinary placements; this table keeps
their provenance, one row per (block, node): the source node and when it was pulled.

Revision ID: 0014_replicas
Revises: 0013_deferred_acks
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014_replicas"
down_revision: str | Sequence[str] | None = "0013_deferred_acks"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "replicas",
        sa.Column("block_hash", sa.LargeBinary(), nullable=False),
        sa.Column("node_id", sa.Text(), nullable=False),
        sa.Column("source_node_id", sa.Text(), nullable=False),
        sa.Column("pulled_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["block_hash"],
            ["blocks.block_hash"],
            ondelete="CASCADE",
            name=op.f("fk_replicas_block_hash_blocks"),
        ),
        sa.ForeignKeyConstraint(
            ["node_id"], ["nodes.node_id"], name=op.f("fk_replicas_node_id_nodes")
        ),
        sa.PrimaryKeyConstraint("block_hash", "node_id", name=op.f("pk_replicas")),
    )


def downgrade() -> None:
    op.drop_table("replicas")
