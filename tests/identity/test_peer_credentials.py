"""Peer credentials (``identity.node_credentials``): bound to one holder and one request body, never a key-service credential."""

from __future__ import annotations

import hashlib
import time

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from identity.node_credentials import (
    CredentialError,
    issue_node_credential,
    issue_peer_credential,
    verify_node_credential,
    verify_peer_credential,
)
from identity.signing import key_id

KEY = Ed25519PrivateKey.generate()
DIGEST = hashlib.sha256(b'{"namespace": "ns"}').hexdigest()


def test_a_peer_credential_is_accepted_by_its_holder_for_its_body_only():
    token = issue_peer_credential(KEY, "node-a", "node-b", DIGEST)
    verify_peer_credential(token, KEY.public_key(), "node-a", "node-b", DIGEST)
    with pytest.raises(CredentialError):
        verify_peer_credential(token, KEY.public_key(), "node-a", "node-c", DIGEST)
    with pytest.raises(CredentialError, match="another request body"):
        verify_peer_credential(token, KEY.public_key(), "node-a", "node-b", "00" * 32)
    with pytest.raises(CredentialError, match="names another node"):
        verify_peer_credential(token, KEY.public_key(), "node-x", "node-b", DIGEST)
    with pytest.raises(CredentialError):
        verify_peer_credential(
            token, Ed25519PrivateKey.generate().public_key(), "node-a", "node-b", DIGEST
        )


def test_peer_and_key_service_credentials_are_not_interchangeable():
    with pytest.raises(CredentialError):
        verify_node_credential(
            issue_peer_credential(KEY, "node-a", "node-b", DIGEST), KEY.public_key(), "node-a"
        )
    with pytest.raises(CredentialError):
        verify_peer_credential(
            issue_node_credential(KEY, "node-a"), KEY.public_key(), "node-a", "node-b", DIGEST
        )


def test_an_expired_or_overlong_peer_credential_is_refused():
    now = int(time.time())
    headers = {"kid": key_id(KEY.public_key())}
    base = {"iss": "kvledger-node", "sub": "node-a", "aud": "kvledger-peer:node-b", "req": DIGEST}
    expired = jwt.encode(
        base | {"iat": now - 120, "exp": now - 60}, KEY, algorithm="EdDSA", headers=headers
    )
    with pytest.raises(CredentialError) as refused:
        verify_peer_credential(expired, KEY.public_key(), "node-a", "node-b", DIGEST)
    assert refused.value.code == "token_expired"
    overlong = jwt.encode(
        base | {"iat": now, "exp": now + 3600}, KEY, algorithm="EdDSA", headers=headers
    )
    with pytest.raises(CredentialError, match="at most"):
        verify_peer_credential(overlong, KEY.public_key(), "node-a", "node-b", DIGEST)
    with pytest.raises(ValueError):
        issue_peer_credential(KEY, "node-a", "node-b", DIGEST, ttl_s=3600)
