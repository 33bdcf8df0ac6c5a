"""Usage reports: what each node served each tenant per interval, counts only (``UsageReported``).

The source of ``kvledger cost report`` (docs/operations.md, "Cost"): ``GET /v1/usage`` sums
rows per tenant whose ``window_end`` lies in the asked window, hence the two indexes.

Revision ID: 0009_usage
Revises: 0008_command_resend
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009_usage"
down_revision: str | Sequence[str] | None = "0008_command_resend"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "usage_reports",
        sa.Column("event_id", sa.Uuid(), nullable=False),
        sa.Column("node_id", sa.Text(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("window_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("window_end", sa.DateTime(timezone=True), nullable=False),
        sa.Column("num_requests", sa.BigInteger(), nullable=False),
        sa.Column("num_prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("num_cached_tokens", sa.BigInteger(), nullable=False),
        sa.Column("num_output_tokens", sa.BigInteger(), nullable=False),
        sa.Column(
            "received_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("event_id", name=op.f("pk_usage_reports")),
    )
    op.create_index(op.f("ix_usage_reports_window_end"), "usage_reports", ["window_end"])
    op.create_index(
        op.f("ix_usage_reports_tenant_id_window_end"), "usage_reports", ["tenant_id", "window_end"]
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_usage_reports_tenant_id_window_end"), table_name="usage_reports")
    op.drop_index(op.f("ix_usage_reports_window_end"), table_name="usage_reports")
    op.drop_table("usage_reports")
