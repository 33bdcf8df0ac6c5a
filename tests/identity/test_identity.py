"""identity: node key files, key ids, signed envelopes and node credentials."""

from __future__ import annotations

import hashlib
import time
import uuid
from datetime import UTC, datetime

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from events.codec import decode_event, encode_event
from events.schema import CommandAck, DocumentPredicate, Invalidate, TierEvidence, make_event
from identity.node_credentials import (
    KEYS_AUDIENCE,
    NODE_ISSUER,
    CredentialError,
    credential_key_id,
    issue_node_credential,
    verify_node_credential,
)
from identity.signing import (
    BAD_SIGNATURE,
    GOVERNANCE_CONTEXT,
    UNKNOWN_KEY,
    UNSIGNED,
    EnvelopeSigner,
    document_signature_problem,
    key_id,
    load_or_create_private_key,
    load_public_key_file,
    public_key_pem,
    raw_public_key,
    sign_document,
    sign_envelope,
    signature_problem,
    verify_envelope,
)


def _command():
    predicate = DocumentPredicate(tenant="acme", doc_id="handbook", below_version=2)
    return make_event(
        Invalidate(command_id=uuid.uuid4(), predicate=predicate, cutoff=datetime.now(UTC)),
        tenant_id="acme",
    )


def test_a_key_file_is_created_owner_only_once_and_reloaded(tmp_path):
    path = tmp_path / "deep" / "node_key.pem"
    created = load_or_create_private_key(path)
    assert path.stat().st_mode & 0o777 == 0o600
    again = load_or_create_private_key(path)
    assert raw_public_key(again.public_key()) == raw_public_key(created.public_key())


def test_key_id_is_the_first_16_bytes_of_sha256_of_the_raw_public_key():
    key = Ed25519PrivateKey.generate().public_key()
    assert key_id(key) == hashlib.sha256(raw_public_key(key)).digest()[:16].hex()
    assert len(key_id(key)) == 32


def test_a_public_key_file_must_hold_an_ed25519_public_key(tmp_path):
    key = Ed25519PrivateKey.generate()
    public = tmp_path / "key.pub"
    public.write_bytes(public_key_pem(key.public_key()))
    assert key_id(load_public_key_file(public)) == key_id(key.public_key())
    private = tmp_path / "key.pem"
    load_or_create_private_key(private)
    with pytest.raises(ValueError, match="not a PEM public key"):
        load_public_key_file(private)


def test_a_signed_envelope_verifies_after_encoding_and_decoding():
    key = Ed25519PrivateKey.generate()
    signed = sign_envelope(_command(), key)
    assert signed.signature is not None and signed.signature.kid == key_id(key.public_key())
    received = decode_event(encode_event(signed))
    assert verify_envelope(received, key.public_key())
    assert signature_problem(received, key.public_key()) is None


def test_tampered_unsigned_and_otherwise_signed_envelopes_are_refused():
    key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    signed = sign_envelope(_command(), key)
    widened = signed.payload.model_copy(
        update={"predicate": DocumentPredicate(tenant="acme", doc_id="handbook", below_version=99)}
    )
    tampered = signed.model_copy(update={"payload": widened})
    assert signature_problem(tampered, key.public_key()) == BAD_SIGNATURE
    assert signature_problem(_command(), key.public_key()) == UNSIGNED
    assert signature_problem(sign_envelope(_command(), other), key.public_key()) == UNKNOWN_KEY
    assert signature_problem(signed, None) == UNKNOWN_KEY
    # Someone else's signature relabelled with this key's id is still not this key's.
    forged = sign_envelope(_command(), other)
    relabelled = forged.model_copy(
        update={"signature": forged.signature.model_copy(update={"kid": key_id(key.public_key())})}
    )
    assert signature_problem(relabelled, key.public_key()) == BAD_SIGNATURE


def test_a_relabelled_ack_no_longer_verifies():
    key = Ed25519PrivateKey.generate()
    evidence = [
        TierEvidence(
            tier="device",
            removed=0,
            block_hashes=[],
            method="overwrite",
            post_check="readback_zero",
            verified=True,
        )
    ]
    ack = sign_envelope(
        make_event(
            CommandAck(command_id=uuid.uuid4(), node_id="node-1", epoch=1, evidence=evidence)
        ),
        key,
    )
    relabelled = ack.model_copy(
        update={"payload": ack.payload.model_copy(update={"node_id": "node-2"})}
    )
    assert verify_envelope(ack, key.public_key()) and not verify_envelope(
        relabelled, key.public_key()
    )


def test_unsigned_envelopes_encode_as_before_and_the_signer_is_the_key_bound():
    unsigned = _command()
    assert b"signature" not in encode_event(unsigned)
    signer = EnvelopeSigner(Ed25519PrivateKey.generate())
    assert signer(unsigned).signature.kid == signer.key_id


def test_node_credentials_name_the_node_and_its_key():
    key = Ed25519PrivateKey.generate()
    token = issue_node_credential(key, "node-1", ttl_s=30)
    assert credential_key_id(token) == key_id(key.public_key())
    verify_node_credential(token, key.public_key(), "node-1")
    with pytest.raises(CredentialError, match="another node"):
        verify_node_credential(token, key.public_key(), "node-2")
    with pytest.raises(CredentialError) as wrong_key:
        verify_node_credential(token, Ed25519PrivateKey.generate().public_key(), "node-1")
    assert wrong_key.value.code == "invalid_token"


def test_node_credentials_are_short_lived():
    key = Ed25519PrivateKey.generate()
    with pytest.raises(ValueError, match="1..60"):
        issue_node_credential(key, "node-1", ttl_s=61)
    now = int(time.time())
    headers = {"kid": key_id(key.public_key())}
    claims = {"iss": NODE_ISSUER, "sub": "node-1", "aud": KEYS_AUDIENCE}
    long_lived = jwt.encode(
        {**claims, "iat": now, "exp": now + 3600}, key, algorithm="EdDSA", headers=headers
    )
    with pytest.raises(CredentialError, match="at most 60"):
        verify_node_credential(long_lived, key.public_key(), "node-1")
    expired = jwt.encode(
        {**claims, "iat": now - 120, "exp": now - 60}, key, algorithm="EdDSA", headers=headers
    )
    with pytest.raises(CredentialError) as raised:
        verify_node_credential(expired, key.public_key(), "node-1")
    assert raised.value.code == "token_expired"
    for missing in ("iss", "aud", "exp"):
        partial = {**claims, "iat": now, "exp": now + 30}
        del partial[missing]
        with pytest.raises(CredentialError):
            verify_node_credential(
                jwt.encode(partial, key, algorithm="EdDSA", headers=headers),
                key.public_key(),
                "node-1",
            )


def test_a_shared_secret_token_is_not_a_node_credential():
    token = jwt.encode({"sub": "node-1", "roles": ["node"]}, "x" * 32, algorithm="HS256")
    with pytest.raises(CredentialError) as raised:
        credential_key_id(token)
    assert raised.value.code == "invalid_token"
    with pytest.raises(CredentialError):
        credential_key_id("not a jwt")


def test_a_signed_document_verifies_only_unchanged_under_its_key_and_context():
    key = Ed25519PrivateKey.generate()
    document = {
        "node_id": "node-1",
        "nonce": "n" * 24,
        "decisions": [{"predicate": {"kind": "namespace", "ns": "a"}}],
        "limit": 2**53 - 1,
    }
    signature = sign_document(document, key, GOVERNANCE_CONTEXT)
    assert (
        document_signature_problem(dict(document), signature, key.public_key(), GOVERNANCE_CONTEXT)
        is None
    )
    assert (
        document_signature_problem(
            document | {"decisions": []}, signature, key.public_key(), GOVERNANCE_CONTEXT
        )
        == BAD_SIGNATURE
    )
    assert (
        document_signature_problem(document, signature, key.public_key(), b"another context\x00")
        == BAD_SIGNATURE
    )
    assert (
        document_signature_problem(
            document, signature, Ed25519PrivateKey.generate().public_key(), GOVERNANCE_CONTEXT
        )
        == UNKNOWN_KEY
    )
    assert (
        document_signature_problem(document, None, key.public_key(), GOVERNANCE_CONTEXT) == UNSIGNED
    )
    garbled = {"kid": signature["kid"], "sig": "%%%"}
    assert (
        document_signature_problem(document, garbled, key.public_key(), GOVERNANCE_CONTEXT)
        == BAD_SIGNATURE
    )
    # A signed envelope's signature never passes for a document with the same content, nor the
    # reverse.
    envelope = sign_envelope(_command(), key)
    as_document = envelope.model_dump(mode="json", exclude={"signature"})
    assert (
        document_signature_problem(
            as_document, envelope.signature.model_dump(), key.public_key(), GOVERNANCE_CONTEXT
        )
        == BAD_SIGNATURE
    )
