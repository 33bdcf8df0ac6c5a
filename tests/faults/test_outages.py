"""Outages of the services and of a node, with work in flight, then the invariants.

* The broker paused (``SIGSTOP``) for :data:`BROKER_PAUSE_S` while a document update and an erasure
  are in flight and both nodes keep serving requests (block-event bursts pile up on the nodes).
* PostgreSQL restarted (fast shutdown, same data directory) while events stream in.
* A node paused (``SIGSTOP``) for longer than ``ledger.command_resend_after_s`` during an
  invalidation and an erasure: the coordinator re-sends, the node applies once and acks.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import asyncpg

from bench.cluster import READER_SCOPES, Cluster, document_chat, private_chat
from bench.invariants import Invariants
from events import schema

BROKER_PAUSE_S = 30.0
"""The issue's 30 s: longer than every consumer session (the coordinator's 2 s, each node's command
consumer's 10 s), so a broker that times sessions by its clock across the pause expires every member
and each must rejoin after the resume (the embedded Tansu keeps them: its members resume their
assignments), and longer than the node's publish interval and heartbeat by orders of magnitude, so
block events pile up and commands wait (the re-sender queues copies meanwhile). Below aiokafka's
produce request timeout (40 s): a send in flight across the pause is answered, not failed."""


async def _burst(cluster: Cluster, tenant: str, duration_s: float) -> int:
    """Chats of fresh users on every node until ``duration_s`` passed; returns how many were served."""
    served = 0
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline:
        subject = f"burst-{uuid.uuid4().hex[:6]}"
        for index in range(len(cluster.nodes)):
            await cluster.chat(
                index, cluster.user_token(tenant, subject), private_chat(subject, turns=3)
            )
            served += 1
    return served


async def _warm(cluster: Cluster, tenant: str, subject: str, doc: str) -> None:
    for index in range(len(cluster.nodes)):
        await cluster.chat(index, cluster.user_token(tenant, subject), private_chat(subject))
        await cluster.chat(
            index, cluster.user_token(tenant, "reader", READER_SCOPES), document_chat(doc, 1)
        )


async def _check(
    cluster: Cluster,
    invariants: Invariants,
    tenant: str,
    subject: str,
    doc: str,
    stale_version: int,
) -> None:
    violations = await invariants.check()
    for index in range(len(cluster.nodes)):
        await invariants.probe_stale_document(
            index, tenant, document_chat(doc, stale_version), READER_SCOPES
        )
        await invariants.probe_erased(index, tenant, subject, private_chat(subject))
    violations += invariants.served_violations
    assert not violations, "\n".join(violations)


async def test_broker_unreachable_during_updates_erasures_and_block_bursts(
    cluster: Cluster, invariants: Invariants
) -> None:
    tenant, doc, carol = f"broker-{uuid.uuid4().hex[:6]}", "rules", f"carol-{uuid.uuid4().hex[:6]}"
    await _warm(cluster, tenant, carol, doc)
    await cluster.publish(schema.DocumentUpdated(doc_id=doc, version=2), tenant)
    await cluster.request_erasure(tenant, carol)
    cluster.pause_broker()
    try:
        late_update = asyncio.create_task(
            cluster.publish(schema.DocumentUpdated(doc_id=doc, version=3), tenant)
        )
        served = await _burst(cluster, tenant, BROKER_PAUSE_S)
        assert served > 0 and not late_update.done(), (
            "the nodes serve while the broker is unreachable; the customer's send waits"
        )
    finally:
        cluster.resume_broker()
    await asyncio.wait_for(late_update, 120)
    await _check(cluster, invariants, tenant, carol, doc, stale_version=2)


async def test_postgres_restarted_mid_stream(cluster: Cluster, invariants: Invariants) -> None:
    tenant, doc, erin = f"pg-{uuid.uuid4().hex[:6]}", "guide", f"erin-{uuid.uuid4().hex[:6]}"
    await _warm(cluster, tenant, erin, doc)
    burst = asyncio.create_task(_burst(cluster, tenant, 8.0))
    await cluster.publish(schema.DocumentUpdated(doc_id=doc, version=2), tenant)
    await cluster.restart_postgres()
    await cluster.publish(
        schema.ErasureRequested(subject_id=erin, reason="fault-injection erasure"), tenant
    )
    assert await burst > 0
    await _check(cluster, invariants, tenant, erin, doc, stale_version=1)


async def test_node_paused_longer_than_the_resend_timeout(
    cluster: Cluster, invariants: Invariants
) -> None:
    tenant, doc, dave = f"pause-{uuid.uuid4().hex[:6]}", "faq", f"dave-{uuid.uuid4().hex[:6]}"
    await _warm(cluster, tenant, dave, doc)
    paused = cluster.nodes[1]
    paused.pause()
    cluster.count("node_pause")
    try:
        update = await cluster.publish(schema.DocumentUpdated(doc_id=doc, version=2), tenant)
        await cluster.request_erasure(tenant, dave)
        connection = await asyncpg.connect(**cluster.connect_kwargs())
        try:
            deadline = time.monotonic() + 60
            while True:
                rows = await connection.fetch(
                    "SELECT t.status, t.resend_count FROM invalidation_targets t JOIN invalidations i USING (command_id)"
                    " LEFT JOIN erasures e ON e.command_id = i.command_id"
                    " WHERE t.node_id = $1 AND (i.source_event_id = $2 OR e.tenant_id = $3)",
                    cluster.node_ids[1],
                    update.event_id,
                    tenant,
                )
                if len(rows) == 2 and all(row["resend_count"] >= 1 for row in rows):
                    break
                assert time.monotonic() < deadline, (
                    f"no re-send to the paused node: {[dict(row) for row in rows]}"
                )
                await asyncio.sleep(0.2)
        finally:
            await connection.close()
        assert {row["status"] for row in rows} == {"pending"}, "a paused node acks nothing"
    finally:
        paused.resume()
    await _check(cluster, invariants, tenant, dave, doc, stale_version=1)
