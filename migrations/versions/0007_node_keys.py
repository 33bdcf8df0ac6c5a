"""``node_keys``: the enrollment registry of node Ed25519 keys.

A node proves who it is with its own key (``docs/security.md``, "Node identity and
signed records"): its key-service credentials and its kv-events and acks are checked
against the key enrolled here for its node id. ``revoked_at`` set: the key is refused.
``invalidation_targets.ack_key_id`` records which key signed each recorded ack, so an
erasure receipt can name the node keys whose evidence it relies on.

Revision ID: 0007_node_keys
Revises: 0006_placement_marks_unchecked
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_node_keys"
down_revision: str | Sequence[str] | None = "0006_placement_marks_unchecked"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "node_keys",
        sa.Column("key_id", sa.Text(), nullable=False),
        sa.Column("node_id", sa.Text(), nullable=False),
        sa.Column("public_key", sa.LargeBinary(), nullable=False),
        sa.Column("enrolled_at", TIMESTAMP, server_default=sa.func.now(), nullable=False),
        sa.Column("revoked_at", TIMESTAMP, nullable=True),
        sa.PrimaryKeyConstraint("key_id", name=op.f("pk_node_keys")),
    )
    op.create_index(op.f("ix_node_keys_node_id"), "node_keys", ["node_id"])
    op.add_column("invalidation_targets", sa.Column("ack_key_id", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("invalidation_targets", "ack_key_id")
    op.drop_index(op.f("ix_node_keys_node_id"), table_name="node_keys")
    op.drop_table("node_keys")
