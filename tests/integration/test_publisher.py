"""The node publisher against the real broker: large backlogs go out in bounded records, in order."""

from __future__ import annotations

import uuid

from ledger_helpers import SUBJECT_KEY, node_key, scan_topic

from events import schema, topics
from events.kafka import KafkaSettings
from gpu_node.block_pool import BlockStored, Tier
from gpu_node.engine import AsyncEngine
from gpu_node.kv_cache_utils import CacheScope, Principal, Segment, compute_block_keys
from gpu_node.publisher import MAX_BLOCKS_PER_RECORD, NodePublisher
from gpu_node.settings import NodeSettings
from identity.signing import EnvelopeSigner, verify_envelope


async def test_a_backlog_larger_than_one_record_is_split_and_published_in_order(tiny_model_dir, tmp_path, kafka_bootstrap):
    node_id = f"pub-{uuid.uuid4().hex[:6]}"
    engine = AsyncEngine.from_settings(NodeSettings(model_dir=tiny_model_dir, data_dir=tmp_path / "node"))
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
        "ns-publisher", token_ids, [Segment(0, len(token_ids), CacheScope.USER)], Principal("acme", "alice"), 16
    )
    try:
        publisher.on_pool_events([BlockStored(key, Tier.DISK) for key in keys])
        await publisher.flush()
        records: list[schema.BlockStored] = []

        def collect(record) -> bool:
            envelope = schema.parse_event(record.value)
            payload = envelope.payload
            if isinstance(payload, schema.BlockStored) and payload.node_id == node_id:
                assert verify_envelope(envelope, node_key(node_id).public_key()), "every record is signed by the node's key"
                records.append(payload)
            return sum(len(r.blocks) for r in records) == num_blocks

        await scan_topic(kafka_bootstrap, topics.KV_EVENTS, collect)
        assert [len(r.blocks) for r in records] == [MAX_BLOCKS_PER_RECORD, MAX_BLOCKS_PER_RECORD, 500]
        assert [r.seq for r in records] == [records[0].seq, records[0].seq + 1, records[0].seq + 2]
        assert [b.block_hash for r in records for b in r.blocks] == [key.block_hash.hex() for key in keys]
        assert {b.subject_id for r in records for b in r.blocks} == {schema.subject_digest(SUBJECT_KEY.encode(), "acme", "alice")}
    finally:
        await publisher.stop()
        await engine.stop()
