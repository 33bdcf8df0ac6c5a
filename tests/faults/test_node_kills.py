"""SIGKILL of a node process between tombstone and delete, between delete and ack, and during a
snapshot write; each time the node comes back with the same data directory (a new epoch), then the
invariants.

A chain on one node, each restart armed with the next fault point:

1. ``between_tombstone_and_delete`` — a document update's matches tombstoned, no byte deleted (or,
   when a command an earlier life left unacked is replayed at start, that command's);
2. ``between_delete_and_ack`` — the restarted node replays the unacked command (its offset was never
   committed), deletes and dies before the ack leaves;
3. ``during_snapshot_write`` — the next life replays and acks; a snapshot's shards are written and
   the process dies before the manifest;
4. ``kv_events_send_timed_out`` — an ambiguous producer failure: the broker took the node's third
   kv-events send of its new life, the publisher was told it timed out, and must resend the *same
   bytes* under the same ``seq`` (no gap, no second content, applied once through the inbox).

The last life is not killed. The ledger must match the node (disk blocks that survived a kill are
reported by the restart's inventory), the update must be complete on both nodes, an erasure of a
subject whose blocks were on every tier (disk included) must verify, and the half-written snapshot
must be gone rather than left on disk where neither the ledger nor any command can see it.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from bench.cluster import READER_SCOPES, Cluster, document_chat, private_chat
from bench.common import wait
from bench.invariants import Invariants
from events import schema
from gpu_node.pool.snapshots import MANIFEST_NAME

VICTIM = 0


async def _fill(cluster: Cluster, tenant: str, subject: str, doc: str, version: int) -> None:
    """The subject's and the document's blocks first, then enough other users that they spill to host and disk."""
    await cluster.chat(VICTIM, cluster.user_token(tenant, subject), private_chat(subject))
    await cluster.chat(
        VICTIM, cluster.user_token(tenant, "reader", READER_SCOPES), document_chat(doc, version)
    )
    for index in range(6):
        filler = f"filler-{index}"
        await cluster.chat(VICTIM, cluster.user_token(tenant, filler), private_chat(filler))


async def test_node_sigkill_at_every_step_then_the_ledger_matches_it(
    cluster: Cluster, invariants: Invariants
) -> None:
    tenant, doc = f"node-{uuid.uuid4().hex[:6]}", "policy"
    bob = f"bob-{uuid.uuid4().hex[:6]}"
    node = cluster.nodes[VICTIM]
    snapshots = cluster.work_dir / cluster.node_ids[VICTIM] / "snapshots"

    await node.stop()
    if await cluster.start_armed(node, "node.between_tombstone_and_delete"):
        await _fill(cluster, tenant, bob, doc, 1)
        await cluster.publish(schema.DocumentUpdated(doc_id=doc, version=2), tenant)
        await cluster.died_at_fault_point(node)
    else:  # it died replaying an earlier scenario's re-sent command; the update then waits for its next life
        await cluster.publish(schema.DocumentUpdated(doc_id=doc, version=2), tenant)

    node.spawn("node.between_delete_and_ack")
    await cluster.died_at_fault_point(node)

    await node.start("node.during_snapshot_write")
    await _fill(cluster, tenant, bob, doc, 2)
    with pytest.raises(httpx.TransportError):
        await cluster.snapshot(VICTIM)
    await cluster.died_at_fault_point(node)
    assert [path for path in snapshots.iterdir() if not (path / MANIFEST_NAME).exists()], (
        "the kill left a half-written snapshot"
    )

    num_records = len(cluster.tail.kv_events)
    await node.start("node.kv_events_send_timed_out:3")
    assert [
        path.name for path in snapshots.iterdir() if not (path / MANIFEST_NAME).exists()
    ] == [], (
        "a half-written snapshot survived the restart: bytes neither the ledger nor any command can reach"
    )
    await cluster.chat(VICTIM, cluster.user_token(tenant, bob), private_chat(bob))
    await cluster.chat(
        VICTIM, cluster.user_token(tenant, "reader", READER_SCOPES), document_chat(doc, 2)
    )

    async def resent() -> bool:
        copies: dict[uuid.UUID, list[bytes]] = {}
        for record in cluster.tail.kv_events[num_records:]:
            if record.envelope.payload.node_id == cluster.node_ids[VICTIM]:
                copies.setdefault(record.envelope.event_id, []).append(record.value)
        return any(len(values) > 1 for values in copies.values())

    await wait(resent, "the kv-events send reported as timed out to be resent", timeout_s=30)
    assert (await cluster.snapshot(VICTIM)).status_code == 201
    await cluster.request_erasure(tenant, bob)

    violations = await invariants.check()
    for index in range(len(cluster.nodes)):
        await invariants.probe_stale_document(index, tenant, document_chat(doc, 1), READER_SCOPES)
        await invariants.probe_erased(index, tenant, bob, private_chat(bob))
    violations += invariants.served_violations
    assert not violations, "\n".join(violations)
