"""Property: whatever the event contract accepts, Postgres stores and returns unchanged.

Values are generated from the contract's bounded types — identifiers of any Unicode except control
characters and surrogates, up to the length limit; counts up to 2^53-1 (document versions 2^53-2);
token offsets up to 2^31-1 — wrapped in the contract's models, and ingested by the coordinator's
real handlers (kv-events ingest, decisions, erasures) into a migrated database. Every row then holds
exactly the values sent. A value the contract accepts but the database refuses would stall a
consumer, so this is the property that keeps "bounded input" honest."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

from helpers.ledger import SUBJECT_KEY, fresh_database, sign_command
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select, text

from coordinator.audit.audit_log import ReceiptKeys
from coordinator.handlers.erasure import ErasureService
from coordinator.handlers.ingest import LedgerIngest
from coordinator.handlers.invalidation import InvalidationHandler
from coordinator.ledger.db import Database
from coordinator.ledger.models import (
    Base,
    Block,
    BlockAuthScope,
    BlockCreator,
    BlockDocument,
    Document,
    Erasure,
    Node,
    Policy,
    Snapshot,
)
from coordinator.settings import DatabaseSettings
from events.kafka.consumer import ConsumedEvent
from events.schema import (
    MAX_DOCUMENT_VERSION,
    MAX_ID_CHARS,
    MAX_INT32,
    MAX_REASON_CHARS,
    MAX_SAFE_INT,
    BlockStored,
    DocumentUpdated,
    ErasureRequested,
    NodeStarted,
    PermissionRevoked,
    SnapshotWritten,
    StoredBlock,
    make_event,
    subject_digest,
)
from events.topics import DOCUMENTS, ERASURES, KV_EVENTS, PERMISSIONS

# Unicode category Cc is exactly C0, DEL and C1; Cs the surrogates.
_ID_CHARS = st.characters(exclude_categories=("Cc", "Cs"))
# Blank values (only whitespace) are refused by the contract, so they are no input here.
IDS = st.one_of(
    st.text(_ID_CHARS, min_size=1, max_size=MAX_ID_CHARS),
    st.text(_ID_CHARS, min_size=MAX_ID_CHARS, max_size=MAX_ID_CHARS),
).filter(str.strip)
COUNTS = st.one_of(st.integers(0, MAX_SAFE_INT), st.just(MAX_SAFE_INT))
DOCUMENT_VERSIONS = st.one_of(st.integers(0, MAX_DOCUMENT_VERSION), st.just(MAX_DOCUMENT_VERSION))
REASONS = st.text(
    st.characters(exclude_categories=("Cc", "Cs")) | st.sampled_from("\t\n"),
    min_size=1,
    max_size=MAX_REASON_CHARS,
).filter(str.strip)


@st.composite
def ledger_cases(draw) -> dict:
    return {
        "node_id": draw(IDS),
        "epoch": draw(COUNTS),
        "namespace": draw(IDS),
        "tenant_id": draw(IDS),
        "auth_scope": draw(IDS),
        "policy_version": draw(COUNTS),
        "doc_id": draw(IDS),
        "doc_version": draw(DOCUMENT_VERSIONS),
        "token_offset": draw(st.one_of(st.integers(0, MAX_INT32), st.just(MAX_INT32))),
        "snapshot_id": draw(IDS),
        "subject_id": draw(IDS),
        "reason": draw(REASONS),
    }


def _consumed(topic: str, envelope) -> ConsumedEvent:
    return ConsumedEvent(
        topic=topic, partition=0, offset=0, key=None, timestamp_ms=0, envelope=envelope
    )


async def _round_trip(
    database: Database, ingest: LedgerIngest, decisions: InvalidationHandler, case: dict
) -> None:
    tables = ", ".join(table.name for table in Base.metadata.sorted_tables)
    async with database.session() as session, session.begin():
        await session.execute(text(f"TRUNCATE {tables} CASCADE"))
    block_hash = uuid.uuid4().hex * 2
    node = {"node_id": case["node_id"], "epoch": case["epoch"]}
    block = StoredBlock(
        block_hash=block_hash,
        parent_hash=None,
        namespace=case["namespace"],
        tenant_id=case["tenant_id"],
        scope="tenant",
        auth_scopes=[(case["auth_scope"], case["policy_version"])],
        subject_id=None,
        documents=[f"{case['doc_id']}@{case['doc_version']}"],
        token_offset=case["token_offset"],
        created_at=datetime(2026, 12, 1, tzinfo=UTC),
        tier="disk",
        creator_subject_id=subject_digest(
            SUBJECT_KEY.encode(), case["tenant_id"], case["subject_id"]
        ),
    )
    await ingest(
        [
            _consumed(
                KV_EVENTS, make_event(NodeStarted(**node, seq=0, namespace=case["namespace"]))
            ),
            _consumed(KV_EVENTS, make_event(BlockStored(**node, seq=1, blocks=[block]))),
            _consumed(
                KV_EVENTS,
                make_event(
                    SnapshotWritten(
                        **node, seq=2, snapshot_id=case["snapshot_id"], block_hashes=[block_hash]
                    )
                ),
            ),
        ]
    )
    tenant = case["tenant_id"]
    await decisions(
        [
            _consumed(
                DOCUMENTS,
                make_event(
                    DocumentUpdated(doc_id=case["doc_id"], version=case["doc_version"]), tenant
                ),
            ),
            _consumed(
                PERMISSIONS,
                make_event(
                    PermissionRevoked(
                        auth_scope=case["auth_scope"], policy_version=case["policy_version"]
                    ),
                    tenant,
                ),
            ),
            _consumed(
                ERASURES,
                make_event(
                    ErasureRequested(subject_id=case["subject_id"], reason=case["reason"]), tenant
                ),
            ),
        ]
    )
    async with database.session() as session:
        stored_node = await session.get(Node, case["node_id"])
        stored_block = await session.get(Block, bytes.fromhex(block_hash))
        scopes = (
            await session.execute(select(BlockAuthScope.auth_scope, BlockAuthScope.policy_version))
        ).all()
        documents = (
            await session.execute(select(BlockDocument.doc_id, BlockDocument.version))
        ).all()
        creators = (await session.scalars(select(BlockCreator.subject_hash))).all()
        snapshot = await session.get(Snapshot, (case["node_id"], case["snapshot_id"]))
        document = await session.get(Document, (tenant, case["doc_id"]))
        policy = await session.get(Policy, (tenant, case["auth_scope"]))
        erasures = (await session.execute(select(Erasure.tenant_id, Erasure.reason))).all()
    assert (
        stored_node.node_id,
        stored_node.epoch,
        stored_node.last_seq,
        stored_node.namespace,
    ) == (
        case["node_id"],
        case["epoch"],
        2,
        case["namespace"],
    )
    assert (stored_block.namespace, stored_block.tenant_id, stored_block.token_offset) == (
        case["namespace"],
        tenant,
        case["token_offset"],
    )
    assert [tuple(row) for row in scopes] == [(case["auth_scope"], case["policy_version"])]
    assert [tuple(row) for row in documents] == [(case["doc_id"], case["doc_version"])]
    assert [subject_hash.hex() for subject_hash in creators] == [block.creator_subject_id]
    assert (snapshot.snapshot_id, snapshot.epoch, snapshot.num_blocks) == (
        case["snapshot_id"],
        case["epoch"],
        1,
    )
    assert (document.doc_id, document.version) == (case["doc_id"], case["doc_version"])
    assert (policy.auth_scope, policy.policy_version) == (
        case["auth_scope"],
        case["policy_version"],
    )
    assert [tuple(row) for row in erasures] == [(tenant, case["reason"])]


async def test_whatever_the_contract_accepts_postgres_returns_unchanged(
    database_url: str, ledger_template: str
) -> None:
    async with fresh_database(database_url, ledger_template) as url:
        database = Database(DatabaseSettings(url=url))
        ingest = LedgerIngest(database, inventory_retry_s=3600, command_signer=sign_command)
        erasures = ErasureService(
            database,
            subject_key=SUBJECT_KEY.encode(),
            receipt_keys=ReceiptKeys(None, None),
            command_signer=sign_command,
        )
        decisions = InvalidationHandler(database, erasures=erasures, command_signer=sign_command)
        loop = asyncio.get_running_loop()

        # Hypothesis drives a synchronous function: it runs in a worker thread and hands each
        # example to this event loop, where the database engine lives.
        @settings(
            max_examples=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(case=ledger_cases())
        def check(case: dict) -> None:
            asyncio.run_coroutine_threadsafe(
                _round_trip(database, ingest, decisions, case), loop
            ).result(timeout=60)

        try:
            await asyncio.to_thread(check)
        finally:
            await database.dispose()
