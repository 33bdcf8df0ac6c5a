"""Privacy erasures, their signed receipts, the Merkle audit log, its signed tree heads and the receipt keys.

* ``erasures``: one row per erasure, unique per (tenant, idempotency key) so a retried
  request is the same erasure; the subject only as its keyed digest.
* ``receipts``: at most one per erasure (unique ``erasure_id``) and one audit log leaf
  each (unique ``leaf_index``): the signed document exactly as signed.
* ``audit_log``: the append-only leaves (RFC 6962 leaf hashes); ``tree_heads``: one
  signed head per size. Appends are serialized by an advisory lock in
  ``coordinator.handlers.erasure``, so the log never forks.
* ``receipt_keys``: every Ed25519 key that signed a receipt or a tree head, so old
  receipts keep verifying after rotation or a restart; a generated key's private half
  is stored wrapped under the master key, a configured one is never stored.

Revision ID: 0004_erasure
Revises: 0003_data_keys
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0004_erasure"
down_revision: str | Sequence[str] | None = "0003_data_keys"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "erasures",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("subject_hash", sa.LargeBinary(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("idempotency_key", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), server_default="pending", nullable=False),
        sa.Column("command_id", sa.Uuid(), nullable=False),
        sa.Column("cutoff", TIMESTAMP, nullable=False),
        sa.Column("requested_at", TIMESTAMP, nullable=False),
        sa.Column("verified_at", TIMESTAMP, nullable=True),
        sa.Column("key_ids_destroyed", postgresql.JSONB(), nullable=False),
        sa.Column("updated_at", TIMESTAMP, server_default=sa.func.now(), nullable=False),
        sa.CheckConstraint(
            "status IN ('pending', 'partial', 'verified', 'failed')",
            name=op.f("ck_erasures_status"),
        ),
        sa.ForeignKeyConstraint(
            ["command_id"],
            ["invalidations.command_id"],
            name=op.f("fk_erasures_command_id_invalidations"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_erasures")),
        sa.UniqueConstraint(
            "tenant_id", "idempotency_key", name=op.f("uq_erasures_tenant_id_idempotency_key")
        ),
    )
    op.create_index(op.f("ix_erasures_status"), "erasures", ["status"])
    op.create_index(
        op.f("ix_erasures_tenant_id_subject_hash"), "erasures", ["tenant_id", "subject_hash"]
    )
    op.create_index(op.f("ix_erasures_command_id"), "erasures", ["command_id"])

    op.create_table(
        "receipt_keys",
        sa.Column("key_id", sa.Text(), nullable=False),
        sa.Column("public_key", sa.LargeBinary(), nullable=False),
        sa.Column("private_key", sa.LargeBinary(), nullable=True),
        sa.Column("created_at", TIMESTAMP, server_default=sa.func.now(), nullable=False),
        sa.Column("retired_at", TIMESTAMP, nullable=True),
        sa.PrimaryKeyConstraint("key_id", name=op.f("pk_receipt_keys")),
    )

    op.create_table(
        "receipts",
        sa.Column("receipt_id", sa.Uuid(), nullable=False),
        sa.Column("erasure_id", sa.Uuid(), nullable=False),
        sa.Column("document", postgresql.JSONB(), nullable=False),
        sa.Column("leaf_index", sa.BigInteger(), nullable=False),
        sa.Column("created_at", TIMESTAMP, server_default=sa.func.now(), nullable=False),
        sa.ForeignKeyConstraint(
            ["erasure_id"], ["erasures.id"], name=op.f("fk_receipts_erasure_id_erasures")
        ),
        sa.PrimaryKeyConstraint("receipt_id", name=op.f("pk_receipts")),
        sa.UniqueConstraint("erasure_id", name=op.f("uq_receipts_erasure_id")),
        sa.UniqueConstraint("leaf_index", name=op.f("uq_receipts_leaf_index")),
    )

    op.create_table(
        "audit_log",
        sa.Column("leaf_index", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("leaf_hash", sa.LargeBinary(), nullable=False),
        sa.Column("receipt_id", sa.Uuid(), nullable=False),
        sa.Column("appended_at", TIMESTAMP, server_default=sa.func.now(), nullable=False),
        sa.ForeignKeyConstraint(
            ["receipt_id"], ["receipts.receipt_id"], name=op.f("fk_audit_log_receipt_id_receipts")
        ),
        sa.PrimaryKeyConstraint("leaf_index", name=op.f("pk_audit_log")),
        sa.UniqueConstraint("receipt_id", name=op.f("uq_audit_log_receipt_id")),
    )

    op.create_table(
        "tree_heads",
        sa.Column("tree_size", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("root_hash", sa.LargeBinary(), nullable=False),
        sa.Column("timestamp", TIMESTAMP, nullable=False),
        sa.Column("key_id", sa.Text(), nullable=False),
        sa.Column("signature", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["key_id"], ["receipt_keys.key_id"], name=op.f("fk_tree_heads_key_id_receipt_keys")
        ),
        sa.PrimaryKeyConstraint("tree_size", name=op.f("pk_tree_heads")),
    )


def downgrade() -> None:
    op.drop_table("tree_heads")
    op.drop_table("audit_log")
    op.drop_table("receipts")
    op.drop_table("receipt_keys")
    op.drop_table("erasures")
