"""Dead letters end to end: the coordinator's consumers refuse records, ``GET /v1/dead-letters`` lists them
without their content, ``POST /v1/dead-letters/{id}/replay`` re-publishes one to be validated again.

Real Postgres, the session's broker, the coordinator's consumers (``run_consumers``) and its app over ASGI;
``kvledger dead-letters`` as a real process against a real HTTP server.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import httpx
import pytest
from helpers.ledger import (
    OPERATOR_PRIVATE_KEY_PEM,
    RunningConsumers,
    SigningProducer,
    enroll_nodes,
    eventually,
    operator_headers,
    running_consumers,
    settings_at_topic_ends,
    sign_customer_event,
)
from sqlalchemy import select

from coordinator.ledger.db import Database
from coordinator.ledger.models import DeadLetterCount, Invalidation, Node
from coordinator.settings import CoordinatorSettings, kafka_settings
from events import schema
from events.codec import encode_key
from events.kafka.producer import EventProducer
from events.topics import DOCUMENTS, KV_EVENTS, route
from identity.signing import SIGNATURE_ERROR

ADMIN = operator_headers("platform-admin")


@pytest.fixture(scope="module")
async def settings(ledger_url: str, kafka_bootstrap: str) -> CoordinatorSettings:
    return await settings_at_topic_ends(ledger_url, kafka_bootstrap)


@pytest.fixture(scope="module")
async def consumers(settings: CoordinatorSettings) -> AsyncIterator[RunningConsumers]:
    async with running_consumers(settings) as running:
        yield running


async def listed(client: httpx.AsyncClient, **params: str) -> list[dict]:
    response = await client.get("/v1/dead-letters", params=params, headers=ADMIN)
    assert response.status_code == 200, response.text
    assert response.json()["truncated"] is False
    return response.json()["dead_letters"]


async def dead_lettered(database: Database, topic: str) -> int:
    async with database.session() as session:
        return (
            await session.scalar(
                select(DeadLetterCount.num_records).where(DeadLetterCount.topic == topic)
            )
            or 0
        )


async def test_a_poison_record_is_listed_without_its_content_and_a_still_invalid_replay_dead_letters_once_more(
    consumers: RunningConsumers,
    client: httpx.AsyncClient,
    database: Database,
    settings: CoordinatorSettings,
) -> None:
    since = datetime.now(UTC).isoformat()
    marker = uuid.uuid4().hex
    update = sign_customer_event(
        schema.make_event(
            schema.DocumentUpdated(doc_id=f"doc-{marker}", version=2), tenant_id="acme"
        )
    )
    _, key = route(update)
    poison = b'{"not an envelope": "' + marker.encode() + b'"'
    digest = hashlib.sha256(poison).hexdigest()
    async with EventProducer(kafka_settings(settings)) as producer:
        written = await producer.send_raw(DOCUMENTS, poison, encode_key(key))

        async def poison_listed() -> bool:
            return any(
                letter["value_sha256"] == digest
                for letter in await listed(client, topic=DOCUMENTS, since=since)
            )

        await eventually(poison_listed, what="the poison record on the dead-letter list")
        (letter,) = [
            letter
            for letter in await listed(client, topic=DOCUMENTS, since=since)
            if letter["value_sha256"] == digest
        ]
        assert (letter["topic"], letter["partition"], letter["offset"]) == (
            DOCUMENTS,
            written.partition,
            written.offset,
        )
        assert (
            letter["num_value_bytes"] == len(poison)
            and letter["group_id"] == f"{settings.kafka.group_id}-invalidations"
        )
        assert letter["reason"] and marker not in json.dumps(
            letter
        )  # where and why, never the content
        assert [
            found["id"]
            for found in await listed(client, reason=letter["reason"][:20].upper(), since=since)
        ].count(letter["id"]) == 1
        await eventually(lambda: _at_least(database, DOCUMENTS, 1), what="the dead-letter tally")
        counted_before = await dead_lettered(database, DOCUMENTS)

        replayed = await client.post(f"/v1/dead-letters/{letter['id']}/replay", headers=ADMIN)
        assert replayed.status_code == 200, replayed.text
        assert (
            replayed.json()["topic"] == DOCUMENTS
            and replayed.json()["partition"] == written.partition
        )
        # A valid event on the same partition after the replay: once it is decided, the replay was
        # handled.
        await producer.send(update)

    async def decided() -> bool:
        async with database.session() as session:
            return (
                await session.scalar(
                    select(Invalidation.command_id).where(
                        Invalidation.source_event_id == update.event_id
                    )
                )
                is not None
            )

    await eventually(decided, what="the update after the replay")
    copies = [
        found
        for found in await listed(client, topic=DOCUMENTS, since=since)
        if found["value_sha256"] == digest
    ]
    assert [copy["offset"] for copy in copies] == [written.offset, replayed.json()["offset"]]
    await eventually(
        lambda: _at_least(database, DOCUMENTS, counted_before + 1),
        what="the replay's dead letter counted",
    )
    assert await dead_lettered(database, DOCUMENTS) == counted_before + 1


async def _at_least(database: Database, topic: str, num_records: int) -> bool:
    return await dead_lettered(database, topic) >= num_records


async def test_a_record_refused_for_a_reason_since_fixed_is_applied_when_replayed(
    consumers: RunningConsumers,
    client: httpx.AsyncClient,
    database: Database,
    settings: CoordinatorSettings,
) -> None:
    since = datetime.now(UTC).isoformat()
    node_id = f"dl-node-{uuid.uuid4().hex[:6]}"
    started = schema.make_event(
        schema.NodeStarted(node_id=node_id, epoch=1, seq=0, namespace="ns-test")
    )
    async with SigningProducer(
        kafka_settings(settings)
    ) as unenrolled:  # signs with the node's key, enrolls nothing
        await unenrolled.send(started)

    async def refused() -> list[dict]:
        return [
            letter
            for letter in await listed(client, topic=KV_EVENTS, since=since)
            if letter["reason"].startswith(SIGNATURE_ERROR)
        ]

    await eventually(lambda: _some(refused), what="the unenrolled node's record dead-lettered")
    (letter,) = await refused()
    await enroll_nodes(settings.database.url.get_secret_value(), [node_id])
    replayed = await client.post(f"/v1/dead-letters/{letter['id']}/replay", headers=ADMIN)
    assert replayed.status_code == 200, replayed.text

    async def applied() -> bool:
        async with database.session() as session:
            return await session.scalar(select(Node.epoch).where(Node.node_id == node_id)) == 1

    await eventually(applied, what="the replayed NodeStarted applied")
    assert len(await refused()) == 1


async def _some(probe) -> bool:
    return bool(await probe())


async def test_only_platform_admins_read_or_replay_and_bad_ids_are_refused(
    client: httpx.AsyncClient,
) -> None:
    officer = operator_headers("privacy-officer", "acme")
    assert (await client.get("/v1/dead-letters", headers=officer)).status_code == 403
    assert (await client.post("/v1/dead-letters/0-0/replay", headers=officer)).status_code == 403
    assert (await client.get("/v1/dead-letters")).status_code == 401
    bad = await client.post("/v1/dead-letters/0-x/replay", headers=ADMIN)
    assert (bad.status_code, bad.json()["error"]["code"]) == (400, "invalid_parameter")
    missing = await client.post(f"/v1/dead-letters/0-{10**15}/replay", headers=ADMIN)
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "dead_letter_not_found")
    naive = await client.get(
        "/v1/dead-letters", params={"since": "2026-01-01T00:00:00"}, headers=ADMIN
    )
    assert (naive.status_code, naive.json()["error"]["code"]) == (400, "invalid_parameter")


async def test_the_cli_lists_and_replays(
    client: httpx.AsyncClient, settings: CoordinatorSettings, tmp_path, consumers: RunningConsumers
) -> None:
    """``kvledger dead-letters`` against the coordinator over real HTTP, with the stack's operator
    key."""
    import uvicorn

    from coordinator.api.app import create_app

    (tmp_path / "operator_key.pem").write_bytes(OPERATOR_PRIVATE_KEY_PEM)
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=0, log_level="warning")
    )
    serving = asyncio.create_task(server.serve())
    try:
        await eventually(_started(server), what="the API server")
        port = server.servers[0].sockets[0].getsockname()[1]
        (tmp_path / "stack.json").write_text(
            json.dumps(
                {
                    "coordinator_url": f"http://127.0.0.1:{port}",
                    "operator_private_key_file": str(tmp_path / "operator_key.pem"),
                }
            )
        )
        listing = await _kvledger(
            "dead-letters",
            "list",
            "--topic",
            DOCUMENTS,
            "--since",
            "1h",
            "--json",
            "--stack",
            str(tmp_path),
        )
        first = json.loads(listing)["dead_letters"][0]
        assert set(first) == {
            "id", "source", "topic", "partition", "offset", "reason", "group_id", "num_value_bytes", "value_sha256", "by_reference",
            "signature", "trusted", "replayable", "record_time", "dead_lettered_at",
        }  # fmt: skip
        assert (
            first["trusted"]
            and first["signature"] == "verified"
            and first["source"] == "coordinator"
        )
        out = await _kvledger("dead-letters", "replay", first["id"], "--stack", str(tmp_path))
        assert out.startswith(
            f"dead letter {first['id']} replayed to {DOCUMENTS}[{first['partition']}]@"
        )
    finally:
        server.should_exit = True
        await serving


def _started(server) -> object:
    async def probe() -> bool:
        return server.started

    return probe


async def _kvledger(*args: str) -> str:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvledger.cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    return out.decode()
