"""Block creators: the subjects whose requests created a copy of a block, in every scope.

An erasure covers what its subject put in the cache whatever the scope the text was sent
with (docs/security.md, "Erasure"): a public or tenant block holds its creator's text as
much as a user block does. Blocks are content-addressed and shared, so one block may have
several creators (one per node, or after an eviction): one row per (block, creator).
Subjects are the keyed digest the nodes send (``creator_subject_id``), never the raw id.

Revision ID: 0011_block_creators
Revises: 0010_producer_keys
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011_block_creators"
down_revision: str | Sequence[str] | None = "0010_producer_keys"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "block_creators",
        sa.Column("block_hash", sa.LargeBinary(), nullable=False),
        sa.Column("subject_hash", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["block_hash"],
            ["blocks.block_hash"],
            ondelete="CASCADE",
            name=op.f("fk_block_creators_block_hash_blocks"),
        ),
        sa.PrimaryKeyConstraint("block_hash", "subject_hash", name=op.f("pk_block_creators")),
    )
    op.create_index(op.f("ix_block_creators_subject_hash"), "block_creators", ["subject_hash"])


def downgrade() -> None:
    op.drop_index(op.f("ix_block_creators_subject_hash"), table_name="block_creators")
    op.drop_table("block_creators")
