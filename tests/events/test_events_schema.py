"""The event contract: exact round trips for every type, and every malformed input rejected the same
way."""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
import rfc8785
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import ValidationError

from events import schema, topics
from events.codec import DeadLetter, decode_event, decode_key, encode_event, encode_key
from events.schema import (
    EVENT_TYPES,
    MAX_BLOCKS_PER_EVENT,
    MAX_ID_CHARS,
    BlockMoved,
    BlockProvenance,
    BlockRemoved,
    BlockStored,
    CommandAck,
    DocumentDeleted,
    DocumentPredicate,
    DocumentUpdated,
    Envelope,
    ErasureRequested,
    EventValidationError,
    Invalidate,
    Inventory,
    InventoryRequested,
    NamespacePredicate,
    NodeHeartbeat,
    NodeStarted,
    PermissionRevoked,
    Placement,
    PolicyPredicate,
    SnapshotDeleted,
    SnapshotWritten,
    SubjectPredicate,
    TenantPredicate,
    TierEvidence,
    UsageReported,
    make_event,
    parse_event,
    subject_digest,
)
from events.tiers import STORAGE_TIERS, Tier
from identity.signing import sign_envelope, verify_envelope

KEY = b"k" * 32
H1, H2, H3 = "11" * 32, "22" * 32, "33" * 32
SUBJECT = subject_digest(KEY, "acme", "alice")
CREATED = datetime(2026, 11, 29, 12, 0, 0, 123456, tzinfo=UTC)


def provenance(block_hash: str = H1, **overrides) -> dict:
    fields = {
        "block_hash": block_hash,
        "parent_hash": None,
        "namespace": "ns-1",
        "tenant_id": "acme",
        "scope": "tenant",
        "auth_scopes": [("handbook", 3)],
        "subject_id": None,
        "documents": ["doc-1@7"],
        "token_offset": 0,
        "created_at": CREATED,
    }
    fields.update(overrides)
    return fields


NODE = {"node_id": "node-a", "epoch": 2, "seq": 41}

EVENTS: list[tuple[object, str | None]] = [
    (DocumentUpdated(doc_id="doc-1", version=8), "acme"),
    (DocumentDeleted(doc_id="doc-1"), "acme"),
    (PermissionRevoked(auth_scope="handbook", policy_version=4), "acme"),
    (PermissionRevoked(auth_scope="handbook", policy_version=4, subject_id="alice"), "acme"),
    (ErasureRequested(subject_id="alice", reason="GDPR art. 17"), "acme"),
    (ErasureRequested(erasure_id=uuid.uuid4(), subject_id="alice", reason="request"), "acme"),
    (NodeStarted(**NODE, namespace="ns-1"), None),
    (
        BlockStored(
            **NODE,
            blocks=[
                {
                    **provenance(H1, scope="public", tenant_id=None, auth_scopes=[], documents=[]),
                    "tier": "device",
                },
                {**provenance(H2, parent_hash=H1), "tier": "device"},
                {
                    **provenance(
                        H3, parent_hash=H2, scope="user", subject_id=SUBJECT, token_offset=32
                    ),
                    "tier": "host",
                },
            ],
        ),
        None,
    ),
    (BlockRemoved(**NODE, blocks=[{"block_hash": H1, "tier": "disk"}], reason="expired"), None),
    (
        BlockMoved(**NODE, blocks=[{"block_hash": H1, "from_tier": "device", "to_tier": "host"}]),
        None,
    ),
    (SnapshotWritten(**NODE, snapshot_id="snap-1", block_hashes=[H1, H2]), None),
    (SnapshotDeleted(**NODE, snapshot_id="snap-1"), None),
    (
        Inventory(
            **NODE,
            request_id=uuid.uuid4(),
            placements=[
                {"block_hash": H1, "tier": "disk"},
                {"block_hash": H1, "tier": "snapshot", "snapshot_id": "snap-1"},
            ],
            blocks=[provenance(H1)],
        ),
        None,
    ),
    (NodeHeartbeat(node_id="node-a", epoch=2), None),
    (NodeHeartbeat(node_id="node-a", epoch=2, seq=40), None),
    (
        UsageReported(
            **NODE,
            tenant_id="acme",
            window_start=CREATED,
            window_end=CREATED,
            num_requests=3,
            num_prompt_tokens=120,
            num_cached_tokens=96,
            num_output_tokens=12,
        ),
        None,
    ),
    (InventoryRequested(node_id="node-a", request_id=uuid.uuid4()), None),
    (
        CommandAck(
            command_id=uuid.uuid4(),
            node_id="node-a",
            epoch=2,
            evidence=[
                {
                    "tier": "device",
                    "removed": 1,
                    "block_hashes": [H1],
                    "method": "overwrite",
                    "post_check": "readback_zero",
                    "verified": True,
                },
                {
                    "tier": "disk",
                    "removed": 1,
                    "block_hashes": [H2],
                    "method": "crypto_erase",
                    "post_check": "key_destroyed",
                    "verified": True,
                    "key_ids": ["dk-7"],
                },
            ],
        ),
        None,
    ),
]
PREDICATES = [
    DocumentPredicate(tenant="acme", doc_id="doc-1", below_version=8),
    PolicyPredicate(tenant="acme", auth_scope="handbook", below_version=4),
    SubjectPredicate(tenant="acme", subject_id=SUBJECT),
    NamespacePredicate(ns="ns-1"),
    TenantPredicate(tenant="acme"),
]
EVENTS += [
    (Invalidate(command_id=uuid.uuid4(), predicate=p, cutoff=CREATED), None) for p in PREDICATES
]


def test_every_registered_type_is_exercised() -> None:
    assert {type(payload).TYPE for payload, _ in EVENTS} == set(EVENT_TYPES)
    assert set(topics.TOPIC_BY_TYPE) == set(EVENT_TYPES)


@pytest.mark.parametrize(("payload", "tenant"), EVENTS, ids=lambda v: type(v).__name__)
def test_round_trip_is_exact(payload, tenant) -> None:
    envelope = make_event(payload, tenant_id=tenant)
    data = encode_event(envelope)
    decoded = parse_event(data)
    assert decoded == envelope
    assert type(decoded.payload) is type(payload)
    assert encode_event(decoded) == data  # byte-identical re-encoding
    assert b" " not in data.replace(b"GDPR art. 17", b"")  # compact JSON
    raw = json.loads(data)
    assert set(raw) == {"event_id", "type", "schema_version", "occurred_at", "tenant_id", "payload"}
    assert raw["schema_version"] == 1 and raw["type"] == type(payload).TYPE
    assert datetime.fromisoformat(raw["occurred_at"]).tzinfo is not None


def test_envelope_from_dict_and_typed_payload() -> None:
    envelope = make_event(DocumentUpdated(doc_id="d", version=1), tenant_id="acme")
    again = Envelope.model_validate(json.loads(encode_event(envelope)))
    assert again == envelope
    assert isinstance(again.payload, DocumentUpdated) and again.payload.version == 1


def test_occurred_at_keeps_offsets() -> None:
    envelope = make_event(DocumentDeleted(doc_id="d"), tenant_id="acme")
    raw = json.loads(encode_event(envelope))
    raw["occurred_at"] = "2026-11-29T14:00:00+02:00"
    parsed = parse_event(json.dumps(raw))
    assert parsed.occurred_at == datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
    assert parsed.occurred_at.utcoffset() == timedelta(hours=2)
    assert parsed.occurred_at.tzinfo == timezone(timedelta(hours=2))


def test_block_created_at_accepts_unix_seconds() -> None:
    # The node's pure provenance type keeps time.time(); the contract stores it as RFC 3339.
    block = BlockProvenance(**provenance(created_at=CREATED.timestamp()))
    assert block.created_at == CREATED


def _valid() -> dict:
    event = make_event(
        BlockStored(**NODE, blocks=[{**provenance(), "tier": "device"}]),
    )
    return json.loads(encode_event(event))


def _with(path: str, value, base: dict | None = None) -> bytes:
    """Copy of a valid record with ``path`` (dot-separated) set to ``value``, or removed if value is
    ``...``."""
    raw = base or _valid()
    *parents, last = path.split(".")
    node = raw
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return json.dumps(raw).encode()


MALFORMED = {
    "not json": (b"{not json", "Invalid JSON"),
    "empty": (b"", "Invalid JSON"),
    "not utf-8": (b"\xff\xfe\x00", "Invalid JSON"),
    "array": (b"[1, 2]", "object"),
    "unknown type": (_with("type", "BlockExploded"), "unknown event type"),
    "type not a string": (_with("type", 7), "type"),
    "schema_version 2": (_with("schema_version", 2), "schema_version"),
    "schema_version string": (_with("schema_version", "1"), "schema_version"),
    "missing event_id": (_with("event_id", ...), "event_id: Field required"),
    "bad event_id": (_with("event_id", "not-a-uuid"), "event_id"),
    "missing payload": (_with("payload", ...), "payload: Field required"),
    "payload not object": (_with("payload", [1]), "payload"),
    "naive occurred_at": (_with("occurred_at", "2026-11-29T12:00:00"), "timezone"),
    "numeric occurred_at": (_with("occurred_at", 1764417600), "RFC 3339"),
    "garbage occurred_at": (_with("occurred_at", "yesterday"), "occurred_at"),
    "extra envelope field": (_with("extra", 1), "extra"),
    "missing node_id": (_with("payload.node_id", ...), "payload.node_id: Field required"),
    "seq as string": (_with("payload.seq", "41"), "payload.seq"),
    "negative epoch": (_with("payload.epoch", -1), "payload.epoch"),
    "seq as bool": (_with("payload.seq", True), "payload.seq"),
    "extra payload field": (_with("payload.colour", "red"), "payload.colour"),
    "empty block batch": (_with("payload.blocks", []), "payload.blocks"),
    "bad block hash": (_with("payload.blocks.0.block_hash", "XYZ"), "payload.blocks.0.block_hash"),
    "upper-case block hash": (
        _with("payload.blocks.0.block_hash", "AB" * 32),
        "payload.blocks.0.block_hash",
    ),
    "short block hash": (
        _with("payload.blocks.0.block_hash", "ab" * 4),
        "payload.blocks.0.block_hash",
    ),
    "unknown tier": (_with("payload.blocks.0.tier", "tape"), "payload.blocks.0.tier"),
    "unknown scope": (_with("payload.blocks.0.scope", "world"), "payload.blocks.0.scope"),
    "raw subject id": (
        _with("payload.blocks.0.subject_id", "alice"),
        "payload.blocks.0.subject_id",
    ),
    "user block without subject": (_with("payload.blocks.0.scope", "user"), "needs subject_id"),
    "tenant block without tenant": (_with("payload.blocks.0.tenant_id", None), "needs tenant_id"),
    "public block with tenant": (_with("payload.blocks.0.scope", "public"), "public block"),
    "bad document tag": (
        _with("payload.blocks.0.documents", ["doc-1"]),
        "payload.blocks.0.documents.0",
    ),
    "bad auth scope pair": (
        _with("payload.blocks.0.auth_scopes", [["handbook"]]),
        "payload.blocks.0.auth_scopes",
    ),
}


@pytest.mark.parametrize(("data", "needle"), MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_is_rejected_with_a_readable_error(data: bytes, needle: str) -> None:
    with pytest.raises(EventValidationError) as caught:
        parse_event(data)
    message = str(caught.value)
    assert needle in message
    assert "\n" not in message
    assert isinstance(caught.value, ValueError)


def test_errors_do_not_echo_input_values() -> None:
    with pytest.raises(EventValidationError) as caught:
        parse_event(_with("payload.blocks.0.subject_id", "alice@example.com"))
    assert "alice" not in str(caught.value)


def _document_event(**payload) -> dict:
    return (
        json.loads(
            encode_event(make_event(DocumentUpdated(doc_id="d", version=1), tenant_id="acme"))
        )
        | payload
    )


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"tenant_id": None}, "must carry tenant_id"),
        ({"tenant_id": ""}, "tenant_id"),
        ({"payload": {"doc_id": "d"}}, "payload.version: Field required"),
        ({"payload": {"doc_id": "", "version": 1}}, "payload.doc_id"),
        ({"payload": {"doc_id": "d", "version": 1.5}}, "payload.version"),
        ({"type": "DocumentDeleted"}, "payload.version"),  # DocumentDeleted has no version field
    ],
)
def test_document_event_cases(change: dict, needle: str) -> None:
    with pytest.raises(EventValidationError, match=needle):
        parse_event(json.dumps(_document_event(**change)))


def _command(predicate: dict) -> bytes:
    raw = json.loads(
        encode_event(
            make_event(Invalidate(command_id=uuid.uuid4(), predicate=PREDICATES[0], cutoff=CREATED))
        )
    )
    raw["payload"]["predicate"] = predicate
    return json.dumps(raw).encode()


@pytest.mark.parametrize(
    ("predicate", "needle"),
    [
        ({"kind": "galaxy"}, "does not match any of the expected tags"),
        ({"tenant": "acme"}, "kind"),
        ({"kind": "document", "tenant": "acme", "doc_id": "d"}, "below_version"),
        ({"kind": "subject", "tenant": "acme", "subject_id": "alice"}, "subject.subject_id"),
        ({"kind": "namespace", "ns": "n", "tenant": "acme"}, "namespace.tenant"),
    ],
)
def test_bad_predicates(predicate: dict, needle: str) -> None:
    with pytest.raises(EventValidationError, match=needle):
        parse_event(_command(predicate))


def test_model_invariants_reject_bad_caller_input() -> None:
    with pytest.raises(ValueError, match="from_tier and to_tier"):
        BlockMoved(**NODE, blocks=[{"block_hash": H1, "from_tier": "host", "to_tier": "host"}])
    with pytest.raises(ValueError, match="snapshot_id"):
        Placement(block_hash=H1, tier="snapshot")
    with pytest.raises(ValueError, match="snapshot_id"):
        Placement(block_hash=H1, tier="disk", snapshot_id="s")
    with pytest.raises(ValueError, match="without provenance"):
        Inventory(**NODE, placements=[{"block_hash": H2, "tier": "disk"}], blocks=[provenance(H1)])
    with pytest.raises(ValueError, match="chunk"):
        Inventory(**NODE, placements=[], blocks=[], chunk=2, chunks=2)
    with pytest.raises(ValueError, match="removed=2"):
        TierEvidence(
            tier="host",
            removed=2,
            block_hashes=[H1],
            method="overwrite",
            post_check="readback_zero",
            verified=True,
        )
    with pytest.raises(ValueError, match="tenant_id"):
        make_event(DocumentDeleted(doc_id="d"))
    with pytest.raises(ValueError, match="naive|timezone"):
        Invalidate(command_id=uuid.uuid4(), predicate=PREDICATES[0], cutoff=datetime(2026, 1, 1))


def test_subject_digest_is_keyed_and_tenant_scoped() -> None:
    assert subject_digest(KEY, "acme", "alice") == subject_digest(KEY, "acme", "alice")
    assert subject_digest(KEY, "acme", "alice") != subject_digest(KEY, "other", "alice")
    assert subject_digest(KEY, "acme", "alice") != subject_digest(b"x" * 32, "acme", "alice")
    assert len(SUBJECT) == 64 and "alice" not in SUBJECT
    with pytest.raises(ValueError):
        subject_digest(b"short", "acme", "alice")
    with pytest.raises(ValueError):
        subject_digest(KEY, "", "alice")


def test_routing_and_keys() -> None:
    cases = [
        (DocumentUpdated(doc_id="d", version=1), (topics.DOCUMENTS, "acme:d")),
        (PermissionRevoked(auth_scope="hb", policy_version=2), (topics.PERMISSIONS, "acme:hb")),
        (ErasureRequested(subject_id="alice", reason="r"), (topics.ERASURES, "acme:alice")),
        (NodeStarted(**NODE, namespace="n"), (topics.KV_EVENTS, "node-a")),
        (NodeHeartbeat(node_id="node-a", epoch=1), (topics.KV_EVENTS, "node-a")),
        (
            Invalidate(command_id=uuid.uuid4(), predicate=PREDICATES[4], cutoff=CREATED),
            (topics.COMMANDS, "*"),
        ),
        (
            InventoryRequested(node_id="node-b", request_id=uuid.uuid4()),
            (topics.COMMANDS, "node-b"),
        ),
        (
            CommandAck(command_id=uuid.uuid4(), node_id="node-c", epoch=1, evidence=[]),
            (topics.ACKS, "node-c"),
        ),
    ]
    for payload, expected in cases:
        tenant = "acme" if payload.TENANT_REQUIRED else None
        assert topics.route(make_event(payload, tenant_id=tenant)) == expected
    assert topics.document_key("t", "d") == "t:d"
    assert topics.permission_key("t", "s") == "t:s"
    assert topics.erasure_key("t", "u") == "t:u"
    assert topics.node_key("n") == "n" and topics.command_key("n") == "n"
    with pytest.raises(ValueError):
        topics.document_key("", "d")
    assert len(set(topics.ALL_TOPICS)) == 8 and all(
        t.startswith("kvledger.") for t in topics.ALL_TOPICS
    )


def test_codec_keys_and_tombstones() -> None:
    assert decode_key(encode_key("acme:d")) == "acme:d"
    assert decode_key(None) is None
    with pytest.raises(EventValidationError, match="UTF-8"):
        decode_key(b"\xff")
    with pytest.raises(EventValidationError, match="no value"):
        decode_event(None)


def test_dead_letter_keeps_raw_bytes() -> None:
    letter = DeadLetter.of(
        topic=topics.DOCUMENTS,
        partition=3,
        offset=17,
        timestamp_ms=1,
        key=b"\xffk",
        value=b"\x00{bad",
        error="Invalid JSON",
        group_id="g",
    )
    decoded = DeadLetter.model_validate_json(letter.encode())
    assert decoded == letter
    assert decoded.raw_value() == b"\x00{bad" and decoded.raw_key() == b"\xffk"
    assert decoded.value_b64 == base64.b64encode(b"\x00{bad").decode()


# --- bounds: every identifier, count and list that reaches Postgres or Kafka --------------------

_BAD_IDS = {
    "NUL": "doc\x00id",
    "newline": "doc\nid",
    "carriage return": "doc\rid",
    "tab": "doc\tid",
    "escape": "doc\x1bid",
    "DEL": "doc\x7fid",
    "C1 (NEL)": "doc\x85id",
    "257 characters": "d" * 257,
    "empty": "",
}
_BAD_COUNTS = {"2^53": 2**53, "2^63": 2**63, "-1": -1}
_ID_FIELDS = [
    ("tenant_id", DocumentUpdated(doc_id="d", version=1), "acme"),
    ("payload.doc_id", DocumentUpdated(doc_id="d", version=1), "acme"),
    ("payload.auth_scope", PermissionRevoked(auth_scope="hb", policy_version=1), "acme"),
    ("payload.subject_id", ErasureRequested(subject_id="alice", reason="r"), "acme"),
    ("payload.node_id", NodeStarted(**NODE, namespace="n"), None),
    ("payload.namespace", NodeStarted(**NODE, namespace="n"), None),
    ("payload.snapshot_id", SnapshotDeleted(**NODE, snapshot_id="s"), None),
    (
        "payload.blocks.0.namespace",
        BlockStored(**NODE, blocks=[{**provenance(), "tier": "device"}]),
        None,
    ),
    (
        "payload.blocks.0.tenant_id",
        BlockStored(**NODE, blocks=[{**provenance(), "tier": "device"}]),
        None,
    ),
]
_COUNT_FIELDS = [
    ("payload.version", DocumentUpdated(doc_id="d", version=1), "acme"),
    ("payload.policy_version", PermissionRevoked(auth_scope="hb", policy_version=1), "acme"),
    ("payload.epoch", NodeStarted(**NODE, namespace="n"), None),
    ("payload.seq", NodeStarted(**NODE, namespace="n"), None),
]


def _event_json(payload, tenant) -> dict:
    return json.loads(encode_event(make_event(payload, tenant_id=tenant)))


@pytest.mark.parametrize("bad", _BAD_IDS.values(), ids=_BAD_IDS.keys())
@pytest.mark.parametrize(("path", "payload", "tenant"), _ID_FIELDS, ids=[f[0] for f in _ID_FIELDS])
def test_identifiers_are_bounded(path: str, payload, tenant, bad: str) -> None:
    with pytest.raises(EventValidationError) as caught:
        parse_event(_with(path, bad, _event_json(payload, tenant)))
    assert path in str(caught.value)


@pytest.mark.parametrize("bad", _BAD_COUNTS.values(), ids=_BAD_COUNTS.keys())
@pytest.mark.parametrize(
    ("path", "payload", "tenant"), _COUNT_FIELDS, ids=[f[0] for f in _COUNT_FIELDS]
)
def test_counts_are_bounded(path: str, payload, tenant, bad: int) -> None:
    with pytest.raises(EventValidationError) as caught:
        parse_event(_with(path, bad, _event_json(payload, tenant)))
    assert path in str(caught.value)


def test_limits_themselves_are_accepted() -> None:
    longest = "é" * MAX_ID_CHARS  # characters, not bytes
    event = make_event(
        DocumentUpdated(doc_id=longest, version=schema.MAX_DOCUMENT_VERSION),
        tenant_id="t" * MAX_ID_CHARS,
    )
    assert parse_event(encode_event(event)) == event
    block = BlockProvenance(
        **provenance(documents=[f"{longest}@{schema.MAX_DOCUMENT_VERSION}"], token_offset=2**31 - 1)
    )
    assert block.documents == [f"{longest}@{schema.MAX_DOCUMENT_VERSION}"]


def test_lone_surrogates_are_refused() -> None:
    # JSON text cannot smuggle one past the parser, and a model built in Python refuses one too.
    with pytest.raises(EventValidationError, match="Invalid JSON"):
        parse_event(
            _with(
                "payload.doc_id", "x", _event_json(DocumentUpdated(doc_id="d", version=1), "acme")
            ).replace(b'"x"', b'"\\ud800"')
        )
    with pytest.raises(ValueError, match="unicode"):
        DocumentUpdated(doc_id="a\ud800", version=1)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"documents": ["doc\n@1"]}, "documents.0"),
        ({"documents": [f"{'d' * 257}@1"]}, "documents.0"),
        ({"documents": [f"doc@{2**53}"]}, "documents.0"),
        ({"auth_scopes": [("hb", 2**53)]}, "auth_scopes.0.1"),
        ({"auth_scopes": [("h\x00b", 1)]}, "auth_scopes.0.0"),
        ({"token_offset": 2**31}, "token_offset"),
        ({"auth_scopes": [("hb", 1)] * 257}, "auth_scopes"),
    ],
)
def test_block_provenance_bounds(change: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        BlockProvenance(**provenance(**change))


def test_lists_are_bounded() -> None:
    blocks = [{"block_hash": f"{i:064x}", "tier": "host"} for i in range(MAX_BLOCKS_PER_EVENT + 1)]
    with pytest.raises(ValueError, match="blocks"):
        BlockRemoved(**NODE, blocks=blocks, reason="evicted")
    assert (
        len(BlockRemoved(**NODE, blocks=blocks[:-1], reason="evicted").blocks)
        == MAX_BLOCKS_PER_EVENT
    )


def test_reason_is_bounded_text() -> None:
    assert (
        ErasureRequested(subject_id="a", reason="line one\nline two\tend").reason
        == "line one\nline two\tend"
    )
    for bad in ("a\x00b", "x" * 2001, ""):
        with pytest.raises(ValueError, match="reason"):
            ErasureRequested(subject_id="a", reason=bad)


def test_a_deletion_matches_every_document_version_and_stays_signable() -> None:
    """``ANY_VERSION`` lies above every version a document may have, and RFC 8785 (what a command's
    signature covers) can carry it: the largest version is one below it."""
    assert DocumentUpdated(doc_id="d", version=schema.MAX_DOCUMENT_VERSION).version == 2**53 - 2
    with pytest.raises(ValidationError):
        DocumentUpdated(doc_id="d", version=schema.ANY_VERSION)
    deletion = schema.DocumentPredicate(tenant="acme", doc_id="d", below_version=schema.ANY_VERSION)
    assert schema.MAX_DOCUMENT_VERSION < deletion.below_version
    assert json.loads(rfc8785.dumps(deletion.model_dump(mode="json")))["below_version"] == 2**53 - 1


@pytest.mark.parametrize(
    "blank", [" ", "\u2003", "\u3000 "], ids=["space", "em space", "ideographic space"]
)
def test_blank_identifiers_and_reasons_are_refused(blank: str) -> None:
    """A value of only whitespace is no identifier and no reason: the coordinator's handlers refuse it too,
    so the contract must refuse it first (found by tests/security/test_contract_fits_postgres.py)."""
    with pytest.raises(ValidationError, match="blank"):
        DocumentUpdated(doc_id=blank, version=1)
    with pytest.raises(ValidationError, match="blank"):
        schema.ErasureRequested(subject_id="alice", reason=blank)


USAGE = {
    **NODE,
    "tenant_id": "acme",
    "window_start": "2026-11-29T12:00:00Z",
    "window_end": "2026-11-29T12:00:05Z",
    "num_requests": 2,
    "num_prompt_tokens": 10,
    "num_cached_tokens": 10,
    "num_output_tokens": 0,
}


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        ({"num_cached_tokens": 11}, "num_cached_tokens cannot exceed num_prompt_tokens"),
        ({"window_end": "2026-11-29T11:59:59Z"}, "window_end must not precede window_start"),
        ({"num_requests": 0}, "num_requests"),
        ({"num_output_tokens": -1}, "num_output_tokens"),
        ({"num_prompt_tokens": "10"}, "num_prompt_tokens"),
        ({"prompt": "hello"}, "prompt"),
    ],
)
def test_usage_reports_are_bounded_counts(overrides: dict, problem: str) -> None:
    assert UsageReported.model_validate(USAGE).num_cached_tokens == 10
    with pytest.raises(ValidationError, match=problem):
        UsageReported.model_validate(USAGE | overrides)


# --- tiers on the wire ------------------------------------------------------------------------
#
# The wire models type tiers with the one enum, ``events.tiers.Tier``. Signatures cover the RFC 8785
# canonical JSON of a record, so a tier must serialize as its value (``"device"``, never
# ``"Tier.DEVICE"``) or every signature made before would stop verifying.
# ``wire_records_with_tiers.jsonl`` holds the records :func:`_records_with_tiers` built, encoded and
# signed when the models still spelled tiers as string literals, one per line: today's models must
# produce them byte for byte.

WIRE_RECORDS = (Path(__file__).parent / "wire_records_with_tiers.jsonl").read_bytes().splitlines()

WIRE_KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
"""A fixed key: Ed25519 signatures are deterministic, so a record signs to the same bytes every
time."""


def _records_with_tiers(tier: Callable[[str], str]) -> list[Envelope]:
    """One signed record of each model that names a tier, every tier value included, spelled
    ``tier(value)``."""
    user = provenance(H2, scope="user", subject_id=SUBJECT)
    payloads: list[tuple[schema.EventPayload, str | None]] = [
        (
            BlockStored(
                **NODE,
                blocks=[{**provenance(H1), "tier": tier("device")}, {**user, "tier": tier("disk")}],
            ),
            None,
        ),
        (
            BlockRemoved(
                **NODE, blocks=[{"block_hash": H1, "tier": tier("host")}], reason="evicted"
            ),
            None,
        ),
        (
            BlockMoved(
                **NODE,
                blocks=[{"block_hash": H1, "from_tier": tier("device"), "to_tier": tier("host")}],
            ),
            None,
        ),
        (
            Inventory(
                **NODE,
                request_id=uuid.UUID(int=7),
                placements=[
                    Placement(block_hash=H1, tier=tier("host")),
                    Placement(block_hash=H2, tier=tier("snapshot"), snapshot_id="snap-1"),
                ],
                blocks=[BlockProvenance(**provenance(H1)), BlockProvenance(**user)],
            ),
            None,
        ),
        (
            CommandAck(
                command_id=uuid.UUID(int=9),
                node_id="node-a",
                epoch=2,
                evidence=[
                    TierEvidence(
                        tier=tier("device"),
                        removed=1,
                        block_hashes=[H1],
                        method="overwrite",
                        post_check="readback_zero",
                        verified=True,
                    ),
                    TierEvidence(
                        tier=tier("snapshot"),
                        removed=1,
                        block_hashes=[H2],
                        method="crypto_erase",
                        post_check="key_destroyed",
                        verified=True,
                        key_ids=["key-1"],
                    ),
                ],
            ),
            "acme",
        ),
    ]
    return [
        sign_envelope(
            Envelope(
                event_id=uuid.UUID(int=n + 1),
                type=payload.TYPE,
                schema_version=1,
                occurred_at=CREATED,
                tenant_id=tenant,
                payload=payload,
            ),
            WIRE_KEY,
        )
        for n, (payload, tenant) in enumerate(payloads)
    ]


@pytest.mark.parametrize("tier", [str, Tier], ids=["plain-strings", "enum-members"])
def test_tiers_go_on_the_wire_exactly_as_before(tier: Callable[[str], str]) -> None:
    records = _records_with_tiers(tier)
    assert [encode_event(record) for record in records] == WIRE_RECORDS
    assert [rfc8785.dumps(record.model_dump(mode="json")) for record in records] == [
        rfc8785.dumps(json.loads(line)) for line in WIRE_RECORDS
    ]


def test_records_signed_before_still_verify_and_read_as_the_enum() -> None:
    assert len(WIRE_RECORDS) == 5
    for line in WIRE_RECORDS:
        record = parse_event(line)
        assert verify_envelope(record, WIRE_KEY.public_key()), record.type
        assert encode_event(record) == line
    stored, removed, moved, inventory, ack = (parse_event(line).payload for line in WIRE_RECORDS)
    tiers = [
        *(block.tier for block in stored.blocks),
        *(block.tier for block in removed.blocks),
        *(t for block in moved.blocks for t in (block.from_tier, block.to_tier)),
        *(placement.tier for placement in inventory.placements),
        *(evidence.tier for evidence in ack.evidence),
    ]
    assert tiers == [
        Tier.DEVICE,
        Tier.DISK,
        Tier.HOST,
        Tier.DEVICE,
        Tier.HOST,
        Tier.HOST,
        Tier.SNAPSHOT,
        Tier.DEVICE,
        Tier.SNAPSHOT,
    ]
    assert all(type(t) is Tier for t in tiers)


@pytest.mark.parametrize(
    "blocks",
    [
        {"blocks": [{"block_hash": H1, "tier": "snapshot"}], "reason": "evicted"},
        {"blocks": [{"block_hash": H1, "tier": "DEVICE"}], "reason": "evicted"},
        {"blocks": [{"block_hash": H1, "tier": "Tier.DEVICE"}], "reason": "evicted"},
    ],
)
def test_a_block_event_names_only_storage_tiers_by_value(blocks: dict) -> None:
    raw = json.loads(WIRE_RECORDS[1])
    raw["payload"] |= blocks
    with pytest.raises(EventValidationError, match="tier"):
        parse_event(json.dumps(raw))
    assert {block.tier for block in parse_event(WIRE_RECORDS[1]).payload.blocks} <= set(
        STORAGE_TIERS
    )


def test_creator_subject_id_is_optional_and_left_out_of_the_encoding_when_unset() -> None:
    """Records of nodes that predate the field stay valid and encode byte for byte as before."""
    old = BlockProvenance(**provenance())
    assert old.creator_subject_id is None and "creator_subject_id" not in old.model_dump_json()
    creator = "ab" * 32
    for scope, tenant_id, subject_id, auth_scopes, documents in (
        ("public", None, None, [], []),
        ("tenant", "acme", None, [("handbook", 3)], ["doc-1@7"]),
        ("user", "acme", creator, [], []),
    ):
        block = BlockProvenance(
            **provenance(
                scope=scope,
                tenant_id=tenant_id,
                subject_id=subject_id,
                auth_scopes=auth_scopes,
                documents=documents,
            ),
            creator_subject_id=creator,
        )
        assert BlockProvenance.model_validate_json(block.model_dump_json()) == block
        assert block.creator_subject_id == creator


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"creator_subject_id": "alice"}, "creator_subject_id"),
        (
            {"scope": "user", "subject_id": "ab" * 32, "creator_subject_id": "cd" * 32},
            "its own subject",
        ),
    ],
)
def test_creator_subject_id_is_a_digest_and_a_user_block_is_its_subjects(
    change: dict, needle: str
) -> None:
    with pytest.raises(ValueError, match=needle):
        BlockProvenance(**provenance(**change))
