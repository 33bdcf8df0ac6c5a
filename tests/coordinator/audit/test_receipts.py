"""Receipt bodies, signing, key documents, tree heads and serving (coordinator.audit.receipts)."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import typing
import uuid
from datetime import UTC, datetime, timedelta, timezone

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed448 import Ed448PrivateKey
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import SecretStr

from coordinator.audit import merkle
from coordinator.audit.receipts import (
    BLOCK_COMMITMENT_ALGORITHM,
    METHOD_FOR_NODE_ERASE_METHOD,
    METHODS,
    RECEIPT_SCHEMA,
    SCOPE_COVERAGE_CAVEAT,
    STANDARD_CAVEATS,
    TIERS,
    ReceiptPublicKey,
    ReceiptSigner,
    TierErasure,
    audit_leaf_data,
    audit_leaf_hash,
    block_commitment,
    build_receipt,
    canonical_json,
    evidence_digest,
    key_id_for,
    public_key_document,
    receipt_method,
    rfc3339,
    serve_receipt,
    sign_receipt,
    sign_tree_head,
)
from events import schema

T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
SUBJECT_HASH = schema.subject_digest(b"k" * 32, "acme", "alice@example.com")
BLOCKS = ["bb" * 32, "aa" * 32, "cc" * 32, "aa" * 32]


def body(**overrides):
    arguments = dict(
        receipt_id="r-1",
        erasure_id=uuid.UUID(int=7),
        tenant_id="acme",
        subject_hash=SUBJECT_HASH,
        requested_at=T0,
        verified_at=T0 + timedelta(seconds=42, microseconds=123456),
        tiers=[
            TierErasure("node-b", "disk", 2, "purge-crypto-erase", {"post_check": "key_destroyed"}),
            TierErasure("node-a", "host", 1, "clear", {"post_check": "readback_zero"}),
            TierErasure(
                "node-a", "device", 3, "clear", {"post_check": "readback_zero", "slots": [1, 2, 3]}
            ),
        ],
        block_hashes=BLOCKS,
        key_ids_destroyed=["ff" * 16, "ee" * 16, "ff" * 16],
        node_keys=[("node-b", "bb" * 16), ("node-a", "aa" * 16), ("node-a", "aa" * 16)],
    )
    arguments.update(overrides)
    return build_receipt(**arguments)


# --- canonical JSON is RFC 8785 -------------------------------------------------------------


def test_canonical_json_rfc8785_serialization_example():
    # RFC 8785 §3.2.2: number formatting (ECMAScript), string escaping, key order.
    value = json.loads(
        '{"numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],'
        ' "string": "\\u20ac$\\u000F\\u000aA\'\\u0042\\u0022\\u005c\\\\\\"\\/",'
        ' "literals": [null, true, false]}'
    )
    expected = '{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\\u000f\\nA\'B\\"\\\\\\\\\\"/"}'
    assert canonical_json(value) == expected.encode("utf-8")


def test_canonical_json_rfc8785_key_sorting_by_utf16_code_units():
    # RFC 8785 §3.2.3: keys sort by UTF-16 code units, so the emoji (a surrogate pair,
    # 0xD83D…) sorts before U+FB33 although its code point is larger.
    value = {"\u20ac": 0, "\r": 1, "\ufb33": 2, "1": 3, "\U0001f600": 4, "\u0080": 5, "\u00f6": 6}
    keys = list(json.loads(canonical_json(value)))
    assert keys == ["\r", "1", "\u0080", "\u00f6", "\u20ac", "\U0001f600", "\ufb33"]


def test_canonical_json_refuses_what_json_cannot_carry():
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})
    with pytest.raises(ValueError):
        canonical_json({"x": 2**60})


# --- receipt body ----------------------------------------------------------------------------


def test_receipt_body_shape_and_determinism():
    receipt = body()
    assert receipt["schema"] == RECEIPT_SCHEMA
    assert receipt["erasure_id"] == str(uuid.UUID(int=7))
    assert receipt["requested_at"] == "2026-11-29T12:00:00.000Z"
    assert receipt["verified_at"] == "2026-11-29T12:00:42.123Z"
    assert [(e["node_id"], e["tier"]) for e in receipt["tiers"]] == [
        ("node-a", "device"),
        ("node-a", "host"),
        ("node-b", "disk"),
    ]
    assert (
        receipt["tiers"][0]["evidence_digest"]
        == hashlib.sha256(b'{"post_check":"readback_zero","slots":[1,2,3]}').hexdigest()
    )
    assert receipt["key_ids_destroyed"] == ["ee" * 16, "ff" * 16]
    # The node keys whose signed acks the receipt relies on: sorted, one entry per (node, key).
    assert receipt["node_keys"] == [
        {"node_id": "node-a", "key_id": "aa" * 16},
        {"node_id": "node-b", "key_id": "bb" * 16},
    ]
    assert receipt["caveats"] == list(STANDARD_CAVEATS)
    # Same inputs in another order → the same bytes to sign.
    again = body(
        tiers=[
            TierErasure(
                "node-a", "device", 3, "clear", {"slots": [1, 2, 3], "post_check": "readback_zero"}
            ),
            TierErasure("node-a", "host", 1, "clear", {"post_check": "readback_zero"}),
            TierErasure("node-b", "disk", 2, "purge-crypto-erase", {"post_check": "key_destroyed"}),
        ],
        block_hashes=list(reversed(BLOCKS)),
        key_ids_destroyed=["ee" * 16, "ff" * 16],
        node_keys=[("node-a", "aa" * 16), ("node-b", "bb" * 16)],
    )
    assert canonical_json(again) == canonical_json(receipt)


def test_block_commitment_is_rfc6962_root_over_sorted_unique_hashes():
    commitment = body()["block_commitment"]
    leaves = [merkle.leaf_hash(bytes.fromhex(h)) for h in ("aa" * 32, "bb" * 32, "cc" * 32)]
    assert commitment == {
        "algorithm": BLOCK_COMMITMENT_ALGORITHM,
        "count": 3,
        "root": merkle.root_hash(3, leaves).hex(),
    }
    assert block_commitment([]) == {
        "algorithm": BLOCK_COMMITMENT_ALGORITHM,
        "count": 0,
        "root": merkle.EMPTY_ROOT.hex(),
    }


def test_receipt_holds_no_subject_in_clear():
    receipt = body()
    names: list[str] = []

    def walk(value):
        if isinstance(value, dict):
            for key, inner in value.items():
                names.append(key)
                walk(inner)
        elif isinstance(value, list):
            for inner in value:
                walk(inner)

    walk(receipt)
    assert [n for n in names if "subject" in n] == ["subject_hash"]
    assert not any(re.search(r"subject_?id|user|email|sub$", n) for n in names)
    assert "alice" not in canonical_json(receipt).decode()


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"subject_hash": "alice@example.com"}, "subject_hash"),
        ({"subject_hash": SUBJECT_HASH.upper()}, "subject_hash"),
        ({"requested_at": datetime(2026, 1, 1)}, "timezone-aware"),
        ({"verified_at": T0 - timedelta(seconds=1)}, "before"),
        ({"tiers": [TierErasure("n", "gpu", 1, "clear", {})]}, "tier"),
        ({"tiers": [TierErasure("n", "disk", 1, "purge-unlink", {})]}, "method"),
        ({"tiers": [TierErasure("n", "disk", -1, "clear", {})]}, "count"),
        ({"tiers": [TierErasure("n", "disk", 1, "clear", {"x": float("nan")})]}, "evidence"),
        (
            {
                "tiers": [
                    TierErasure("n", "disk", 1, "clear", {}),
                    TierErasure("n", "disk", 2, "clear", {}),
                ]
            },
            "two entries",
        ),
        ({"block_hashes": ["AA" * 32]}, "block hash"),
        ({"block_hashes": ["aa" * 8 + "a"]}, "block hash"),
        ({"key_ids_destroyed": [""]}, "key id"),
        ({"node_keys": [("node-a", "not-a-key-id")]}, "node key id"),
        ({"node_keys": [("", "aa" * 16)]}, "node_id"),
        ({"tenant_id": ""}, "tenant_id"),
        (
            {"blocks_by_scope": {"public": 1, "tenant": 1, "user": 1, "unrecorded": 1}},
            "adds up to 4, but 3",
        ),
        ({"blocks_by_scope": {"public": 3, "tenant": 0, "user": 0}}, "exactly the keys"),
        (
            {"blocks_by_scope": {"public": 3, "tenant": 0, "user": 0, "unrecorded": True}},
            "non-negative integer",
        ),
    ],
)
def test_build_receipt_rejects_bad_input(overrides, message):
    with pytest.raises(ValueError, match=message):
        body(**overrides)


def test_per_scope_coverage_is_in_the_body_with_its_caveat_only_when_given():
    assert "blocks_by_scope" not in body() and SCOPE_COVERAGE_CAVEAT not in body()["caveats"]
    covered = body(
        blocks_by_scope={"user": 1, "unrecorded": 0, "public": 2, "tenant": 0}, caveats=["extra"]
    )
    assert list(covered["blocks_by_scope"].items()) == [
        ("public", 2),
        ("tenant", 0),
        ("user", 1),
        ("unrecorded", 0),
    ]
    assert covered["caveats"] == [*STANDARD_CAVEATS, SCOPE_COVERAGE_CAVEAT, "extra"]


def test_extra_caveats_follow_the_standard_ones():
    assert body(caveats=["node-c was decommissioned"])["caveats"] == [
        *STANDARD_CAVEATS,
        "node-c was decommissioned",
    ]


def test_method_vocabulary_covers_every_node_erase_method():
    assert set(METHOD_FOR_NODE_ERASE_METHOD) == set(typing.get_args(schema.EraseMethod))
    assert set(METHOD_FOR_NODE_ERASE_METHOD.values()) == set(METHODS)
    assert TIERS == tuple(schema.TierEvidence.model_fields["tier"].annotation)
    assert receipt_method("overwrite") == "clear"
    assert receipt_method("crypto_erase") == "purge-crypto-erase"
    with pytest.raises(ValueError):
        receipt_method("shred")


def test_evidence_digest_is_sha256_of_canonical_json():
    assert (
        evidence_digest({"b": 1, "a": [True]}) == hashlib.sha256(b'{"a":[true],"b":1}').hexdigest()
    )


def test_rfc3339_converts_to_utc():
    moment = datetime(2026, 11, 29, 13, 0, tzinfo=timezone(timedelta(hours=1)))
    assert rfc3339(moment) == "2026-11-29T12:00:00.000Z"


# --- keys ------------------------------------------------------------------------------------


def _pem(key) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()


def test_signer_from_pem_secret_and_key_id():
    private = Ed25519PrivateKey.generate()
    signer = ReceiptSigner.from_pem(SecretStr(_pem(private)), created_at=T0)
    raw = private.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    assert signer.key_id == hashlib.sha256(raw).digest()[:16].hex() == key_id_for(raw)
    assert len(signer.key_id) == 32
    assert ReceiptSigner.from_pem(_pem(private).encode()).key_id == signer.key_id


@pytest.mark.parametrize("pem", ["not a pem", _pem(Ed448PrivateKey.generate())])
def test_signer_from_pem_rejects_other_keys_without_echoing_them(pem):
    with pytest.raises(ValueError) as failure:
        ReceiptSigner.from_pem(SecretStr(pem))
    assert "PRIVATE KEY" not in str(failure.value)


def test_public_key_document_shape():
    current = ReceiptSigner.generate(created_at=T0)
    retired = ReceiptSigner.generate(created_at=T0 - timedelta(days=90)).public_key
    document = public_key_document([current, retired])
    assert document == {
        "keys": [
            {
                "key_id": current.key_id,
                "algorithm": "Ed25519",
                "public_key": base64.b64encode(current.public_key.raw).decode(),
                "created_at": "2026-11-29T12:00:00.000Z",
            },
            retired.document_entry(),
        ]
    }
    assert len(base64.b64decode(document["keys"][0]["public_key"])) == 32
    with pytest.raises(ValueError):
        public_key_document([current, current.public_key])
    with pytest.raises(ValueError):
        ReceiptPublicKey(b"short", "2026-01-01T00:00:00.000Z")


# --- signing, tree heads, serving --------------------------------------------------------------


def test_sign_receipt_signs_canonical_body():
    signer = ReceiptSigner.generate()
    receipt = body()
    signed = sign_receipt(receipt, signer)
    assert signed["signature"]["key_id"] == signer.key_id
    assert signed["signature"]["algorithm"] == "Ed25519"
    public = Ed25519PublicKey.from_public_bytes(signer.public_key.raw)
    public.verify(base64.b64decode(signed["signature"]["value"]), canonical_json(receipt))
    assert audit_leaf_data(signed) == canonical_json(
        {"receipt": receipt, "signature": signed["signature"]}
    )
    assert audit_leaf_hash(signed) == merkle.leaf_hash(audit_leaf_data(signed))
    with pytest.raises(ValueError):
        sign_receipt({"schema": "something-else"}, signer)


def test_tree_head_signature_covers_size_root_timestamp_and_key():
    signer = ReceiptSigner.generate()
    root = hashlib.sha256(b"root").digest()
    head = sign_tree_head(5, root, T0, signer)
    assert set(head) == {"tree_size", "root_hash", "timestamp", "key_id", "signature"}
    message = canonical_json(
        {
            "tree_size": 5,
            "root_hash": root.hex(),
            "timestamp": "2026-11-29T12:00:00.000Z",
            "key_id": signer.key_id,
        }
    )
    Ed25519PublicKey.from_public_bytes(signer.public_key.raw).verify(
        base64.b64decode(head["signature"]), message
    )
    with pytest.raises(ValueError):
        sign_tree_head(-1, root, T0, signer)
    with pytest.raises(ValueError):
        sign_tree_head(5, root[:31], T0, signer)


def test_serve_receipt_rejects_a_wrong_index_or_heads_out_of_order():
    signer = ReceiptSigner.generate()
    signed = [sign_receipt(body(receipt_id=f"r-{i}"), signer) for i in range(3)]
    leaves = [audit_leaf_hash(s) for s in signed]
    head2 = sign_tree_head(2, merkle.root_hash(2, leaves), T0, signer)
    head3 = sign_tree_head(3, merkle.root_hash(3, leaves), T0, signer)
    served = serve_receipt(signed[1], 1, head2, head3, leaves)
    assert served["audit"]["inclusion_proof"] == [
        h.hex() for h in merkle.inclusion_proof(1, 3, leaves)
    ]
    assert served["audit"]["consistency_proof"] == [
        h.hex() for h in merkle.consistency_proof(2, 3, leaves)
    ]
    with pytest.raises(ValueError, match="not this receipt"):
        serve_receipt(signed[1], 0, head2, head3, leaves)
    with pytest.raises(ValueError, match="not in the tree head at issue"):
        serve_receipt(signed[2], 2, head2, head3, leaves)
    with pytest.raises(ValueError, match="older"):
        serve_receipt(signed[1], 1, head3, head2, leaves)
