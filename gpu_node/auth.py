"""Bearer JWT → :class:`Principal`.

The principal is the *only* input to the scope salt of a cache key (DESIGN §2),
so this module is the trust boundary of cache isolation: a claim that is
malformed is refused outright rather than defaulted, and each verifier accepts
exactly one algorithm (HS256 with a shared secret, or EdDSA with an Ed25519
public key) so that a token can never pick its own verification method
(the classic ``alg`` confusion between an HMAC secret and a public key).

Claims::

    sub     str, required          subject (user-scope isolation)
    tenant  str, required          tenant (tenant-scope isolation)
    exp     int, required          expiry; tokens never live forever
    scopes  list[str]              auth scopes the caller may read (documents)
    pv      int | {scope: int}     policy version(s) the token was issued under
    roles   list[str]  or  role str
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from gpu_node.kv_cache_utils import Principal
from gpu_node.settings import AuthSettings

JWT_SECRET_ENV = "KVLEDGER_JWT_SECRET"

# RFC 7518 §3.2: an HS256 key must be at least as long as the hash output.
MIN_SECRET_BYTES = 32

_REQUIRED_CLAIMS = ("exp", "sub", "tenant")


class AuthError(ValueError):
    """A bearer token was missing, malformed, wrongly signed or expired (HTTP 401).

    ``code`` is machine-readable and ends up in the OpenAI error body.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _secret_bytes(secret: str) -> bytes:
    data = secret.encode()
    if len(data) < MIN_SECRET_BYTES:
        raise ValueError(f"JWT secret must be at least {MIN_SECRET_BYTES} bytes for HS256 (RFC 7518 §3.2)")
    return data


def load_ed25519_public_key(path: Path) -> Ed25519PublicKey:
    key = serialization.load_pem_public_key(Path(path).read_bytes())
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"{path} does not hold an Ed25519 public key")
    return key


def load_ed25519_private_key(pem: bytes) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(pem, password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError("the private key is not an Ed25519 key")
    return key


class TokenVerifier:
    """Verifies bearer tokens with the one key the node is configured with.

    Key resolution: ``settings.jwt_public_key_file`` (EdDSA) or
    ``settings.jwt_secret`` (HS256); with neither, the ``KVLEDGER_JWT_SECRET``
    environment variable. Configuring both is refused because it would be
    ambiguous which algorithm tokens must use.
    """

    def __init__(self, settings: AuthSettings) -> None:
        if settings.jwt_secret is not None and settings.jwt_public_key_file is not None:
            raise ValueError("configure either auth.jwt_secret or auth.jwt_public_key_file, not both")
        self._audience = settings.audience
        self._leeway_s = settings.leeway_s
        if settings.jwt_public_key_file is not None:
            self._key: bytes | Ed25519PublicKey = load_ed25519_public_key(settings.jwt_public_key_file)
            self._algorithm = "EdDSA"
            return
        if settings.jwt_secret is not None:
            secret = settings.jwt_secret.get_secret_value()
        else:
            secret = os.environ.get(JWT_SECRET_ENV)
        if not secret:
            raise ValueError(
                f"no JWT key configured: set auth.jwt_secret, auth.jwt_public_key_file or {JWT_SECRET_ENV}"
            )
        self._key = _secret_bytes(secret)
        self._algorithm = "HS256"

    @property
    def algorithm(self) -> str:
        return self._algorithm

    def verify(self, bearer: str | None) -> Principal:
        """Decode and check one token (the value after ``Bearer``)."""
        if not bearer:
            raise AuthError("missing_token", "missing bearer token: send 'Authorization: Bearer <JWT>'")
        try:
            claims = jwt.decode(
                bearer,
                self._key,
                algorithms=[self._algorithm],
                audience=self._audience,
                leeway=self._leeway_s,
                options={"require": list(_REQUIRED_CLAIMS), "verify_aud": self._audience is not None},
            )
        except jwt.ExpiredSignatureError:
            raise AuthError("token_expired", "bearer token has expired") from None
        except jwt.MissingRequiredClaimError as exc:
            raise AuthError("invalid_token", f"bearer token lacks the required claim {exc.claim!r}") from None
        except jwt.InvalidTokenError as exc:
            raise AuthError("invalid_token", f"invalid bearer token: {exc}") from None
        return principal_from_claims(claims)


def principal_from_claims(claims: Mapping) -> Principal:
    """Build a Principal from already-verified claims, refusing any malformed field."""
    tenant = claims.get("tenant")
    subject = claims.get("sub")
    if not isinstance(tenant, str) or not tenant:
        raise AuthError("invalid_token", "claim 'tenant' must be a non-empty string")
    if not isinstance(subject, str) or not subject:
        raise AuthError("invalid_token", "claim 'sub' must be a non-empty string")
    scopes = _string_list(claims.get("scopes", []), "scopes")

    pv = claims.get("pv", 0)
    policy_versions: dict[str, int] = {}
    default_policy_version = 0
    if _is_int(pv):
        default_policy_version = pv
    elif isinstance(pv, Mapping):
        for scope, version in pv.items():
            if not isinstance(scope, str) or not _is_int(version):
                raise AuthError("invalid_token", "claim 'pv' must map auth scopes to integer versions")
            policy_versions[scope] = version
    else:
        raise AuthError("invalid_token", "claim 'pv' must be an integer or a map of auth scope to integer")

    if "roles" in claims:
        roles = _string_list(claims["roles"], "roles")
    elif "role" in claims:
        roles = _string_list([claims["role"]], "role")
    else:
        roles = []

    return Principal(
        tenant_id=tenant,
        subject_id=subject,
        scopes=frozenset(scopes),
        policy_versions=policy_versions,
        default_policy_version=default_policy_version,
        roles=frozenset(roles),
    )


def _is_int(value: object) -> bool:
    # bool is an int subclass; ``"pv": true`` is a malformed token, not version 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _string_list(value: object, claim: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise AuthError("invalid_token", f"claim {claim!r} must be a list of non-empty strings")
    return value


def issue_token(
    *,
    tenant: str,
    sub: str,
    scopes: Iterable[str] = (),
    pv: int | Mapping[str, int] = 0,
    roles: Iterable[str] = (),
    ttl_s: int = 3600,
    secret: str | None = None,
    private_key_pem: bytes | None = None,
    audience: str | None = None,
    now: float | None = None,
) -> str:
    """Sign a token for local use (CLI, tests, the dev stack): HS256 with ``secret`` or EdDSA with an Ed25519 key."""
    if (secret is None) == (private_key_pem is None):
        raise ValueError("pass exactly one of secret or private_key_pem")
    if ttl_s <= 0:
        raise ValueError("ttl_s must be positive")
    issued_at = int(time.time() if now is None else now)
    claims: dict = {
        "sub": sub,
        "tenant": tenant,
        "scopes": list(scopes),
        "pv": pv if isinstance(pv, int) else dict(pv),
        "roles": list(roles),
        "iat": issued_at,
        "exp": issued_at + ttl_s,
    }
    if audience is not None:
        claims["aud"] = audience
    if secret is not None:
        return jwt.encode(claims, _secret_bytes(secret), algorithm="HS256")
    return jwt.encode(claims, load_ed25519_private_key(private_key_pem), algorithm="EdDSA")
