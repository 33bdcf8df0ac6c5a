"""``producer_keys``: customer-event producers' Ed25519 keys and the tenants each may publish for.

Kafka records carry no authenticated principal, so the decisions consumer trusts a document,
permission or erasure event only when it is signed by a key enrolled here for the event's tenant
(``docs/security.md``, "Signed customer events"). ``all_tenants``: the key is bound to every tenant
(platform producers, the dev stack's key); else ``tenants`` lists them. ``revoked_at`` set: refused.

Revision ID: 0010_producer_keys
Revises: 0009_usage
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0010_producer_keys"
down_revision: str | Sequence[str] | None = "0009_usage"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "producer_keys",
        sa.Column("key_id", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("public_key", sa.LargeBinary(), nullable=False),
        sa.Column("all_tenants", sa.Boolean(), nullable=False),
        sa.Column("tenants", postgresql.JSONB(), nullable=False),
        sa.Column("enrolled_at", TIMESTAMP, server_default=sa.func.now(), nullable=False),
        sa.Column("enrolled_by", sa.Text(), nullable=False),
        sa.Column("revoked_at", TIMESTAMP, nullable=True),
        sa.CheckConstraint(
            "all_tenants OR jsonb_array_length(tenants) > 0", name=op.f("ck_producer_keys_bound")
        ),
        sa.PrimaryKeyConstraint("key_id", name=op.f("pk_producer_keys")),
    )


def downgrade() -> None:
    op.drop_table("producer_keys")
