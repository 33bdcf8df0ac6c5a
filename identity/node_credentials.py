"""The credential a node presents to the coordinator's key service: a short-lived EdDSA JWT.

Only the holder of an enrolled node key can make one: it is signed with the node's
own Ed25519 key (header ``kid`` = :func:`identity.signing.key_id`), names the node
(``sub``), this purpose (``iss`` ``kvledger-node``, ``aud`` ``kvledger-keys``) and
lives at most :data:`MAX_TTL_S` seconds. The coordinator looks the ``kid`` up in its
enrollment registry and accepts the token only for the node id that key is enrolled
for — so no shared secret exists that could mint a node's credential, and no
end-user or operator token, whatever roles it claims, is one.

A *peer credential* (:func:`issue_peer_credential`) is the same kind of token for one
node-to-node request (``gpu_node.cache.peers``): its audience names the holder it is for
(``kvledger-peer:<node id>``) and its claim ``req`` the sha256 of the request body, so
the holder that receives it can neither present it to the key service nor to another
node, nor attach it to another request.
"""

from __future__ import annotations

import time

import jwt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from identity.signing import key_id

NODE_ISSUER = "kvledger-node"
KEYS_AUDIENCE = "kvledger-keys"
PEER_AUDIENCE_PREFIX = "kvledger-peer:"
"""A peer credential's audience is this prefix and the holder's node id: it is accepted by that one
node only, and never by the key service (whose audience is :data:`KEYS_AUDIENCE`), so a holder
cannot replay it there."""
MAX_TTL_S = 60
DEFAULT_TTL_S = 30
ALGORITHM = "EdDSA"
_REQUIRED_CLAIMS = ["iss", "sub", "aud", "iat", "exp"]


class CredentialError(ValueError):
    """A node credential that is malformed, wrongly signed, expired or not for this purpose; ``code`` is machine-readable."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def issue_node_credential(
    private_key: Ed25519PrivateKey, node_id: str, ttl_s: int = DEFAULT_TTL_S
) -> str:
    """A fresh credential for ``node_id`` signed with its key; ValueError for a lifetime outside 1..60 s."""
    if not 0 < ttl_s <= MAX_TTL_S:
        raise ValueError(f"a node credential lives 1..{MAX_TTL_S} s, got {ttl_s}")
    now = int(time.time())
    claims = {
        "iss": NODE_ISSUER,
        "sub": node_id,
        "aud": KEYS_AUDIENCE,
        "iat": now,
        "exp": now + ttl_s,
    }
    return jwt.encode(
        claims, private_key, algorithm=ALGORITHM, headers={"kid": key_id(private_key.public_key())}
    )


def credential_key_id(token: str) -> str:
    """The ``kid`` a credential names, read before its signature is checked (to find the key to check it with)."""
    try:
        header = jwt.get_unverified_header(token)
    except jwt.PyJWTError:
        raise CredentialError("invalid_token", "the bearer token is not a JWT") from None
    kid = header.get("kid")
    if header.get("alg") != ALGORITHM or not isinstance(kid, str):
        raise CredentialError("invalid_token", "not a node credential (EdDSA with a key id)")
    return kid


def issue_peer_credential(
    private_key: Ed25519PrivateKey,
    node_id: str,
    holder_id: str,
    body_sha256: str,
    ttl_s: int = DEFAULT_TTL_S,
) -> str:
    """A credential for one node-to-node request: ``node_id`` asks ``holder_id`` for the body whose
    sha256 is ``body_sha256``.

    Bound to the holder (audience) and to the request body (claim ``req``), so it can
    neither be presented to another node nor carry another request.
    """
    if not 0 < ttl_s <= MAX_TTL_S:
        raise ValueError(f"a node credential lives 1..{MAX_TTL_S} s, got {ttl_s}")
    now = int(time.time())
    claims = {
        "iss": NODE_ISSUER,
        "sub": node_id,
        "aud": PEER_AUDIENCE_PREFIX + holder_id,
        "iat": now,
        "exp": now + ttl_s,
        "req": body_sha256,
    }
    return jwt.encode(
        claims, private_key, algorithm=ALGORITHM, headers={"kid": key_id(private_key.public_key())}
    )


def verify_peer_credential(
    token: str,
    public_key: Ed25519PublicKey,
    node_id: str,
    holder_id: str,
    body_sha256: str,
    leeway_s: float = 5.0,
) -> None:
    """Check ``token`` is a live peer credential of ``node_id`` for this holder and this request body; CredentialError otherwise."""
    claims = _verified_claims(
        token, public_key, node_id, PEER_AUDIENCE_PREFIX + holder_id, leeway_s
    )
    if claims.get("req") != body_sha256:
        raise CredentialError(
            "invalid_token", "the peer credential was made for another request body"
        )


def verify_node_credential(
    token: str, public_key: Ed25519PublicKey, node_id: str, leeway_s: float = 5.0
) -> None:
    """Check ``token`` is a live credential signed by ``public_key`` for ``node_id``; CredentialError otherwise."""
    _verified_claims(token, public_key, node_id, KEYS_AUDIENCE, leeway_s)


def _verified_claims(
    token: str, public_key: Ed25519PublicKey, node_id: str, audience: str, leeway_s: float
) -> dict:
    try:
        claims = jwt.decode(
            token,
            public_key,
            algorithms=[ALGORITHM],
            audience=audience,
            issuer=NODE_ISSUER,
            leeway=leeway_s,
            options={"require": _REQUIRED_CLAIMS},
        )
    except jwt.ExpiredSignatureError:
        raise CredentialError("token_expired", "the node credential has expired") from None
    except jwt.PyJWTError:
        raise CredentialError("invalid_token", "the node credential is invalid") from None
    if claims["sub"] != node_id:
        raise CredentialError(
            "invalid_token", "the node credential names another node than its key is enrolled for"
        )
    issued_at, expires_at = claims["iat"], claims["exp"]
    if not isinstance(issued_at, int | float) or expires_at - issued_at > MAX_TTL_S:
        raise CredentialError("invalid_token", f"a node credential may live at most {MAX_TTL_S} s")
    if issued_at > time.time() + leeway_s:
        raise CredentialError("invalid_token", "the node credential is issued in the future")
    return claims
