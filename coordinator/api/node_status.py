"""Known nodes and their liveness, as ``GET /v1/nodes`` and the console's overview show them.

Liveness is the age of a node's last heartbeat or kv-event against
``ledger.heartbeat_timeout_s``; occupancy is its live placements per tier.
"""

from __future__ import annotations

import collections
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from coordinator.http import iso
from coordinator.ledger.models import Node, Placement
from coordinator.ledger.states import PlacementState
from events.tiers import Tier


async def node_statuses(session: AsyncSession, heartbeat_timeout_s: float) -> list[dict[str, Any]]:
    """Every known node, ordered by id, with liveness from its last heartbeat or event and live copies per tier."""
    last_seen = func.greatest(Node.last_heartbeat, Node.last_event_at)
    rows = (
        await session.execute(
            select(Node, func.extract("epoch", func.now() - last_seen).label("age_s")).order_by(
                Node.node_id
            )
        )
    ).all()
    counts: dict[str, dict[str, int]] = collections.defaultdict(dict)
    for node_id, tier, count in await session.execute(
        select(Placement.node_id, Placement.tier, func.count())
        .where(Placement.state == PlacementState.LIVE)
        .group_by(Placement.node_id, Placement.tier)
    ):
        counts[node_id][tier] = count
    return [
        {
            "node_id": node.node_id,
            "epoch": node.epoch,
            "last_seq": node.last_seq,
            "status": node.status,
            "namespace": node.namespace,
            "started_at": iso(node.started_at),
            "last_heartbeat": iso(node.last_heartbeat),
            "last_event_at": iso(node.last_event_at),
            "last_seen_age_s": float(age_s),
            "alive": float(age_s) < heartbeat_timeout_s,
            "num_live_placements": {t: counts[node.node_id].get(t, 0) for t in Tier},
        }
        for node, age_s in rows
    ]
