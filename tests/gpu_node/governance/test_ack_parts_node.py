"""A node's ack too large for one record: the real node (engine, pool, command consumer) acks in signed parts.

The node holds 16,000 blocks of one subject in device and host memory: listed in one ack,
their hashes alone are over the producer's ``max_request_size``, so an ack of one record
is refused before it is sent, and re-sending the command never gets it through. The node
cuts it into parts (``events.ack_parts``); each arrives, signed with the node's key and
within :data:`events.record_size.MAX_RECORD_BYTES`, and a re-sent command is answered with
the very same records.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator

import pytest
import torch
from helpers.ledger import SUBJECT_KEY, SigningProducer, node_key, own_broker, scan_topic
from helpers.node import node_settings
from test_node_invalidation import Node, publish

from events import schema, topics
from events.kafka.settings import KafkaSettings
from events.record_size import MAX_RECORD_BYTES
from events.tiers import Tier
from gpu_node.settings import CacheSettings
from identity.signing import verify_envelope
from prefix_keys.blocks import BlockKey, CacheProvenance, CacheScope

NUM_DEVICE_BLOCKS = 8_000
NUM_HOST_BLOCKS = 8_000


@pytest.fixture(scope="module")
async def kafka_bootstrap(
    kafka_bootstrap: str, service_mode: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[str]:
    """This module's own broker: what it publishes is too large to leave on the shared one
    (``helpers.ledger.own_broker``)."""
    async with own_broker(
        kafka_bootstrap, service_mode, tmp_path_factory.mktemp("kafka")
    ) as bootstrap:
        yield bootstrap


def fill(node: Node, tenant: str, subject: str) -> set[tuple[str, str]]:
    """Build the subject's blocks straight into the node's pool; (hash, tier) of each."""
    pool = node.engine.pool
    provenance = CacheProvenance(
        node.engine.namespace.namespace, tenant, CacheScope.USER, (), subject, (), time.time()
    )
    kv = torch.ones(pool.spec.block_shape, dtype=pool.spec.dtype)
    held = set()
    parent = hashlib.sha256(tenant.encode()).digest()
    for i in range(NUM_DEVICE_BLOCKS + NUM_HOST_BLOCKS):
        block_hash = hashlib.sha256(f"{tenant}-{i}".encode()).digest()
        entry = pool.begin_build(BlockKey(block_hash, parent, i, pool.spec.block_size, provenance))
        assert entry is not None and pool.commit_build(entry, kv)
        tier = Tier.HOST if i < NUM_HOST_BLOCKS else Tier.DEVICE
        assert tier is Tier.DEVICE or pool.demote(block_hash, Tier.HOST)
        held.add((block_hash.hex(), tier.value))
        parent = block_hash
    return held


async def ack_records_of(
    bootstrap: str, command_id: uuid.UUID, node_id: str, num_copies: int
) -> list:
    """Every ``kvledger.acks`` record of ``command_id`` by ``node_id`` once each part arrived
    ``num_copies`` times."""
    found: list = []

    def visit(record) -> bool:
        payload = schema.parse_event(record.value).payload
        if (
            isinstance(payload, schema.CommandAck)
            and payload.command_id == command_id
            and payload.node_id == node_id
        ):
            found.append(record)
        counts = Counter(schema.parse_event(r.value).payload.part for r in found)
        parts = schema.parse_event(found[0].value).payload.parts if found else 0
        return (
            bool(found)
            and sorted(counts) == list(range(parts))
            and min(counts.values()) >= num_copies
        )

    await scan_topic(bootstrap, topics.ACKS, visit, timeout_s=120)
    return found


async def test_an_erasure_too_large_for_one_ack_record_is_acked_in_signed_parts(
    tiny_model_dir, tmp_path, kafka_bootstrap
):
    node_id = f"parts-{uuid.uuid4().hex[:6]}"
    cache = CacheSettings(
        num_device_blocks=NUM_DEVICE_BLOCKS + 64,
        num_host_blocks=NUM_HOST_BLOCKS + 64,
        max_disk_blocks=64,
    )
    node = await Node(
        node_settings(node_id, tiny_model_dir, tmp_path / "node", kafka_bootstrap, cache)
    ).start()
    tenant = f"big-{uuid.uuid4().hex[:6]}"
    try:
        held = fill(node, tenant, "alice")
        predicate = schema.SubjectPredicate(
            tenant=tenant, subject_id=schema.subject_digest(SUBJECT_KEY.encode(), tenant, "alice")
        )
        command = await publish(kafka_bootstrap, predicate, tenant)
        records = await ack_records_of(kafka_bootstrap, command.command_id, node_id, 1)
        envelopes = [schema.parse_event(record.value) for record in records]
        assert len(envelopes) >= 2 and len({envelope.payload.ack_id for envelope in envelopes}) == 1
        assert all(len(record.value) <= MAX_RECORD_BYTES for record in records)
        assert all(
            verify_envelope(envelope, node_key(node_id).public_key()) for envelope in envelopes
        )
        listed = [
            (h, item.tier)
            for envelope in envelopes
            for item in envelope.payload.evidence
            for h in item.block_hashes
        ]
        assert len(listed) == len(held) and set(listed) == held
        assert all(item.verified for envelope in envelopes for item in envelope.payload.evidence)
        assert node.holdings(lambda provenance: provenance.tenant_id == tenant) == set()

        # A re-sent command (new record, same command): the node publishes the same parts again,
        # byte for byte.
        await publish_again(kafka_bootstrap, command, tenant)
        again = await ack_records_of(kafka_bootstrap, command.command_id, node_id, 2)
        by_event: dict[str, set[bytes]] = {}
        for record in again:
            by_event.setdefault(str(schema.parse_event(record.value).event_id), set()).add(
                record.value
            )
        assert len(by_event) == len(envelopes) and all(
            len(values) == 1 for values in by_event.values()
        )
        assert Counter(schema.parse_event(record.value).event_id for record in again) == {
            e.event_id: 2 for e in envelopes
        }
    finally:
        await node.stop()


async def publish_again(bootstrap: str, command: schema.Invalidate, tenant: str) -> None:
    """What ``coordinator.handlers.resend`` does: the same command in a new envelope."""
    async with SigningProducer(KafkaSettings(bootstrap=bootstrap)) as producer:
        await producer.send(schema.make_event(command, tenant_id=tenant))
