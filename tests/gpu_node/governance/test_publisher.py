"""The node publisher against the real broker: large backlogs go out in bounded records, in order;
nothing wedges it."""

from __future__ import annotations

import uuid

import pytest
import torch
from aiokafka.errors import KafkaError
from helpers.ledger import SUBJECT_KEY, node_key, scan_topic

from events import schema, topics
from events.codec import DeadLetter
from events.kafka.producer import EventProducer
from events.kafka.settings import KafkaSettings
from events.record_size import MAX_RECORD_BYTES
from events.tiers import Tier
from gpu_node.engine.async_engine import AsyncEngine
from gpu_node.governance.publisher import KV_EVENTS_SUBSCRIBER, MAX_BLOCKS_PER_RECORD, NodePublisher
from gpu_node.pool.vocabulary import RemovalReason, RemovedFromPool, StoredInPool
from gpu_node.settings import NodeSettings
from identity.signing import EnvelopeSigner, verify_envelope
from prefix_keys.blocks import (
    BlockKey,
    CacheProvenance,
    CacheScope,
    DocumentRef,
    Principal,
    Segment,
    compute_block_keys,
)


async def test_a_backlog_larger_than_one_record_is_split_and_published_in_order(
    tiny_model_dir, tmp_path, kafka_bootstrap
):
    node_id = f"pub-{uuid.uuid4().hex[:6]}"
    engine = AsyncEngine.from_settings(
        NodeSettings(model_dir=tiny_model_dir, data_dir=tmp_path / "node")
    )
    publisher = NodePublisher(
        engine,
        KafkaSettings(bootstrap=kafka_bootstrap),
        node_id,
        SUBJECT_KEY.encode(),
        signer=EnvelopeSigner(node_key(node_id)),
    )
    await publisher.start(tmp_path / "node")
    num_blocks = 2 * MAX_BLOCKS_PER_RECORD + 500
    token_ids = list(range(num_blocks * 16 + 1))
    keys = compute_block_keys(
        "ns-publisher",
        token_ids,
        [Segment(0, len(token_ids), CacheScope.USER)],
        Principal("acme", "alice"),
        16,
    )
    try:
        publisher.on_pool_events([StoredInPool(key, Tier.DISK) for key in keys])
        await publisher.flush()
        records: list[schema.BlockStored] = []

        def collect(record) -> bool:
            envelope = schema.parse_event(record.value)
            payload = envelope.payload
            if isinstance(payload, schema.BlockStored) and payload.node_id == node_id:
                assert verify_envelope(envelope, node_key(node_id).public_key()), (
                    "every record is signed by the node's key"
                )
                records.append(payload)
            return sum(len(r.blocks) for r in records) == num_blocks

        await scan_topic(kafka_bootstrap, topics.KV_EVENTS, collect)
        assert [len(r.blocks) for r in records] == [
            MAX_BLOCKS_PER_RECORD,
            MAX_BLOCKS_PER_RECORD,
            500,
        ]
        assert [r.seq for r in records] == [records[0].seq, records[0].seq + 1, records[0].seq + 2]
        assert [b.block_hash for r in records for b in r.blocks] == [
            key.block_hash.hex() for key in keys
        ]
        assert {b.subject_id for r in records for b in r.blocks} == {
            schema.subject_digest(SUBJECT_KEY.encode(), "acme", "alice")
        }
    finally:
        await publisher.stop()
        await engine.stop()


async def test_blocks_of_the_largest_provenance_and_a_large_snapshot_go_out_in_records_that_fit(
    tiny_model_dir, tmp_path, kafka_bootstrap
):
    """One block may name 256 auth scopes and 256 documents of 256 characters: 1000 of them are far
    over the producer's limit, so block events are cut by size too; a snapshot of more hashes than
    one record lists goes out as ``SnapshotWritten`` parts. Every record arrives, signed, within
    ``MAX_RECORD_BYTES``."""
    node_id = f"pub-{uuid.uuid4().hex[:6]}"
    engine = AsyncEngine.from_settings(
        NodeSettings(model_dir=tiny_model_dir, data_dir=tmp_path / "node")
    )
    publisher = NodePublisher(
        engine,
        KafkaSettings(bootstrap=kafka_bootstrap),
        node_id,
        SUBJECT_KEY.encode(),
        signer=EnvelopeSigner(node_key(node_id)),
    )
    await publisher.start(tmp_path / "node")
    keys = largest_provenance_keys(10)
    snapshot = [i.to_bytes(32, "big") for i in range(schema.MAX_HASHES_PER_EVENT + 5)]
    try:
        publisher.on_pool_events([StoredInPool(key, Tier.HOST) for key in keys])
        publisher.on_snapshot_written("snap-large", snapshot)
        await publisher.flush()
        stored: list[schema.BlockStored] = []
        parts: list[schema.SnapshotWritten] = []

        def collect(record) -> bool:
            envelope = schema.parse_event(record.value)
            if (
                isinstance(envelope.payload, (schema.BlockStored, schema.SnapshotWritten))
                and envelope.payload.node_id == node_id
            ):
                assert len(record.value) <= MAX_RECORD_BYTES and verify_envelope(
                    envelope, node_key(node_id).public_key()
                )
                (stored if isinstance(envelope.payload, schema.BlockStored) else parts).append(
                    envelope.payload
                )
            return sum(len(r.blocks) for r in stored) == len(keys) and sum(
                len(p.block_hashes) for p in parts
            ) == len(snapshot)

        await scan_topic(kafka_bootstrap, topics.KV_EVENTS, collect)
        assert len(stored) > 1 and [b.block_hash for r in stored for b in r.blocks] == [
            key.block_hash.hex() for key in keys
        ]
        assert [(p.part, p.parts) for p in parts] == [(0, 2), (1, 2)]
        assert [h for p in parts for h in p.block_hashes] == [h.hex() for h in snapshot]
        seqs = [r.seq for r in [*stored, *parts]]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    finally:
        await publisher.stop()
        await engine.stop()


async def test_an_inventory_of_blocks_with_the_largest_provenance_is_chunked_to_fit(
    tiny_model_dir, tmp_path, kafka_bootstrap
):
    """Inventory chunks are cut by size too: each carries its placements' provenance, a few such blocks fill one."""
    node_id = f"pub-{uuid.uuid4().hex[:6]}"
    engine = AsyncEngine.from_settings(
        NodeSettings(model_dir=tiny_model_dir, data_dir=tmp_path / "node")
    )
    publisher = NodePublisher(
        engine,
        KafkaSettings(bootstrap=kafka_bootstrap),
        node_id,
        SUBJECT_KEY.encode(),
        signer=EnvelopeSigner(node_key(node_id)),
    )
    await publisher.start(tmp_path / "node")
    pool = engine.pool
    kv = torch.ones(pool.spec.block_shape, dtype=pool.spec.dtype)
    for key in largest_provenance_keys(10, engine.namespace.namespace, pool.spec.block_size):
        entry = pool.begin_build(key)
        assert entry is not None and pool.commit_build(entry, kv)
    held = {entry.block_hash.hex() for entry in pool.ready_entries()}
    request_id = uuid.uuid4()
    try:
        await publisher.publish_inventory(request_id)
        chunks: list[schema.Inventory] = []

        def collect(record) -> bool:
            payload = schema.parse_event(record.value).payload
            if isinstance(payload, schema.Inventory) and payload.request_id == request_id:
                assert len(record.value) <= MAX_RECORD_BYTES
                chunks.append(payload)
            return bool(chunks) and len(chunks) == chunks[0].chunks

        await scan_topic(kafka_bootstrap, topics.KV_EVENTS, collect)
        assert (
            len(held) == 10
            and len(chunks) > 1
            and [chunk.chunk for chunk in chunks] == list(range(len(chunks)))
        )
        assert {p.block_hash for chunk in chunks for p in chunk.placements} == held
        assert all(
            {p.block_hash for p in chunk.placements} == {b.block_hash for b in chunk.blocks}
            for chunk in chunks
        )
    finally:
        await publisher.stop()
        await engine.stop()


def largest_provenance_keys(
    num_blocks: int, namespace: str | None = None, block_size: int = 16
) -> list[BlockKey]:
    """Blocks whose provenance is as large as the contract allows: 256 auth scopes and 256 documents of 256 characters
    (and a namespace of 256 unless one is given)."""
    name = "\u00e9" * schema.MAX_ID_CHARS
    scopes = tuple(
        (f"{name[:-4]}{j:04d}", schema.MAX_SAFE_INT) for j in range(schema.MAX_LIST_ITEMS)
    )
    documents = tuple(
        f"{name[:-4]}{j:04d}@{schema.MAX_DOCUMENT_VERSION}" for j in range(schema.MAX_LIST_ITEMS)
    )
    provenance = CacheProvenance(
        namespace or name, name, CacheScope.USER, scopes, "alice", documents, 0.0
    )
    return [
        BlockKey(bytes([i]) * 32, bytes([i + 1]) * 32, i, block_size, provenance)
        for i in range(num_blocks)
    ]


async def test_an_event_that_cannot_be_built_is_dead_lettered_locally_and_later_events_flow_gap_free(
    tiny_model_dir, tmp_path, kafka_bootstrap
):
    node_id = f"pub-{uuid.uuid4().hex[:6]}"
    engine = AsyncEngine.from_settings(
        NodeSettings(model_dir=tiny_model_dir, data_dir=tmp_path / "node")
    )
    publisher = NodePublisher(
        engine,
        KafkaSettings(bootstrap=kafka_bootstrap),
        node_id,
        SUBJECT_KEY.encode(),
        signer=EnvelopeSigner(node_key(node_id)),
    )
    await publisher.start(tmp_path / "node")
    principal = Principal("acme", "alice", frozenset({"hr"}))
    token_ids = list(range(3 * 16 + 1))

    def keys_of(doc_id: str):
        document = DocumentRef(doc_id, 1, "hr")
        return compute_block_keys(
            "ns-publisher",
            token_ids,
            [Segment(0, len(token_ids), CacheScope.TENANT, document)],
            principal,
            16,
        )

    good, poisoned, later = keys_of("handbook"), keys_of("hand\nbook"), keys_of("policy")
    dead_letters = engine.metrics.dead_letters
    try:
        first_seq = publisher.seq
        # One stored run mixing valid and refused provenance, a snapshot the contract refuses, then
        # more.
        publisher.on_pool_events(
            [StoredInPool(key, Tier.HOST) for key in good[:2] + poisoned[:1] + good[2:]]
        )
        publisher.on_snapshot_written("snap\nbad", [(1).to_bytes(32, "big")])
        publisher.on_pool_events(
            [RemovedFromPool(good[0].block_hash, Tier.HOST, RemovalReason.EVICTED)]
        )
        await publisher.flush()
        publisher.on_pool_events([StoredInPool(key, Tier.DISK) for key in later])
        await publisher.flush()

        assert dead_letters.labels(type="BlockStored", cause="invalid")._value.get() == 1
        assert dead_letters.labels(type="SnapshotWritten", cause="invalid")._value.get() == 1
        assert (
            publisher.seq == first_seq + 3
        )  # stored, removed, stored: the refused ones took no seq

        mine: list = []

        def collect(record) -> bool:
            payload = schema.parse_event(record.value).payload
            if (
                isinstance(payload, schema.NodeEvent)
                and payload.node_id == node_id
                and payload.seq > first_seq
            ):
                mine.append(payload)
            return len(mine) == 3

        await scan_topic(kafka_bootstrap, topics.KV_EVENTS, collect)
        assert [(type(p).__name__, p.seq) for p in mine] == [
            ("BlockStored", first_seq + 1),
            ("BlockRemoved", first_seq + 2),
            ("BlockStored", first_seq + 3),
        ]
        assert [b.block_hash for b in mine[0].blocks] == [key.block_hash.hex() for key in good]
        assert [b.block_hash for b in mine[2].blocks] == [key.block_hash.hex() for key in later]

        letters: list[DeadLetter] = []

        def collect_letters(record) -> bool:
            letter = DeadLetter.model_validate_json(record.value)
            if letter.raw_key() == node_id.encode():
                letters.append(letter)
            return len(letters) == 2

        await scan_topic(kafka_bootstrap, topics.NODE_DEAD_LETTER, collect_letters)
        assert [
            (letter.topic, letter.partition, letter.offset, letter.value_b64) for letter in letters
        ] == [(topics.KV_EVENTS, -1, -1, None)] * 2
        assert letters[0].error.startswith(
            f"BlockStored from node {node_id} never sent (invalid): "
        )
        assert "control characters" in letters[0].error and "hand" not in letters[0].error
        assert letters[1].error.startswith(
            f"SnapshotWritten from node {node_id} never sent (invalid): snapshot_id"
        )
    finally:
        await publisher.stop()
        await engine.stop()


async def test_an_ambiguous_send_failure_resends_identical_bytes(
    tiny_model_dir, tmp_path, kafka_bootstrap
):
    """A send whose outcome is unknown keeps its seq *and* its bytes: the retry cannot carry different content."""
    node_id = f"pub-{uuid.uuid4().hex[:6]}"
    engine = AsyncEngine.from_settings(
        NodeSettings(model_dir=tiny_model_dir, data_dir=tmp_path / "node")
    )
    publisher = NodePublisher(
        engine,
        KafkaSettings(bootstrap=kafka_bootstrap),
        node_id,
        SUBJECT_KEY.encode(),
        signer=EnvelopeSigner(node_key(node_id)),
    )
    await publisher.start(tmp_path / "node")
    keys = compute_block_keys(
        "ns-publisher",
        list(range(33)),
        [Segment(0, 33, CacheScope.PUBLIC)],
        Principal("acme", "bob"),
        16,
    )
    try:
        first_seq = publisher.seq
        await publisher._producer.stop()  # every send now fails without reaching the broker
        publisher.on_pool_events([StoredInPool(key, Tier.DEVICE) for key in keys])
        with pytest.raises(KafkaError):
            await publisher.flush()
        (unacked,) = publisher._unacked
        assert publisher.seq == first_seq
        publisher._producer = EventProducer(publisher.kafka)
        await publisher._producer.start()
        await publisher.flush()
        assert publisher.seq == first_seq + 1 and publisher._unacked == []

        values: list[bytes] = []

        def collect(record) -> bool:
            payload = schema.parse_event(record.value).payload
            if isinstance(payload, schema.BlockStored) and payload.node_id == node_id:
                values.append(record.value)
            return len(values) == 1

        await scan_topic(kafka_bootstrap, topics.KV_EVENTS, collect)
        assert values == [unacked.value]
    finally:
        await publisher.stop()
        await engine.stop()


async def test_an_inventory_follows_every_event_of_the_state_it_shows(
    tiny_model_dir, tmp_path, kafka_bootstrap
):
    """A step changes the pool on the model worker and its events are drained on the event loop just
    after. An inventory read in between showed changes whose records came after it (the soak's final
    check found the ledger "stale" by exactly those moves). The inventory takes the pool's undrained
    events with the state, and publishes them first: every block it lists was reported by a record
    with a lower seq."""
    node_id = f"pub-{uuid.uuid4().hex[:6]}"
    engine = AsyncEngine.from_settings(
        NodeSettings(model_dir=tiny_model_dir, data_dir=tmp_path / "node")
    )
    publisher = NodePublisher(
        engine,
        KafkaSettings(bootstrap=kafka_bootstrap),
        node_id,
        SUBJECT_KEY.encode(),
        signer=EnvelopeSigner(node_key(node_id)),
    )
    engine.manager.subscribe(
        KV_EVENTS_SUBSCRIBER, publisher.on_pool_events
    )  # as gpu_node.entrypoints.server.make_publisher does
    await publisher.start(tmp_path / "node")
    pool, spec = engine.pool, engine.runner.kv_spec
    token_ids = list(range(2 * spec.block_size + 1))
    keys = compute_block_keys(
        engine.namespace.namespace,
        token_ids,
        [Segment(0, len(token_ids), CacheScope.PUBLIC)],
        Principal("acme", "bob"),
        spec.block_size,
    )
    try:
        for key in keys:  # as a step does: in the pool, its events not drained yet
            assert pool.commit_build(
                pool.begin_build(key), torch.zeros(spec.block_shape, dtype=spec.dtype)
            )
        request_id = uuid.uuid4()
        await publisher.publish_inventory(request_id)
        stored: dict[str, int] = {}
        inventory: list[schema.Inventory] = []

        def collect(record) -> bool:
            payload = schema.parse_event(record.value).payload
            if getattr(payload, "node_id", None) == node_id:
                if isinstance(payload, schema.BlockStored):
                    stored.update((block.block_hash, payload.seq) for block in payload.blocks)
                elif isinstance(payload, schema.Inventory) and payload.request_id == request_id:
                    inventory.append(payload)
            return bool(inventory)

        await scan_topic(kafka_bootstrap, topics.KV_EVENTS, collect)
        [listed] = inventory
        assert sorted(placement.block_hash for placement in listed.placements) == sorted(
            key.block_hash.hex() for key in keys
        )
        assert all(stored.get(key.block_hash.hex(), listed.seq) < listed.seq for key in keys), (
            stored,
            listed.seq,
        )
    finally:
        await publisher.stop()
        await engine.stop()
