"""kv-events published to a real broker end up as exact ledger rows (real Postgres, real consumer
group).

The coordinator's consumers run in-process (``run_consumers``) against a database
created for this module; every test uses its own node ids, so tests are independent
even though the broker and its topics are shared by the whole session.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from helpers.ledger import (
    SUBJECT_KEY,
    FakeNode,
    RunningConsumers,
    block_hash,
    eventually,
    fresh_database,
    scan_topic,
    settings_at_topic_ends,
    stored,
)
from prometheus_client import REGISTRY
from sqlalchemy import func, select

from coordinator.handlers.ingest import LedgerIngest
from coordinator.ledger.db import Database
from coordinator.ledger.models import (
    Block,
    BlockAuthScope,
    BlockDocument,
    DeadLetterCount,
    InboxEntry,
    Node,
    OutboxEntry,
    Placement,
    Snapshot,
)
from coordinator.settings import CoordinatorSettings, DatabaseSettings
from events.codec import DeadLetter, encode_key
from events.kafka.consumer import ConsumedEvent
from events.kafka.producer import EventProducer
from events.schema import (
    BlockMoved,
    BlockProvenance,
    BlockRemoved,
    BlockStored,
    Envelope,
    Inventory,
    InventoryRequested,
    MovedBlock,
    NodeHeartbeat,
    NodeStarted,
    RemovedBlock,
    SnapshotDeleted,
    SnapshotWritten,
    make_event,
    parse_event,
    subject_digest,
)
from events.schema import Placement as InventoryPlacement
from events.topics import COMMANDS, DEAD_LETTER, KV_EVENTS
from identity.signing import EnvelopeSigner


@pytest.fixture(scope="module")
async def settings(ledger_url: str, kafka_bootstrap: str) -> CoordinatorSettings:
    # At the topics' ends: what earlier modules left on the worker's broker (thousands of kv-events
    # after the fleet and replica modules) is not this module's to re-read before its first event.
    return await settings_at_topic_ends(
        ledger_url, kafka_bootstrap, ledger={"inventory_retry_s": 3600}
    )


@pytest.fixture(scope="module")
async def coordinator(settings: CoordinatorSettings) -> AsyncIterator[None]:
    consumers = await RunningConsumers(settings).start()
    yield
    await consumers.stop()


@pytest.fixture
def node_id() -> str:
    return f"node-{uuid.uuid4().hex[:8]}"


async def node_row(database: Database, node_id: str) -> Node | None:
    async with database.session() as session:
        return await session.get(Node, node_id)


async def wait_applied(database: Database, node_id: str, epoch: int, seq: int) -> None:
    async def applied() -> bool:
        node = await node_row(database, node_id)
        return node is not None and (node.epoch, node.last_seq) >= (epoch, seq)

    await eventually(applied, what=f"{node_id} to reach epoch {epoch} seq {seq}")


async def placements(
    database: Database, node_id: str
) -> set[tuple[str, str, str | None, str, str | None]]:
    """(block hash, tier, snapshot id, state, reason) of every placement row of a node."""
    async with database.session() as session:
        rows = await session.execute(
            select(
                Placement.block_hash,
                Placement.tier,
                Placement.snapshot_id,
                Placement.state,
                Placement.reason,
            ).where(Placement.node_id == node_id)
        )
        return {(row[0].hex(), *row[1:]) for row in rows}


def counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def first_record(topic: str, bootstrap: str, match, timeout_s: float = 30.0):
    """Read ``topic`` from the beginning until a record satisfies ``match``; returns ``match``'s
    result."""
    found = []

    def visit(record) -> bool:
        result = match(record)
        if result is not None:
            found.append(result)
        return bool(found)

    await scan_topic(bootstrap, topic, visit, timeout_s)
    return found[0]


async def test_block_events_build_exact_ledger(
    coordinator, database: Database, producer: EventProducer, node_id: str
) -> None:
    node = FakeNode(producer, node_id)
    subject = subject_digest(SUBJECT_KEY.encode(), "acme", "alice")
    public = stored(f"{node_id}/p", "device")
    handbook = stored(
        f"{node_id}/t",
        "device",
        tenant_id="acme",
        scope="tenant",
        auth_scopes=[("hr", 3)],
        documents=["handbook@7"],
        token_offset=16,
        parent=f"{node_id}/p",
    )
    chat = stored(
        f"{node_id}/u",
        "host",
        tenant_id="acme",
        scope="user",
        subject_id=subject,
        auth_scopes=[("hr", 3)],
        documents=["handbook@7"],
        token_offset=32,
        parent=f"{node_id}/t",
    )
    await node.start(epoch=1)
    await node.publish(BlockStored, blocks=[public, handbook, chat])
    await node.publish(
        BlockMoved,
        blocks=[MovedBlock(block_hash=public.block_hash, from_tier="device", to_tier="host")],
    )
    await node.publish(
        BlockRemoved,
        blocks=[RemovedBlock(block_hash=handbook.block_hash, tier="device")],
        reason="evicted",
    )
    await node.publish(
        SnapshotWritten, snapshot_id="snap-1", block_hashes=[public.block_hash, chat.block_hash]
    )
    await wait_applied(database, node_id, 1, node.seq)

    assert await placements(database, node_id) == {
        (public.block_hash, "device", None, "deleted", "moved"),
        (public.block_hash, "host", None, "live", None),
        (handbook.block_hash, "device", None, "deleted", "evicted"),
        (chat.block_hash, "host", None, "live", None),
        (public.block_hash, "snapshot", "snap-1", "live", None),
        (chat.block_hash, "snapshot", "snap-1", "live", None),
    }
    hashes = [bytes.fromhex(b.block_hash) for b in (public, handbook, chat)]
    async with database.session() as session:
        blocks = {
            row.block_hash.hex(): (
                row.parent_hash,
                row.tenant_id,
                row.scope,
                row.subject_hash,
                row.token_offset,
            )
            for row in await session.scalars(select(Block).where(Block.block_hash.in_(hashes)))
        }
        auth = set(
            (
                await session.execute(
                    select(
                        BlockAuthScope.block_hash,
                        BlockAuthScope.auth_scope,
                        BlockAuthScope.policy_version,
                    ).where(BlockAuthScope.block_hash.in_(hashes))
                )
            ).all()
        )
        docs = set(
            (
                await session.execute(
                    select(
                        BlockDocument.block_hash, BlockDocument.doc_id, BlockDocument.version
                    ).where(BlockDocument.block_hash.in_(hashes))
                )
            ).all()
        )
        snapshot = await session.get(Snapshot, (node_id, "snap-1"))
        node_state = await session.get(Node, node_id)
    assert blocks == {
        public.block_hash: (None, None, "public", None, 0),
        handbook.block_hash: (bytes.fromhex(public.block_hash), "acme", "tenant", None, 16),
        chat.block_hash: (
            bytes.fromhex(handbook.block_hash),
            "acme",
            "user",
            bytes.fromhex(subject),
            32,
        ),
    }
    assert auth == {(hashes[1], "hr", 3), (hashes[2], "hr", 3)}
    assert docs == {(hashes[1], "handbook", 7), (hashes[2], "handbook", 7)}
    assert (snapshot.state, snapshot.num_blocks) == ("live", 2)
    assert (node_state.status, node_state.namespace, node_state.inventory_request_id) == (
        "active",
        "ns-test",
        None,
    )

    await node.publish(SnapshotDeleted, snapshot_id="snap-1")
    await wait_applied(database, node_id, 1, node.seq)
    assert {p for p in await placements(database, node_id) if p[1] == "snapshot"} == {
        (public.block_hash, "snapshot", "snap-1", "deleted", "snapshot_deleted"),
        (chat.block_hash, "snapshot", "snap-1", "deleted", "snapshot_deleted"),
    }


async def _ledger_rows(database: Database, node_id: str) -> tuple:
    async with database.session() as session:
        node = await session.get(Node, node_id)
        rows = (
            await session.execute(
                select(Placement).where(Placement.node_id == node_id).order_by(Placement.id)
            )
        ).scalars()
        num_inbox = await session.scalar(select(func.count()).select_from(InboxEntry))
        return (
            (node.epoch, node.last_seq, node.status, node.last_event_at),
            [(p.block_hash, p.tier, p.state, p.epoch, p.reason, p.updated_at) for p in rows],
            num_inbox,
        )


async def test_redelivered_record_changes_nothing(
    coordinator, database: Database, producer: EventProducer, node_id: str
) -> None:
    node = FakeNode(producer, node_id)
    await node.start(epoch=1)
    envelope = await node.publish(BlockStored, blocks=[stored(f"{node_id}/a", "device")])
    await wait_applied(database, node_id, 1, node.seq)
    before = await _ledger_rows(database, node_id)

    # The very same record (same event_id) again: the inbox makes it a no-op.
    duplicates = counter("kvledger_ledger_events_total", type="BlockStored", outcome="duplicate")
    await producer.send(envelope)

    async def seen_duplicate() -> bool:
        return (
            counter("kvledger_ledger_events_total", type="BlockStored", outcome="duplicate")
            > duplicates
        )

    await eventually(seen_duplicate, what="the duplicate to be consumed")
    assert await _ledger_rows(database, node_id) == before

    # A re-publication under a new event id but an already applied seq is recognised by seq.
    replayed = counter("kvledger_ledger_events_total", type="BlockStored", outcome="replayed")
    await producer.send(make_event(envelope.payload))

    async def seen_replay() -> bool:
        return (
            counter("kvledger_ledger_events_total", type="BlockStored", outcome="replayed")
            > replayed
        )

    await eventually(seen_replay, what="the replay to be consumed")
    after = await _ledger_rows(database, node_id)
    # Only its inbox row is new (and last_event_at moved: any record is a sign of life).
    assert (after[0][:3], after[1], after[2]) == (before[0][:3], before[1], before[2] + 1)


async def test_malformed_record_is_dead_lettered_and_consumption_continues(
    coordinator,
    database: Database,
    producer: EventProducer,
    settings: CoordinatorSettings,
    node_id: str,
) -> None:
    node = FakeNode(producer, node_id)
    marker = uuid.uuid4().hex
    bad = f'{{"event_id": "{marker}", "type": "BlockStored"}}'.encode()
    async with database.session() as session:
        before = (
            await session.scalar(
                select(DeadLetterCount.num_records).where(DeadLetterCount.topic == KV_EVENTS)
            )
            or 0
        )
    await producer.send_raw(KV_EVENTS, bad, encode_key(node_id))
    await node.start(epoch=1)  # same key, so the same partition, after the bad record
    await wait_applied(database, node_id, 1, 0)

    def is_ours(record) -> DeadLetter | None:
        letter = DeadLetter.model_validate_json(record.value)
        return letter if letter.raw_value() == bad else None

    letter = await first_record(DEAD_LETTER, settings.kafka.bootstrap, is_ours)
    assert (letter.topic, letter.raw_key(), letter.group_id) == (
        KV_EVENTS,
        node_id.encode(),
        settings.kafka.group_id,
    )
    assert "payload" in letter.error or "field" in letter.error.lower()

    async def counted() -> bool:
        async with database.session() as session:
            count = await session.scalar(
                select(DeadLetterCount.num_records).where(DeadLetterCount.topic == KV_EVENTS)
            )
        return (count or 0) > before

    await eventually(counted, what="the dead letter to be counted in the ledger")


async def test_restart_drops_device_and_host_but_keeps_disk(
    coordinator, database: Database, producer: EventProducer, node_id: str
) -> None:
    node = FakeNode(producer, node_id)
    dev, host, disk = (stored(f"{node_id}/{tier}", tier) for tier in ("device", "host", "disk"))
    await node.start(epoch=1)
    await node.publish(BlockStored, blocks=[dev, host, disk])
    await node.publish(SnapshotWritten, snapshot_id="warm", block_hashes=[disk.block_hash])
    await wait_applied(database, node_id, 1, node.seq)

    await node.start(epoch=2)
    await wait_applied(database, node_id, 2, 0)
    assert await placements(database, node_id) == {
        (dev.block_hash, "device", None, "deleted", "node_restarted"),
        (host.block_hash, "host", None, "deleted", "node_restarted"),
        (disk.block_hash, "disk", None, "live", None),
        (disk.block_hash, "snapshot", "warm", "live", None),
    }
    node_state = await node_row(database, node_id)
    assert node_state.status == "active"  # a clean restart is not a hole

    # A straggler of the old epoch describes a process that is gone: ignored.
    stale = make_event(
        BlockStored(node_id=node_id, epoch=1, seq=99, blocks=[stored(f"{node_id}/late", "device")])
    )
    stale_before = counter("kvledger_ledger_events_total", type="BlockStored", outcome="stale")
    await producer.send(stale)

    async def seen_stale() -> bool:
        return (
            counter("kvledger_ledger_events_total", type="BlockStored", outcome="stale")
            > stale_before
        )

    await eventually(seen_stale, what="the stale event to be consumed")
    assert len(await placements(database, node_id)) == 4


def _inventory_request_for(node_id: str):
    def match(record) -> InventoryRequested | None:
        envelope = parse_event(record.value)
        payload = envelope.payload
        if isinstance(payload, InventoryRequested) and payload.node_id == node_id:
            assert record.key == node_id.encode()
            return payload
        return None

    return match


def _provenance(block) -> BlockProvenance:
    return BlockProvenance(**block.model_dump(exclude={"tier"}))


async def test_seq_gap_requests_inventory_and_inventory_reconciles(
    coordinator,
    database: Database,
    producer: EventProducer,
    settings: CoordinatorSettings,
    node_id: str,
) -> None:
    node = FakeNode(producer, node_id)
    a, b = stored(f"{node_id}/a", "device"), stored(f"{node_id}/b", "device")
    c = stored(f"{node_id}/c", "disk")
    await node.start(epoch=1)
    await node.publish(BlockStored, blocks=[a, b])
    node.seq += 1  # seq 2 is lost on the way
    await node.publish(BlockStored, blocks=[c])
    await wait_applied(database, node_id, 1, 3)

    request = await first_record(
        COMMANDS, settings.kafka.bootstrap, _inventory_request_for(node_id)
    )
    node_state = await node_row(database, node_id)
    assert (node_state.status, node_state.inventory_request_id) == (
        "reconciling",
        request.request_id,
    )

    async def outbox_sent() -> bool:
        async with database.session() as session:
            rows = (
                await session.scalars(select(OutboxEntry).where(OutboxEntry.key == node_id))
            ).all()
        return len(rows) == 1 and rows[0].sent_at is not None

    await eventually(outbox_sent, what="the outbox row to be marked sent")

    # The node's truth: a is still on device, d (never reported) on disk and in a snapshot; b and c
    # are gone.
    d = stored(f"{node_id}/d", "disk", tenant_id="acme", scope="tenant", auth_scopes=[("*", 0)])
    await node.publish(
        Inventory,
        request_id=request.request_id,
        placements=[
            InventoryPlacement(block_hash=a.block_hash, tier="device"),
            InventoryPlacement(block_hash=d.block_hash, tier="disk"),
            InventoryPlacement(block_hash=d.block_hash, tier="snapshot", snapshot_id="s2"),
        ],
        blocks=[_provenance(a), _provenance(d)],
    )

    async def reconciled() -> bool:
        state = await node_row(database, node_id)
        return state.status == "active" and state.last_seq == node.seq

    await eventually(reconciled, what="the inventory to be reconciled")
    assert await placements(database, node_id) == {
        (a.block_hash, "device", None, "live", None),
        (b.block_hash, "device", None, "deleted", "reconciled"),
        (c.block_hash, "disk", None, "deleted", "reconciled"),
        (d.block_hash, "disk", None, "live", None),
        (d.block_hash, "snapshot", "s2", "live", None),
    }
    node_state = await node_row(database, node_id)
    assert (node_state.inventory_request_id, node_state.inventory_requested_at) == (None, None)


async def test_chunked_inventory_applies_only_when_complete(
    coordinator, database: Database, producer: EventProducer, node_id: str
) -> None:
    node = FakeNode(producer, node_id)
    a, b = stored(f"{node_id}/a", "device"), stored(f"{node_id}/b", "host")
    await node.start(epoch=1)
    await node.publish(BlockStored, blocks=[a, b])
    request_id = uuid.uuid4()
    await node.publish(
        Inventory,
        request_id=request_id,
        chunk=0,
        chunks=2,
        placements=[InventoryPlacement(block_hash=a.block_hash, tier="device")],
        blocks=[_provenance(a)],
    )
    await wait_applied(database, node_id, 1, node.seq)
    assert await placements(database, node_id) == {
        (a.block_hash, "device", None, "live", None),
        (b.block_hash, "host", None, "live", None),
    }
    await node.publish(
        Inventory, request_id=request_id, chunk=1, chunks=2, placements=[], blocks=[]
    )
    await wait_applied(database, node_id, 1, node.seq)
    assert await placements(database, node_id) == {
        (a.block_hash, "device", None, "live", None),
        (b.block_hash, "host", None, "deleted", "reconciled"),
    }


async def test_holes_without_seq_gap_request_inventory(
    coordinator,
    database: Database,
    producer: EventProducer,
    settings: CoordinatorSettings,
    node_id: str,
) -> None:
    """A never-seen node, and a heartbeat announcing events we never got, both mean the ledger is
    incomplete."""
    node = FakeNode(producer, node_id, epoch=4)
    await node.publish(
        BlockMoved,
        seq=7,
        blocks=[
            MovedBlock(block_hash=block_hash(f"{node_id}/x"), from_tier="host", to_tier="device")
        ],
    )
    await wait_applied(database, node_id, 4, 7)
    first = await first_record(COMMANDS, settings.kafka.bootstrap, _inventory_request_for(node_id))
    assert (await node_row(database, node_id)).status == "reconciling"
    assert await placements(database, node_id) == set()  # the unknown block was not invented

    await node.publish(Inventory, placements=[], blocks=[])
    await eventually(lambda: _status_is(database, node_id, "active"), what="reconcile")

    await producer.send(make_event(NodeHeartbeat(node_id=node_id, epoch=4, seq=node.seq + 5)))
    await eventually(
        lambda: _status_is(database, node_id, "reconciling"), what="the silent gap to be noticed"
    )
    node_state = await node_row(database, node_id)
    assert (
        node_state.last_heartbeat is not None
        and node_state.inventory_request_id != first.request_id
    )


async def _status_is(database: Database, node_id: str, status: str) -> bool:
    node = await node_row(database, node_id)
    return node is not None and node.status == status


# -- the batch handler on its own: batch boundaries chosen by the test --------------------------


def _mixed_history(node_id: str) -> tuple[list[Envelope], list[Envelope]]:
    """(prelude, mixed): the prelude stores blocks in an earlier batch; ``mixed`` stores, moves and
    removes the same blocks again and again, places a block it never stored, writes a snapshot and
    restarts the node between its block events (both flush what is accumulated), so every write path
    of a batch runs."""
    node = FakeNode(None, node_id)  # type: ignore[arg-type]  # builds envelopes only
    a, b, c, d, e, old, early = (
        stored(f"{node_id}/{label}", "device")
        for label in ("a", "b", "c", "d", "e", "old", "early")
    )
    node.epoch = 1
    prelude = [
        node.event(NodeStarted, seq=0, namespace="ns-test"),
        node.event(BlockStored, blocks=[old, early]),
    ]
    mixed = [
        node.event(BlockStored, blocks=[a, b, c]),
        node.event(
            BlockMoved,
            blocks=[MovedBlock(block_hash=a.block_hash, from_tier="device", to_tier="host")],
        ),
        node.event(
            BlockRemoved,
            blocks=[RemovedBlock(block_hash=b.block_hash, tier="device")],
            reason="evicted",
        ),
        node.event(BlockStored, blocks=[b]),  # stored again after its removal: live again
        node.event(
            BlockMoved,
            blocks=[MovedBlock(block_hash=a.block_hash, from_tier="host", to_tier="disk")],
        ),
        node.event(
            BlockRemoved,
            blocks=[RemovedBlock(block_hash=old.block_hash, tier="device")],
            reason="evicted",
        ),  # an earlier batch's
        node.event(
            BlockMoved,
            blocks=[MovedBlock(block_hash=early.block_hash, from_tier="device", to_tier="host")],
        ),
        node.event(BlockStored, blocks=[d.model_copy(update={"tier": "host"})]),
        node.event(
            BlockRemoved,
            blocks=[RemovedBlock(block_hash=d.block_hash, tier="host")],
            reason="evicted",
        ),  # stored and gone
        node.event(
            SnapshotWritten,
            snapshot_id="snap-1",
            block_hashes=[a.block_hash, b.block_hash, c.block_hash],
        ),
        node.event(
            BlockRemoved,
            blocks=[RemovedBlock(block_hash=c.block_hash, tier="device")],
            reason="evicted",
        ),
        node.event(
            BlockMoved,
            blocks=[
                MovedBlock(
                    block_hash=block_hash(f"{node_id}/never"), from_tier="device", to_tier="host"
                )
            ],
        ),
    ]
    node.epoch = 2
    mixed += [
        node.event(NodeStarted, seq=0, namespace="ns-test"),
        node.event(BlockStored, blocks=[e, a]),
        node.event(
            BlockRemoved,
            blocks=[RemovedBlock(block_hash=a.block_hash, tier="disk")],
            reason="evicted",
        ),
        node.event(
            BlockMoved,
            blocks=[MovedBlock(block_hash=e.block_hash, from_tier="device", to_tier="host")],
        ),
    ]
    return prelude, mixed


def _consumed(envelopes: Sequence[Envelope], first_offset: int = 0) -> list[ConsumedEvent]:
    return [
        ConsumedEvent(
            topic=KV_EVENTS,
            partition=0,
            offset=first_offset + i,
            key=envelope.payload.node_id,
            timestamp_ms=0,
            envelope=envelope,
        )
        for i, envelope in enumerate(envelopes)
    ]


async def _ingest_batches(
    database_url: str, ledger_template: str, batches: Sequence[Sequence[Envelope]]
) -> tuple:
    """Apply ``batches`` (each one handler call, offsets continuing) to a fresh ledger; returns its
    rows."""
    async with fresh_database(database_url, ledger_template) as url:
        database = Database(DatabaseSettings(url=url))
        try:
            ingest = LedgerIngest(
                database,
                inventory_retry_s=3600,
                command_signer=EnvelopeSigner(Ed25519PrivateKey.generate()),
            )
            offset = 0
            for batch in batches:
                await ingest(_consumed(batch, offset))
                offset += len(batch)
            return await _everything(database)
        finally:
            await database.dispose()


async def _everything(database: Database) -> tuple:
    """Every ledger row a kv-events batch writes, in a comparable form (ids and times left out)."""
    async with database.session() as session:
        placement_rows = await session.execute(
            select(
                Placement.block_hash,
                Placement.node_id,
                Placement.tier,
                Placement.snapshot_id,
                Placement.state,
                Placement.epoch,
                Placement.reason,
            )
        )
        block_rows = await session.execute(
            select(
                Block.block_hash,
                Block.parent_hash,
                Block.namespace,
                Block.tenant_id,
                Block.scope,
                Block.subject_hash,
                Block.token_offset,
            )
        )
        node_rows = await session.execute(
            select(Node.node_id, Node.epoch, Node.last_seq, Node.status, Node.namespace)
        )
        snapshot_rows = await session.execute(
            select(Snapshot.node_id, Snapshot.snapshot_id, Snapshot.state, Snapshot.num_blocks)
        )
        num_inbox = await session.scalar(select(func.count()).select_from(InboxEntry))
        requests = [
            payload["payload"]["node_id"]
            for payload in await session.scalars(select(OutboxEntry.payload))
            if payload["type"] == InventoryRequested.TYPE
        ]
        return (
            sorted(tuple(row) for row in placement_rows),
            sorted(tuple(row) for row in block_rows),
            sorted(tuple(row) for row in node_rows),
            sorted(tuple(row) for row in snapshot_rows),
            num_inbox,
            sorted(requests),
        )


async def test_one_batch_builds_the_ledger_that_one_event_per_batch_builds(
    database_url: str, ledger_template: str
) -> None:
    """A batch is staged and written set-based (net change per placement); the result must not depend on
    where batch boundaries fall."""
    node_id = f"node-{uuid.uuid4().hex[:8]}"
    prelude, mixed = _mixed_history(node_id)
    as_one = await _ingest_batches(database_url, ledger_template, [prelude, mixed])
    one_by_one = await _ingest_batches(
        database_url, ledger_template, [prelude, *([event] for event in mixed)]
    )
    assert as_one == one_by_one
    placements_of_node = {
        (h.hex(), tier, sid, state, epoch, reason)
        for h, _, tier, sid, state, epoch, reason in as_one[0]
    }
    a, b, c, d, e, old, early = (
        block_hash(f"{node_id}/{label}") for label in ("a", "b", "c", "d", "e", "old", "early")
    )
    assert placements_of_node == {
        (a, "device", None, "live", 2, None),  # moved away in epoch 1, stored again in epoch 2
        (a, "host", None, "deleted", 1, "moved"),
        (a, "disk", None, "deleted", 2, "evicted"),  # survived the restart (disk), removed after it
        (a, "snapshot", "snap-1", "live", 1, None),
        (
            b,
            "device",
            None,
            "deleted",
            1,
            "node_restarted",
        ),  # live again after its removal, until the restart
        (b, "snapshot", "snap-1", "live", 1, None),
        (c, "device", None, "deleted", 1, "evicted"),
        (c, "snapshot", "snap-1", "live", 1, None),
        (
            d,
            "host",
            None,
            "deleted",
            1,
            "evicted",
        ),  # stored and removed within the batch: the row exists
        (old, "device", None, "deleted", 1, "evicted"),
        (early, "device", None, "deleted", 1, "moved"),
        (early, "host", None, "deleted", 1, "node_restarted"),
        (e, "device", None, "deleted", 2, "moved"),
        (e, "host", None, "live", 2, None),
    }
    assert as_one[3] == [(node_id, "snap-1", "live", 3)]
    # The move of a block never stored is a hole: the node is reconciling, asked once for an
    # inventory.
    assert as_one[2] == [(node_id, 2, 3, "reconciling", "ns-test")] and as_one[5] == [node_id]
    assert as_one[4] == len(prelude) + len(mixed)


async def test_redelivered_batch_after_a_crash_applies_nothing_twice(
    database_url: str, ledger_template: str
) -> None:
    """A coordinator that dies after its database commit but before the offset commit gets its batch
    again, possibly with newer records behind it: the applied part must be a no-op, the rest applied
    once."""
    node_id = f"node-{uuid.uuid4().hex[:8]}"
    prelude, mixed = _mixed_history(node_id)
    applied_once = await _ingest_batches(database_url, ledger_template, [prelude, mixed])
    half = len(mixed) // 2
    redelivered = await _ingest_batches(
        database_url, ledger_template, [prelude, mixed[:half], mixed[:half], mixed, mixed]
    )
    assert redelivered == applied_once
