"""Replay republishes only dead letters the coordinator wrote: planted, node-signed and tampered
letters are refused.

Replay publishes a letter's bytes to its source topic with the coordinator's credentials. Anyone who
could write ``kvledger.dead-letter`` (every node principal did, nodes dead-lettered bad commands
there) could plant a letter naming any topic and bytes — e.g. an erasure of another tenant's subject
— and have an operator replay it. Now the coordinator signs its letters with its command key, replay
verifies that signature, and nodes write ``kvledger.node-dead-letter``, which replay never reads.

Real Postgres, the session's broker, the coordinator's consumers in-process and its app over ASGI.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import httpx
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from helpers.ledger import (
    RunningConsumers,
    eventually,
    node_key,
    operator_headers,
    running_consumers,
    settings_at_topic_ends,
)

from coordinator.settings import CoordinatorSettings
from events import schema
from events.codec import DeadLetter, encode_event
from events.topics import DEAD_LETTER, DOCUMENTS, ERASURES, NODE_DEAD_LETTER
from identity.signing import sign_dead_letter

ADMIN = operator_headers("platform-admin")


@pytest.fixture(scope="module")
async def settings(ledger_url: str, kafka_bootstrap: str) -> CoordinatorSettings:
    return await settings_at_topic_ends(ledger_url, kafka_bootstrap)


@pytest.fixture(scope="module")
async def consumers(settings: CoordinatorSettings) -> AsyncIterator[RunningConsumers]:
    async with running_consumers(settings) as running:
        yield running


def victim_erasure(marker: str) -> bytes:
    """What an attacker wants replayed: an erasure of another tenant's subject."""
    return encode_event(
        schema.make_event(
            schema.ErasureRequested(subject_id=f"victim-{marker}", reason="planted"),
            tenant_id="victim",
        )
    )


def planted(marker: str, value: bytes) -> DeadLetter:
    return DeadLetter.of(
        topic=ERASURES,
        partition=0,
        offset=0,
        timestamp_ms=None,
        key=f"victim:victim-{marker}".encode(),
        value=value,
        error="safe to replay",
        group_id="kvledger-coordinator-invalidations",
    )


async def erasures_end(bootstrap: str) -> dict[TopicPartition, int]:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False
    )
    await consumer.start()
    try:
        await consumer.topics()
        partitions = [
            TopicPartition(ERASURES, p)
            for p in sorted(consumer.partitions_for_topic(ERASURES) or ())
        ]
        return await consumer.end_offsets(partitions)
    finally:
        await consumer.stop()


async def listed(client: httpx.AsyncClient, since: str) -> list[dict]:
    response = await client.get(
        "/v1/dead-letters", params={"since": since, "limit": 1000}, headers=ADMIN
    )
    assert response.status_code == 200, response.text
    return response.json()["dead_letters"]


async def test_planted_node_signed_and_tampered_letters_are_untrusted_and_never_replayed_a_genuine_one_is(
    consumers: RunningConsumers,
    client: httpx.AsyncClient,
    settings: CoordinatorSettings,
    kafka_bootstrap: str,
) -> None:
    since = datetime.now(UTC).isoformat()
    marker = uuid.uuid4().hex
    poison = b'{"genuine poison": "' + marker.encode() + b'"}'
    erasure = victim_erasure(marker)
    raw = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await raw.start()
    try:
        # A genuine letter: the coordinator's consumers refuse a malformed record.
        await raw.send_and_wait(DOCUMENTS, poison, key=b"acme:doc")

        async def genuine() -> list[dict]:
            digest = hashlib.sha256(poison).hexdigest()
            return [
                letter for letter in await listed(client, since) if letter["value_sha256"] == digest
            ]

        await eventually(genuine, what="the coordinator's own dead letter listed")
        (real,) = await genuine()
        assert real["trusted"] and real["signature"] == "verified" and real["replayable"]
        # Copy the genuine letter's signature onto a different record: tampered.
        partition, offset = (int(part) for part in real["id"].split("-"))
        consumer = AIOKafkaConsumer(
            bootstrap_servers=kafka_bootstrap, group_id=None, enable_auto_commit=False
        )
        await consumer.start()
        try:
            tp = TopicPartition(DEAD_LETTER, partition)
            consumer.assign([tp])
            consumer.seek(tp, offset)
            record = (await consumer.getone()).value
        finally:
            await consumer.stop()
        signed = DeadLetter.model_validate_json(record)
        tampered = planted(marker, erasure).model_copy(update={"signature": signed.signature})
        by_node = sign_dead_letter(
            planted(marker, erasure), node_key("node-0")
        )  # a node principal signing with its own key
        for letter in (planted(marker, erasure), by_node, tampered):
            await raw.send_and_wait(DEAD_LETTER, letter.encode(), key=letter.raw_key())
    finally:
        await raw.stop()

    victim_digest = hashlib.sha256(erasure).hexdigest()

    async def forged() -> list[dict]:
        return [
            letter
            for letter in await listed(client, since)
            if letter["value_sha256"] == victim_digest
        ]

    await eventually(lambda: _count(forged, 3), what="the three planted letters listed")
    letters = await forged()
    assert sorted(letter["signature"] for letter in letters) == [
        "bad_signature",
        "unknown_key",
        "unsigned",
    ]
    assert not any(letter["trusted"] or letter["replayable"] for letter in letters)

    end_before = await erasures_end(kafka_bootstrap)
    for letter in letters:
        refused = await client.post(f"/v1/dead-letters/{letter['id']}/replay", headers=ADMIN)
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert error["code"] == "untrusted_dead_letter" and letter["signature"] in error["message"]
    assert await erasures_end(kafka_bootstrap) == end_before  # nothing reached kvledger.erasures

    replayed = await client.post(f"/v1/dead-letters/{real['id']}/replay", headers=ADMIN)
    assert replayed.status_code == 200, replayed.text
    assert replayed.json()["topic"] == DOCUMENTS


async def _count(probe, num_letters: int) -> bool:
    return len(await probe()) >= num_letters


async def test_a_nodes_letter_is_listed_as_the_nodes_and_never_replayed(
    client: httpx.AsyncClient, kafka_bootstrap: str
) -> None:
    since = datetime.now(UTC).isoformat()
    marker = uuid.uuid4().hex
    letter = planted(marker, victim_erasure(marker))
    raw = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await raw.start()
    try:
        await raw.send_and_wait(NODE_DEAD_LETTER, letter.encode(), key=letter.raw_key())
    finally:
        await raw.stop()

    async def listed_node_letters() -> list[dict]:
        return [
            each
            for each in await listed(client, since)
            if each["value_sha256"] == letter.value_sha256
        ]

    await eventually(lambda: _count(listed_node_letters, 1), what="the node's letter listed")
    (found,) = await listed_node_letters()
    assert (
        found["source"] == "node"
        and found["id"].startswith("node-")
        and not found["trusted"]
        and not found["replayable"]
    )
    refused = await client.post(f"/v1/dead-letters/{found['id']}/replay", headers=ADMIN)
    assert (refused.status_code, refused.json()["error"]["code"]) == (409, "not_replayable")
