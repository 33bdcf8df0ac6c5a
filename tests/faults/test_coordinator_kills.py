"""SIGKILL of the coordinator process at each step of a decision's life, then the invariants.

One chain of five deaths, each armed with the next fault point before the restart, so the restarted
process dies again while it recovers the previous one's work (every restart is a recovery *and* the
next fault):

1. ``after_publish`` — a document update's command published, its ``sent_at`` stamp not committed;
2. ``after_decision_commit`` — the recovery re-publishes that command once its lease ran out; an
   erasure is decided and committed, its command not published;
3. ``mid_ack_batch`` — the recovery's outbox relay publishes the erasure, the nodes ack, and the
   process dies with the ack batch's targets updated but nothing committed;
4. ``mid_erasure_verification`` — the erasure's progress read under its lock, nothing written;
5. ``during_receipt_issue`` — the receipt signed and appended to the audit log, not committed.

The last restart is unarmed: the redelivered acks, the re-sender and the periodic verification must
finish everything, with exactly one receipt, and every invariant holds.
"""

from __future__ import annotations

import uuid

import asyncpg

from bench.cluster import READER_SCOPES, Cluster, document_chat, private_chat
from bench.invariants import Invariants
from events import schema


async def _fetch(cluster: Cluster, sql: str, *args) -> list[asyncpg.Record]:
    connection = await asyncpg.connect(**cluster.connect_kwargs())
    try:
        return await connection.fetch(sql, *args)
    finally:
        await connection.close()


async def test_coordinator_sigkill_at_every_step_then_everything_completes(
    cluster: Cluster, invariants: Invariants
) -> None:
    tenant, doc = f"coord-{uuid.uuid4().hex[:6]}", "handbook"
    alice = f"alice-{uuid.uuid4().hex[:6]}"
    reader = cluster.user_token(tenant, "reader", READER_SCOPES)
    for index in range(len(cluster.nodes)):
        await cluster.chat(index, reader, document_chat(doc, 1))
        await cluster.chat(index, cluster.user_token(tenant, alice), private_chat(alice))
    coordinator = cluster.coordinator

    await cluster.restart_coordinator("coordinator.after_publish")
    update = await cluster.publish(schema.DocumentUpdated(doc_id=doc, version=2), tenant)
    await cluster.died_at_fault_point(coordinator)
    decided = await _fetch(
        cluster,
        "SELECT i.command_id, count(o.id) FILTER (WHERE o.sent_at IS NULL) AS unsent FROM invalidations i"
        " JOIN outbox o ON o.payload->'payload'->>'command_id' = i.command_id::text"
        " WHERE i.source_event_id = $1 GROUP BY i.command_id",
        update.event_id,
    )
    assert [row["unsent"] for row in decided] == [1], (
        "the command was published but its stamp never committed"
    )

    await coordinator.start("coordinator.after_decision_commit")
    await cluster.publish(
        schema.ErasureRequested(subject_id=alice, reason="fault-injection erasure"), tenant
    )
    await cluster.died_at_fault_point(coordinator)
    (erasure,) = await _fetch(
        cluster, "SELECT id, command_id FROM erasures WHERE tenant_id = $1", tenant
    )
    unsent = await _fetch(
        cluster,
        "SELECT count(*) AS n FROM outbox WHERE sent_at IS NULL AND payload->'payload'->>'command_id' = $1",
        str(erasure["command_id"]),
    )
    assert unsent[0]["n"] == 1, "the erasure was decided and committed, its command not published"

    coordinator.spawn("coordinator.mid_ack_batch")
    await cluster.died_at_fault_point(coordinator)
    targets = await _fetch(
        cluster,
        "SELECT status FROM invalidation_targets WHERE command_id = $1",
        erasure["command_id"],
    )
    assert {row["status"] for row in targets} == {"pending"}, "the erasure's acks died uncommitted"

    coordinator.spawn("coordinator.mid_erasure_verification")
    await cluster.died_at_fault_point(coordinator)
    coordinator.spawn("coordinator.during_receipt_issue")
    await cluster.died_at_fault_point(coordinator)
    assert (
        await _fetch(
            cluster, "SELECT count(*) AS n FROM receipts WHERE erasure_id = $1", erasure["id"]
        )
    )[0]["n"] == 0

    await coordinator.start()
    violations = await invariants.check()
    receipts = await _fetch(
        cluster, "SELECT leaf_index FROM receipts WHERE erasure_id = $1", erasure["id"]
    )
    audit = await _fetch(cluster, "SELECT count(*) AS n FROM audit_log")
    receipts_total = await _fetch(cluster, "SELECT count(*) AS n FROM receipts")
    assert len(receipts) == 1, "exactly one receipt for the erasure"
    assert audit[0]["n"] == receipts_total[0]["n"], "one audit leaf per receipt"
    for index in range(len(cluster.nodes)):
        await invariants.probe_stale_document(index, tenant, document_chat(doc, 1), READER_SCOPES)
        await invariants.probe_erased(index, tenant, alice, private_chat(alice))
    violations += invariants.served_violations
    assert not violations, "\n".join(violations)
