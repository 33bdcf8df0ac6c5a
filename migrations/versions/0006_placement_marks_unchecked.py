"""``placements.invalidation_id`` without a foreign key.

A decision marks every live copy its predicate matches with the command id, often a
few hundred rows per transaction, and PostgreSQL checks a foreign key once per
updated row: on the invalidation benchmark the check took 12 of the 22 ms of the
marking statement, inside the decision transaction that every invalidation waits
for. The column is written only by the decision marking and the ack's copy deletion,
both with the id of an invalidation that exists in the same transaction, and
invalidations are never deleted; the other tables' ``invalidation_id`` keep theirs
(one row per decision).

Revision ID: 0006_placement_marks_unchecked
Revises: 0005_outbox_lease
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0006_placement_marks_unchecked"
down_revision: str | Sequence[str] | None = "0005_outbox_lease"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CONSTRAINT = "fk_placements_invalidation_id_invalidations"


def upgrade() -> None:
    op.drop_constraint(CONSTRAINT, "placements", type_="foreignkey")


def downgrade() -> None:
    op.execute(
        "UPDATE placements SET invalidation_id = NULL WHERE invalidation_id IS NOT NULL"
        " AND NOT EXISTS (SELECT 1 FROM invalidations i WHERE i.command_id = placements.invalidation_id)"
    )
    op.create_foreign_key(
        CONSTRAINT, "placements", "invalidations", ["invalidation_id"], ["command_id"]
    )
