"""Data keys for tenant/user data at rest, held by the coordinator (``coordinator.keys.data_keys``).

One row per key: the key itself only wrapped (AES-256-GCM under the
deployment master key, AAD = key id), never in clear. ``destroyed_at`` is set
and ``wrapped_key`` zero-filled in one transaction when a subject or tenant is
erased; the row stays so receipts can name the destroyed key ids. A partial
unique index (``NULLS NOT DISTINCT``, PostgreSQL 15+, so tenant-scope rows with
a NULL subject collide too) allows one live key per scope, which is what
``INSERT … ON CONFLICT DO NOTHING`` in ``KeyService.resolve`` arbitrates on.

Revision ID: 0003_data_keys
Revises: 0002_invalidation
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_data_keys"
down_revision: str | Sequence[str] | None = "0002_invalidation"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "data_keys",
        sa.Column("key_id", sa.Text(), nullable=False),
        sa.Column("scope", sa.Text(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("subject_hash", sa.LargeBinary(), nullable=True),
        sa.Column("wrapped_key", sa.LargeBinary(), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("destroyed_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("scope IN ('tenant', 'user')", name=op.f("ck_data_keys_scope")),
        sa.CheckConstraint(
            "(scope = 'user') = (subject_hash IS NOT NULL)", name=op.f("ck_data_keys_scope_subject")
        ),
        sa.CheckConstraint("key_id ~ '^[0-9a-f]{32}$'", name=op.f("ck_data_keys_key_id_hex")),
        sa.PrimaryKeyConstraint("key_id", name=op.f("pk_data_keys")),
    )
    op.create_index(
        "uq_data_keys_live_scope",
        "data_keys",
        ["scope", "tenant_id", "subject_hash"],
        unique=True,
        postgresql_where=sa.text("destroyed_at IS NULL"),
        postgresql_nulls_not_distinct=True,
    )
    op.create_index(
        op.f("ix_data_keys_tenant_id_subject_hash"), "data_keys", ["tenant_id", "subject_hash"]
    )


def downgrade() -> None:
    op.drop_table("data_keys")
