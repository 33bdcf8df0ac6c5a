"""Record size limits (``events.record_size``) and ack parts (``events.ack_parts``) at the exact
boundary.

The limit is the producer's own check: a record value of :data:`MAX_RECORD_BYTES` under the
longest key goes through a real producer to the real broker and back; one byte more is
refused before it is sent. The splitter's runs fit exactly at the boundary, and the
largest record each writer produces — an ack part, a block event of the largest
provenance the contract allows — is within the limit and as full as it can be.
"""

from __future__ import annotations

import hashlib
import random
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest
from aiokafka.errors import MessageSizeTooLargeError
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from helpers.ledger import own_broker, scan_topic
from pydantic import ValidationError

from events.ack_parts import TierReport, ack_parts, merge_evidence
from events.codec import encode_event
from events.kafka.admin import ensure_topics
from events.kafka.producer import EventProducer
from events.kafka.settings import KafkaSettings
from events.record_size import (
    MAX_KEY_BYTES,
    MAX_RECORD_BYTES,
    MAX_REQUEST_BYTES,
    envelope_bytes,
    request_bytes,
    split_to_fit,
)
from events.schema import (
    MAX_ACK_PARTS,
    MAX_BLOCKS_PER_EVENT,
    MAX_HASHES_PER_EVENT,
    MAX_ID_CHARS,
    MAX_LIST_ITEMS,
    MAX_SAFE_INT,
    BlockStored,
    CommandAck,
    StoredBlock,
    make_event,
)
from events.tiers import Tier
from events.topics import ACKS
from identity.signing import EnvelopeSigner

SIGN = EnvelopeSigner(Ed25519PrivateKey.generate())


def signed_bytes_of(payload) -> int:
    """The length of ``payload``'s record as a writer sends it: stamped now, signed, encoded."""
    return len(encode_event(SIGN(make_event(payload))))


@pytest.fixture(scope="module")
async def kafka_bootstrap(
    kafka_bootstrap: str, service_mode: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[str]:
    """This module's own broker: a megabyte of non-JSON on ``kvledger.acks`` would be dead-lettered by every later
    module's coordinator on the shared one (``helpers.ledger.own_broker``)."""
    async with own_broker(
        kafka_bootstrap, service_mode, tmp_path_factory.mktemp("kafka")
    ) as bootstrap:
        yield bootstrap


# --------------------------------------------------------------------------- the limit itself


def test_the_largest_record_value_passes_the_producers_check_exactly():
    longest_key = bytes(MAX_KEY_BYTES)
    assert request_bytes(longest_key, bytes(MAX_RECORD_BYTES)) <= MAX_REQUEST_BYTES
    assert request_bytes(longest_key, bytes(MAX_RECORD_BYTES + 1)) > MAX_REQUEST_BYTES
    assert MAX_KEY_BYTES == 4 * MAX_ID_CHARS


async def test_a_record_at_the_limit_is_delivered_and_one_byte_more_is_refused(kafka_bootstrap):
    settings = KafkaSettings(bootstrap=kafka_bootstrap)
    await ensure_topics(settings)
    key = (
        "\U0001f511" * MAX_ID_CHARS
    ).encode()  # a node id of 256 four-byte characters: the longest key
    assert len(key) == MAX_KEY_BYTES
    marker = uuid.uuid4().hex.encode()
    value = marker + b"x" * (MAX_RECORD_BYTES - len(marker))
    async with EventProducer(settings) as producer:
        await producer.send_raw(ACKS, value, key)
        with pytest.raises(MessageSizeTooLargeError):
            await producer.send_raw(ACKS, value + b"x", key)
    received = []

    def visit(record) -> bool:
        if record.value is not None and record.value.startswith(marker):
            received.append(record.value)
        return bool(received)

    await scan_topic(kafka_bootstrap, ACKS, visit)
    assert received == [value]


def test_envelope_bytes_is_the_signed_record_at_its_longest():
    payload = CommandAck(command_id=uuid.uuid4(), node_id="n-1", epoch=MAX_SAFE_INT, evidence=[])
    envelope = make_event(payload).model_copy(
        update={"occurred_at": datetime(2026, 12, 3, 10, 0, 0, 123456, tzinfo=UTC)}
    )
    assert envelope_bytes(payload) == len(encode_event(SIGN(envelope)))
    stamped_now = make_event(payload)
    assert len(encode_event(SIGN(stamped_now))) <= envelope_bytes(payload)


# --------------------------------------------------------------------------- the splitter


def sizes_of(items: list[int], overhead: int):
    """A record whose encoding is ``overhead`` bytes plus each item's size plus a comma between
    items."""

    def size_of(run) -> int:
        return overhead + sum(run) + max(len(run) - 1, 0)

    return size_of


def test_a_run_that_fits_exactly_is_one_record_and_one_byte_less_room_splits_it():
    items = [100, 250, 7, 640]
    size_of = sizes_of(items, 40)
    exact = size_of(items)
    assert split_to_fit(items, size_of, max_items=10, max_bytes=exact) == [items]
    assert split_to_fit(items, size_of, max_items=10, max_bytes=exact - 1) == [items[:3], items[3:]]
    assert split_to_fit(items, size_of, max_items=2, max_bytes=exact) == [items[:2], items[2:]]
    assert split_to_fit([], size_of, max_items=2, max_bytes=exact) == []


def test_an_item_larger_than_the_limit_alone_is_a_run_of_its_own_for_the_writer_to_refuse():
    size_of = sizes_of([10, 5000, 10], 0)
    assert split_to_fit([10, 5000, 10], size_of, max_items=10, max_bytes=100) == [
        [10],
        [5000],
        [10],
    ]
    with pytest.raises(ValueError):
        split_to_fit([1], size_of, max_items=0, max_bytes=100)


def test_every_run_is_the_longest_that_fits():
    """Against brute force: random item sizes, limits and caps; the runs are greedy-longest, each
    within both limits."""
    rng = random.Random(7)
    for _ in range(300):
        items = [rng.choice((1, 2, 3, 50, 400, 3000)) for _ in range(rng.randrange(0, 200))]
        size_of = sizes_of(items, rng.randrange(0, 100))
        max_items, max_bytes = rng.randrange(1, 60), rng.randrange(1, 20_000)
        runs = split_to_fit(items, size_of, max_items=max_items, max_bytes=max_bytes)
        assert [item for run in runs for item in run] == items
        start = 0
        for run in runs:
            longest = 1
            while (
                start + longest < len(items)
                and longest < max_items
                and size_of(items[start : start + longest + 1]) <= max_bytes
            ):
                longest += 1
            assert len(run) == longest
            start += len(run)


# --------------------------------------------------------------------------- ack parts


def hashes(count: int, digest=hashlib.sha256, label: str = "b") -> list[str]:
    return [digest(f"{label}-{i}".encode()).hexdigest() for i in range(count)]


def test_an_ack_that_fits_is_one_record_encoded_as_before():
    (single,) = ack_parts(
        uuid.uuid4(),
        "n-1",
        3,
        [TierReport(Tier.DEVICE, hashes(10), "overwrite", "readback_zero", True)],
    )
    assert (single.ack_id, single.part, single.parts) == (None, 0, 1)
    assert set(single.model_dump(mode="json")) == {"command_id", "node_id", "epoch", "evidence"}
    (empty,) = ack_parts(uuid.uuid4(), "n-1", 3, [])
    assert empty.evidence == []


def test_an_ack_of_100k_hashes_is_split_into_parts_that_fit_and_merge_back():
    command_id, node_id = uuid.uuid4(), "\U0001f511" * MAX_ID_CHARS
    listed = hashes(100_000)
    reports = [
        TierReport(Tier.DEVICE, listed[:40_000], "overwrite", "readback_zero", True),
        TierReport(Tier.HOST, listed[40_000:70_000], "overwrite", "readback_zero", True),
        TierReport(
            Tier.DISK,
            listed[70_000:],
            "crypto_erase",
            "key_destroyed",
            True,
            ["k" * MAX_ID_CHARS, "key-2"],
        ),
        TierReport(Tier.SNAPSHOT, [], "unlink", "file_absent", False),
    ]
    parts = ack_parts(command_id, node_id, 7, reports)
    assert len(parts) == -(
        -(100_000 + 2 + 4) // MAX_HASHES_PER_EVENT
    )  # here the count binds, not the bytes
    assert {part.ack_id for part in parts} != {None} and len({part.ack_id for part in parts}) == 1
    assert [(part.part, part.parts) for part in parts] == [
        (i, len(parts)) for i in range(len(parts))
    ]
    assert max(signed_bytes_of(part) for part in parts) <= MAX_RECORD_BYTES
    merged = merge_evidence(
        [item.model_dump(mode="json") for item in part.evidence] for part in parts
    )
    assert [
        (m["tier"], m["block_hashes"], m["removed"], m["key_ids"], m["verified"]) for m in merged
    ] == [(r.tier, r.block_hashes, r.removed, r.key_ids, r.verified) for r in reports]


def test_when_the_bytes_bind_every_part_is_as_full_as_the_limit_allows():
    """64-byte digests (128 hex characters): 12,000 would be 1.6 MB, so parts are cut by size, each
    within one hash of the limit."""
    listed = hashes(30_000, hashlib.sha512)
    parts = ack_parts(
        uuid.uuid4(),
        "n-1",
        1,
        [TierReport(Tier.DEVICE, listed, "overwrite", "readback_zero", True)],
    )
    sizes = [signed_bytes_of(part) for part in parts]
    assert max(sizes) <= MAX_RECORD_BYTES
    one_more = len(listed[0]) + 3  # quotes and a comma
    assert all(
        size > MAX_RECORD_BYTES - one_more - 4 for size in sizes[:-1]
    )  # part numbers measured at their longest
    assert [h for part in parts for h in part.evidence[0].block_hashes] == listed


def test_parts_disagreeing_on_a_tiers_method_do_not_merge_into_verified_evidence():
    first = {
        "tier": "disk",
        "removed": 1,
        "block_hashes": ["aa" * 32],
        "method": "crypto_erase",
        "post_check": "key_destroyed",
    }
    second = {**first, "block_hashes": ["bb" * 32], "method": "unlink", "post_check": "file_absent"}
    (merged,) = merge_evidence(
        [
            [{**first, "verified": True, "key_ids": ["k"]}],
            [{**second, "verified": True, "key_ids": ["k"]}],
        ]
    )
    assert (merged["removed"], merged["key_ids"], merged["verified"]) == (2, ["k"], False)


def test_the_contract_bounds_the_part_fields():
    base = {"command_id": uuid.uuid4(), "node_id": "n", "epoch": 1, "evidence": []}
    with pytest.raises(ValidationError):
        CommandAck(**base, ack_id=uuid.uuid4(), part=2, parts=2)
    with pytest.raises(ValidationError):
        CommandAck(**base, part=0, parts=2)
    with pytest.raises(ValidationError):
        CommandAck(**base, ack_id=uuid.uuid4(), part=0, parts=MAX_ACK_PARTS + 1)
    with pytest.raises(ValueError, match="parts"):
        ack_parts(
            uuid.uuid4(),
            "n",
            1,
            [TierReport(Tier.DEVICE, hashes(3_000), "overwrite", "readback_zero", True)],
            max_bytes=2_000,
        )


# --------------------------------------------------------------------------- block events


def largest_block(i: int) -> StoredBlock:
    """A block whose provenance is as large as the contract allows: 256 auth scopes and 256 documents of the longest names."""
    name = "\u00e9" * MAX_ID_CHARS  # two UTF-8 bytes a character
    return StoredBlock(
        block_hash=hashlib.sha512(str(i).encode()).hexdigest(),
        parent_hash=hashlib.sha512(str(i - 1).encode()).hexdigest(),
        namespace=name,
        tenant_id=name,
        scope="user",
        auth_scopes=[(f"{name[:-4]}{j:04d}", MAX_SAFE_INT) for j in range(MAX_LIST_ITEMS)],
        subject_id="ab" * 32,
        documents=[f"{name[:-4]}{j:04d}@{MAX_SAFE_INT - 1}" for j in range(MAX_LIST_ITEMS)],
        token_offset=i,
        created_at=datetime(2026, 12, 3, tzinfo=UTC),
        tier="device",
    )


def test_block_events_of_the_largest_provenance_are_cut_to_fit():
    """1000 such blocks are hundreds of MB as one record; cut by size, each record is as full as the
    limit allows."""
    blocks = [largest_block(i) for i in range(12)]
    fields = {"node_id": "n" * MAX_ID_CHARS, "epoch": MAX_SAFE_INT, "seq": 0}

    def size_of(run) -> int:
        return envelope_bytes(BlockStored.model_construct(**fields, blocks=list(run)))

    runs = split_to_fit(blocks, size_of, max_items=MAX_BLOCKS_PER_EVENT)
    assert len(runs) > 1 and [block for run in runs for block in run] == blocks
    assert all(
        signed_bytes_of(BlockStored(**fields, blocks=list(run))) <= MAX_RECORD_BYTES for run in runs
    )
    start = 0
    for run in runs[:-1]:
        start += len(run)
        assert size_of([*run, blocks[start]]) > MAX_RECORD_BYTES
