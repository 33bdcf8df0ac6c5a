"""The compiled kv-events decoder (events/kv_decoder.py) is exactly the contract's ``parse_event``.

Property tests over generated records of every kv-events type: a valid record takes the fast path
and decodes to an identical object (same classes, field values, field sets, timezone objects, signed
bytes); a mutated record — out-of-range or mistyped values, missing or extra fields, oversize lists,
bad hex, control characters — is either refused by both with the same message, or accepted by both
as identical objects. Never approximately.
"""

from __future__ import annotations

import copy
import json
import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Annotated, Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, BeforeValidator, ConfigDict, StringConstraints, field_validator

from events import kv_decoder
from events.codec import decode_event, encode_event
from events.schema import (
    EVENT_TYPES,
    MAX_BLOCKS_PER_EVENT,
    MAX_ID_CHARS,
    MAX_INT32,
    MAX_LIST_ITEMS,
    MAX_SAFE_INT,
    BlockMoved,
    BlockProvenance,
    BlockRemoved,
    BlockStored,
    Envelope,
    EventValidationError,
    Inventory,
    MovedBlock,
    NodeHeartbeat,
    NodeStarted,
    Placement,
    RemovedBlock,
    SnapshotDeleted,
    SnapshotWritten,
    StoredBlock,
    UsageReported,
    make_event,
    parse_event,
)
from events.tiers import STORAGE_TIERS, Tier
from events.topics import KV_EVENTS, TYPES_BY_TOPIC
from identity.signing import sign_envelope, signed_bytes

# Unicode category Cc is exactly C0, DEL and C1; Cs the surrogates (the contract refuses both).
_ID_CHARS = st.characters(exclude_categories=("Cc", "Cs"))
NAMES = st.one_of(
    st.text(_ID_CHARS, min_size=1, max_size=12),
    st.text(_ID_CHARS, min_size=MAX_ID_CHARS, max_size=MAX_ID_CHARS),
).filter(str.strip)
COUNTS = st.one_of(st.integers(0, MAX_SAFE_INT), st.sampled_from([0, MAX_SAFE_INT]))
SMALL_COUNTS = st.one_of(st.integers(0, MAX_INT32), st.sampled_from([0, MAX_INT32]))
HEXES = st.binary(min_size=16, max_size=64).map(bytes.hex)
OFFSETS = st.sampled_from(
    [UTC, timezone(timedelta(hours=5, minutes=30)), timezone(timedelta(hours=-23, minutes=-59))]
)
DATETIMES = st.builds(
    lambda moment, tz: moment.replace(tzinfo=tz),
    st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30)),
    OFFSETS,
)
TAGS = st.builds(lambda doc, version: f"{doc}@{version}", NAMES, st.integers(0, MAX_SAFE_INT - 1))


def _node(draw) -> dict:
    return {"node_id": draw(NAMES), "epoch": draw(COUNTS), "seq": draw(COUNTS)}


@st.composite
def provenances(
    draw, model: type[BlockProvenance] = BlockProvenance, block_hash: str | None = None
) -> BlockProvenance:
    scope = draw(st.sampled_from(["public", "tenant", "user"]))
    subject = draw(HEXES) if scope == "user" else None
    owned = scope != "public"
    extra = {"tier": draw(st.sampled_from(STORAGE_TIERS))} if model is StoredBlock else {}
    creator = draw(st.one_of(st.none(), st.just(subject) if scope == "user" else HEXES))
    return model(
        block_hash=block_hash or draw(HEXES),
        parent_hash=draw(st.none() | HEXES),
        namespace=draw(NAMES),
        tenant_id=draw(NAMES) if owned else None,
        scope=scope,
        auth_scopes=draw(st.lists(st.tuples(NAMES, COUNTS), max_size=3)) if owned else [],
        subject_id=subject,
        documents=draw(st.lists(TAGS, max_size=3)) if owned else [],
        token_offset=draw(SMALL_COUNTS),
        created_at=draw(DATETIMES),
        **({"creator_subject_id": creator} if creator is not None or draw(st.booleans()) else {}),
        **extra,
    )


@st.composite
def inventories(draw) -> Inventory:
    blocks = draw(st.lists(provenances(), max_size=3, unique_by=lambda block: block.block_hash))
    placements = []
    for block in blocks:
        tier = draw(st.sampled_from(list(Tier)))
        snapshot = {"snapshot_id": draw(NAMES)} if tier == Tier.SNAPSHOT else {}
        placements.append(Placement(block_hash=block.block_hash, tier=tier, **snapshot))
    chunks = draw(st.integers(1, MAX_INT32))
    defaults = {}
    if draw(st.booleans()):
        defaults = {
            "request_id": draw(st.uuids()),
            "chunk": draw(st.integers(0, chunks - 1)),
            "chunks": chunks,
        }
    return Inventory(**_node(draw), placements=placements, blocks=blocks, **defaults)


@st.composite
def usages(draw) -> UsageReported:
    start = draw(DATETIMES)
    prompt = draw(COUNTS)
    return UsageReported(
        **_node(draw),
        tenant_id=draw(NAMES),
        window_start=start,
        window_end=start + draw(st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=1))),
        num_requests=draw(st.integers(1, MAX_SAFE_INT)),
        num_prompt_tokens=prompt,
        num_cached_tokens=draw(st.integers(0, prompt)),
        num_output_tokens=draw(COUNTS),
    )


@st.composite
def snapshots(draw) -> SnapshotWritten:
    parts = draw(st.integers(1, MAX_INT32))
    split = {"part": draw(st.integers(0, parts - 1)), "parts": parts} if draw(st.booleans()) else {}
    return SnapshotWritten(
        **_node(draw),
        snapshot_id=draw(NAMES),
        block_hashes=draw(st.lists(HEXES, max_size=4)),
        **split,
    )


@st.composite
def moves(draw) -> MovedBlock:
    from_tier, to_tier = draw(st.permutations(STORAGE_TIERS))[:2]
    return MovedBlock(block_hash=draw(HEXES), from_tier=from_tier, to_tier=to_tier)


@st.composite
def node_events(draw, model: type, **fields: st.SearchStrategy) -> Any:
    return model(**_node(draw), **{name: draw(strategy) for name, strategy in fields.items()})


PAYLOADS = st.one_of(
    node_events(NodeStarted, namespace=NAMES),
    node_events(BlockStored, blocks=st.lists(provenances(StoredBlock), min_size=1, max_size=3)),
    node_events(
        BlockRemoved,
        blocks=st.lists(
            st.builds(RemovedBlock, block_hash=HEXES, tier=st.sampled_from(STORAGE_TIERS)),
            min_size=1,
            max_size=3,
        ),
        reason=st.sampled_from(["evicted", "expired", "invalidated", "restore_failed", "replaced"]),
    ),
    node_events(BlockMoved, blocks=st.lists(moves(), min_size=1, max_size=3)),
    snapshots(),
    node_events(SnapshotDeleted, snapshot_id=NAMES),
    inventories(),
    st.builds(NodeHeartbeat, node_id=NAMES, epoch=COUNTS, seq=st.none() | COUNTS)
    | st.builds(NodeHeartbeat, node_id=NAMES, epoch=COUNTS),
    usages(),
)

_KEY = Ed25519PrivateKey.generate()


@st.composite
def envelopes(draw) -> Envelope:
    envelope = make_event(draw(PAYLOADS), tenant_id=draw(st.none() | NAMES))
    envelope = envelope.model_copy(update={"occurred_at": draw(DATETIMES)})
    return sign_envelope(envelope, _KEY) if draw(st.booleans()) else envelope


def assert_identical(fast: Any, slow: Any, path: str = "") -> None:
    """``fast`` and ``slow`` are the same value down to classes, field sets and timezone objects."""
    assert type(fast) is type(slow), f"{path}: {type(fast).__name__} != {type(slow).__name__}"
    if isinstance(slow, BaseModel):
        assert list(fast.__dict__) == list(slow.__dict__), path
        assert fast.__pydantic_fields_set__ == slow.__pydantic_fields_set__, path
        assert (
            fast.__pydantic_extra__ == slow.__pydantic_extra__
            and fast.__pydantic_private__ == slow.__pydantic_private__
        ), path
        for name, value in slow.__dict__.items():
            assert_identical(fast.__dict__[name], value, f"{path}.{name}")
    elif isinstance(slow, list | tuple):
        assert len(fast) == len(slow), path
        for i, (each_fast, each_slow) in enumerate(zip(fast, slow, strict=True)):
            assert_identical(each_fast, each_slow, f"{path}[{i}]")
    elif isinstance(slow, datetime):
        assert (fast, fast.utcoffset(), type(fast.tzinfo)) == (
            slow,
            slow.utcoffset(),
            type(slow.tzinfo),
        ), path
    else:
        assert fast == slow, path


def _parsed(raw: bytes) -> Envelope | str:
    try:
        return parse_event(raw)
    except EventValidationError as refused:
        return f"refused: {refused}"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(envelope=envelopes())
def test_every_valid_kv_event_takes_the_fast_path_to_the_contracts_object(
    envelope: Envelope,
) -> None:
    raw = encode_event(envelope)
    fast = kv_decoder.decode_fast(raw)
    assert fast is not None, "a valid kv-events record must not need the fallback"
    slow = parse_event(raw)
    assert_identical(fast, slow)
    assert fast == envelope
    assert signed_bytes(fast) == signed_bytes(slow)
    assert encode_event(fast) == raw


HOSTILE_VALUES = [
    -1,
    2**31,
    MAX_INT32,
    MAX_SAFE_INT + 1,
    2**63,
    2**64,
    -(2**64),
    0,
    1,
    1.0,
    0.5,
    1e300,
    True,
    False,
    None,
    "",
    " ",
    "\t",
    "a\nb",
    "a\x00b",
    "a\x85b",
    "a\u2028b",
    "x" * (MAX_ID_CHARS + 1),
    "x" * MAX_ID_CHARS,
    "11" * 32 + "\n",
    "11" * 32 + " ",
    "AB" * 32,
    "1" * 63,
    "11" * 15,
    "11" * 65,
    "zz" * 32,
    "11" * 16,
    "doc@1",
    "doc@01",
    "@1",
    f"doc@{MAX_SAFE_INT}",
    "2026-12-01T00:00:00Z",
    "2026-12-01T00:00:00",
    "2026-12-01 00:00:00+01:00",
    "2026-12-01T00:00:00.1234567Z",
    "2026-12-01T24:00:00Z",
    "2026-02-30T00:00:00Z",
    "2026-12-01T00:00:00+24:00",
    "2026-12-01t00:00:00z",
    1_700_000_000,
    "device",
    "host",
    "disk",
    "snapshot",
    "public",
    "tenant",
    "user",
    "evicted",
    str(uuid.uuid4()),
    str(uuid.uuid4()).upper(),
    uuid.uuid4().hex,
    "{" + str(uuid.uuid4()) + "}",
    [],
    {},
    [1],
    ["a", 1],
    {"a": 1},
]


def _paths(value: Any, path: tuple = ()) -> list[tuple]:
    found = [path]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += _paths(item, (*path, i))
    return found


def _at(document: Any, path: tuple) -> Any:
    for part in path:
        document = document[part]
    return document


@st.composite
def mutated(draw) -> bytes:
    document = json.loads(encode_event(draw(envelopes())))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(document)))
        kind = draw(
            st.sampled_from(["replace", "replace", "delete", "extra", "oversize", "duplicate"])
        )
        target = _at(document, path)
        if kind == "replace" and path:
            _at(document, path[:-1])[path[-1]] = copy.deepcopy(
                draw(st.sampled_from(HOSTILE_VALUES))
            )
        elif kind == "delete" and path:
            del _at(document, path[:-1])[path[-1]]
        elif kind == "extra" and isinstance(target, dict):
            target[draw(st.sampled_from(["extra", "TYPE", "blocks", "signature", "part"]))] = draw(
                st.sampled_from(HOSTILE_VALUES)
            )
        elif kind == "oversize" and isinstance(target, list) and target:
            limit = draw(st.sampled_from([MAX_LIST_ITEMS, MAX_BLOCKS_PER_EVENT]))
            target[:] = [
                copy.deepcopy(target[0]) for _ in range(limit + draw(st.sampled_from([0, 1])))
            ]
        elif kind == "duplicate" and isinstance(target, list) and target:
            target.append(copy.deepcopy(target[0]))
    return json.dumps(document, ensure_ascii=draw(st.booleans())).encode()


@settings(
    max_examples=800,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(raw=mutated())
def test_a_mutated_record_is_refused_alike_or_accepted_alike(raw: bytes) -> None:
    slow = _parsed(raw)
    fast = kv_decoder.decode_fast(raw)
    if fast is not None:
        assert not isinstance(slow, str), (
            f"the fast path accepted what the contract refuses ({slow})"
        )
        assert_identical(fast, slow)
        assert signed_bytes(fast) == signed_bytes(slow)
    try:
        decoded: Envelope | str = decode_event(raw)
    except EventValidationError as refused:
        decoded = f"refused: {refused}"
    if isinstance(slow, str):
        assert decoded == slow, (
            "a refusal must carry the contract's own message (what the dead letter says)"
        )
    else:
        assert_identical(decoded, slow)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"null",
        b"[]",
        b'{"type": "BlockStored"}',
        "\ufeff{}".encode(),
        b'{"event_id": "00000000-0000-0000-0000-000000000000", "type": "BlockStored", "payload": "x"}',
        b"\xff\xfe",
    ],
)
def test_malformed_bytes_are_refused_with_the_contracts_message(raw: bytes) -> None:
    assert kv_decoder.decode_fast(raw) is None
    with pytest.raises(EventValidationError) as decoded:
        decode_event(raw)
    with pytest.raises(EventValidationError) as parsed:
        parse_event(raw)
    assert str(decoded.value) == str(parsed.value)


def _with(envelope: Envelope, path: tuple, value: Any) -> bytes:
    document = json.loads(encode_event(envelope))
    _at(document, path[:-1])[path[-1]] = value
    return json.dumps(document).encode()


STORED = make_event(
    BlockStored(
        node_id="n",
        epoch=1,
        seq=1,
        blocks=[
            StoredBlock(
                block_hash="11" * 32,
                parent_hash=None,
                namespace="ns",
                tenant_id="acme",
                scope="tenant",
                auth_scopes=[("s", 1)],
                subject_id=None,
                documents=["d@1"],
                token_offset=0,
                created_at=datetime(2026, 12, 1, tzinfo=UTC),
                tier=Tier.DISK,
            )
        ],
    )
)


def test_forms_only_pydantic_reads_fall_back_to_it_and_decode_alike() -> None:
    """A unix-number timestamp and a duplicated key are the contract's; the fast path leaves them to
    it."""
    for raw in (
        _with(STORED, ("payload", "blocks", 0, "created_at"), 1_764_547_200),
        encode_event(STORED).replace(b'"seq":1', b'"seq":"x","seq":1'),
    ):
        assert kv_decoder.decode_fast(raw) is None
        assert_identical(decode_event(raw), parse_event(raw))


def test_a_digest_with_a_final_newline_is_refused_as_the_contract_refuses_it() -> None:
    """Python's ``$`` would match before the newline; the contract's (Rust) regex engine does not."""
    raw = _with(STORED, ("payload", "blocks", 0, "block_hash"), "11" * 32 + "\n")
    assert kv_decoder.decode_fast(raw) is None
    with pytest.raises(EventValidationError, match="block_hash"):
        decode_event(raw)


def test_the_compiled_types_are_exactly_the_kv_events_topics() -> None:
    assert kv_decoder.FAST_TYPES == TYPES_BY_TOPIC[KV_EVENTS]
    for event_type in kv_decoder.FAST_TYPES:
        model = EVENT_TYPES[event_type]
        struct, _ = kv_decoder._compiled(model)
        assert struct.__struct_fields__ == tuple(model.model_fields), (
            f"{event_type}: struct fields drifted from the model"
        )


class _Lax(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    count: int


class _Before(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str

    @field_validator("name", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value


class _Coerced(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: Annotated[str, BeforeValidator(str)]


class _Open(BaseModel):
    name: str


class _Float(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    ratio: float


class _Stripped(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: Annotated[str, StringConstraints(min_length=1, strip_whitespace=True)]


@pytest.mark.parametrize("model", [_Lax, _Before, _Coerced, _Open, _Float, _Stripped])
def test_a_contract_construct_without_an_exact_compiled_form_fails_the_generator(
    model: type[BaseModel],
) -> None:
    """A change to the contract that the decoder could not honour exactly stops the import, not a
    record."""
    with pytest.raises(AssertionError):
        kv_decoder._compiled(model)
