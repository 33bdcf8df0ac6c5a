"""Bearer JWT → :class:`Principal` (end users) or :class:`Operator` (people who run the platform).

The principal is the *only* input to the scope salt of a cache key, so this
module is the trust boundary of cache isolation: a malformed claim is refused
outright rather than defaulted. A token never picks its own verification method:
each verifier has one key source (an HS256 secret, one Ed25519 key, or a JWKS
document) and an algorithm allow-list, and with a JWKS the token's ``alg`` must
also be the one its key's type and curve imply (no ``alg`` confusion between an
HMAC secret and a public key, no ``none``).

End-user and operator tokens come from different issuers with different keys
(``identity.settings.IssuerSettings``). :func:`principal_from_claims` reads no
roles at all, so an end-user token that claims ``platform-admin`` is still
just an end user; only :func:`operator_from_claims`, fed by the operator
issuer's verifier, reads roles.

End-user claims::

    sub     str, required          subject (user-scope isolation)
    tenant  str, required          tenant (tenant-scope isolation)
    exp     int, required          expiry; tokens never live forever
    scopes  list[str]              auth scopes the caller may read (documents)
    pv      int | {scope: int}     policy version(s) the token was issued under

Operator tokens carry ``sub``, ``tenant``, ``exp`` and ``roles`` (list) or ``role`` (str).
Every string claim is 1..256 characters without control characters and not blank; every
version an integer in 0..2^53−1.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ec import SECP256R1, EllipticCurvePrivateKey
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPrivateKey

from events.schema import MAX_ID_CHARS, MAX_SAFE_INT, check_identifier
from identity.roles import PLATFORM_ADMIN
from identity.settings import JWT_SECRET_ENV, IssuerSettings

log = logging.getLogger(__name__)

# RFC 7518 §3.2: an HS256 key must be at least as long as the hash output.
MIN_SECRET_BYTES = 32
MAX_CLAIM_CHARS = MAX_ID_CHARS
MAX_CLAIM_ITEMS = 256
MAX_VERSION = MAX_SAFE_INT
"""The largest policy version a token may carry: the event contract's (``events.schema.Count``), so
every version a token holds is one a ``PermissionRevoked`` can name, the ledger can store and the
node's key derivation can pack."""

_REQUIRED_CLAIMS = ("exp", "sub", "tenant")

# A JWK's type and curve imply exactly one of the allowed algorithms.
_JWK_ALGORITHM: dict[tuple[str | None, str | None], str] = {
    ("OKP", "Ed25519"): "EdDSA",
    ("EC", "P-256"): "ES256",
    ("RSA", None): "RS256",
}


class AuthError(ValueError):
    """A bearer token was missing, malformed, wrongly signed or expired (HTTP 401).

    ``code`` is machine-readable and ends up in the error body.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class Principal:
    """An end user, as established by a *verified* token. Never built from request bodies.

    ``policy_versions`` maps an auth scope to the policy version the token was
    issued under; ``default_policy_version`` covers tokens that carry a single
    integer ``pv`` claim. It has no roles: an end user holds no operator power.
    """

    tenant_id: str
    subject_id: str
    scopes: frozenset[str] = frozenset()
    policy_versions: Mapping[str, int] = field(default_factory=dict)
    default_policy_version: int = 0

    def policy_version(self, auth_scope: str) -> int:
        return self.policy_versions.get(auth_scope, self.default_policy_version)

    def holds(self, auth_scope: str) -> bool:
        return auth_scope in self.scopes


@dataclass(frozen=True, slots=True)
class Operator:
    """A person operating the platform, from a token of the operator issuer."""

    tenant_id: str
    subject_id: str
    roles: frozenset[str]

    @property
    def is_platform_admin(self) -> bool:
        return PLATFORM_ADMIN in self.roles

    def may_act_on(self, tenant_id: str | None) -> bool:
        """A platform admin acts on every tenant and on what has none; everyone else only on their
        own."""
        return self.is_platform_admin or (tenant_id is not None and tenant_id == self.tenant_id)


def _secret_bytes(secret: str) -> bytes:
    data = secret.encode()
    if len(data) < MIN_SECRET_BYTES:
        raise ValueError(
            f"JWT secret must be at least {MIN_SECRET_BYTES} bytes for HS256 (RFC 7518 §3.2)"
        )
    return data


def load_ed25519_public_key(path: Path) -> Ed25519PublicKey:
    key = serialization.load_pem_public_key(Path(path).read_bytes())
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"{path} does not hold an Ed25519 public key")
    return key


def generate_ed25519_key_pair() -> tuple[bytes, bytes]:
    """A new Ed25519 key pair as (private PKCS#8 PEM, public SubjectPublicKeyInfo PEM)."""
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return private_pem, public_pem


@dataclass(frozen=True, slots=True)
class JwksKey:
    """A verification key of a JWKS document and the one algorithm its type and curve imply."""

    key: Any
    algorithm: str


class JwksKeys:
    """The keys of a JWKS document (file or URL), by ``kid``; thread-safe.

    Cached for ``ttl_s``; a ``kid`` not in the cache triggers one refetch, at most
    every ``refetch_interval_s``, which is how a rotated-in key is picked up.
    When a refetch fails the keys already known stay in use (an IdP outage
    should not log everyone out) and the failure is logged.
    """

    def __init__(self, settings: IssuerSettings) -> None:
        assert settings.jwks_file is not None or settings.jwks_url is not None, (
            "JwksKeys needs a JWKS source"
        )
        self._file = settings.jwks_file
        self._url = settings.jwks_url
        self._ttl_s = settings.jwks_cache_ttl_s
        self._refetch_interval_s = settings.jwks_refetch_interval_s
        self._timeout_s = settings.jwks_fetch_timeout_s
        self._lock = threading.Lock()
        self._keys: dict[str, JwksKey] = {}
        self._fetched_at: float | None = None
        self._refresh()
        if not self._keys:
            raise ValueError(f"the JWKS at {self._source} holds no usable signing key with a kid")

    @property
    def _source(self) -> str:
        return str(self._url or self._file)

    def key(self, kid: str) -> JwksKey | None:
        """The key named ``kid``, refetching the document if it is stale or lacks it; None if still
        unknown."""
        with self._lock:
            assert self._fetched_at is not None, "fetched at construction"
            age_s = time.monotonic() - self._fetched_at
            if age_s >= self._ttl_s or (
                kid not in self._keys and age_s >= self._refetch_interval_s
            ):
                self._refresh()
            return self._keys.get(kid)

    def _refresh(self) -> None:
        self._fetched_at = time.monotonic()
        try:
            document = self._fetch()
        except (OSError, ValueError, httpx.HTTPError) as exc:
            if not self._keys:
                raise ValueError(
                    f"cannot load the JWKS at {self._source}: {type(exc).__name__}: {exc}"
                ) from None
            log.warning(
                "JWKS refetch from %s failed (%s); keeping %d known keys",
                self._source,
                type(exc).__name__,
                len(self._keys),
            )
            return
        keys: dict[str, JwksKey] = {}
        for entry in document.get("keys", []) if isinstance(document, dict) else []:
            if (
                not isinstance(entry, dict)
                or not isinstance(entry.get("kid"), str)
                or entry.get("use", "sig") != "sig"
            ):
                continue
            curve = entry.get("crv") if entry.get("kty") != "RSA" else None
            algorithm = _JWK_ALGORITHM.get((entry.get("kty"), curve))
            try:
                if algorithm is None or entry.get("alg", algorithm) != algorithm:
                    raise jwt.PyJWKError(
                        f"key type {entry.get('kty')!r} with alg {entry.get('alg')!r}"
                    )
                keys[entry["kid"]] = JwksKey(jwt.PyJWK(entry, algorithm).key, algorithm)
            except jwt.PyJWTError as exc:
                log.warning(
                    "JWKS at %s: key %r skipped (%s)",
                    self._source,
                    entry["kid"][:MAX_CLAIM_CHARS],
                    exc,
                )
        self._keys = keys

    def _fetch(self) -> Any:
        if self._url is not None:
            response = httpx.get(self._url, timeout=self._timeout_s, follow_redirects=False)
            response.raise_for_status()
            return response.json()
        assert self._file is not None
        return json.loads(Path(self._file).read_text())


class TokenVerifier:
    """Verifies bearer tokens of one issuer (:class:`IssuerSettings`).

    ``secret_env`` names an environment variable holding an HS256 secret to use
    when the settings name no key source: the end-user issuer of the dev stack
    passes :data:`JWT_SECRET_ENV`; the operator issuer passes nothing, so it
    never falls back to the end users' secret.
    """

    def __init__(
        self, settings: IssuerSettings, *, secret_env: str | None = JWT_SECRET_ENV
    ) -> None:
        self._issuer = settings.issuer
        self._audience = settings.audience
        self._leeway_s = settings.leeway_s
        self._allowed = frozenset(settings.algorithms)
        self._jwks: JwksKeys | None = None
        self._key: bytes | Ed25519PublicKey | None = None
        if settings.jwks_file is not None or settings.jwks_url is not None:
            self._jwks = JwksKeys(settings)
            return
        if settings.jwt_public_key_file is not None:
            if "EdDSA" not in self._allowed:
                raise ValueError(
                    "jwt_public_key_file holds an Ed25519 key but EdDSA is not in the algorithms allow-list"
                )
            self._key = load_ed25519_public_key(settings.jwt_public_key_file)
            self._algorithm = "EdDSA"
            return
        secret: str | None
        if settings.jwt_secret is not None:
            secret = settings.jwt_secret.get_secret_value()
        else:
            secret = os.environ.get(secret_env) if secret_env else None
        if not secret:
            hint = f", or {secret_env}" if secret_env else ""
            raise ValueError(
                f"no JWT key configured: set jwt_secret, jwt_public_key_file, jwks_file or jwks_url{hint}"
            )
        self._key = _secret_bytes(secret)
        self._algorithm = "HS256"

    def claims(self, bearer: str | None) -> dict[str, Any]:
        """Decode and check one token (the value after ``Bearer``); the verified claims."""
        if not bearer:
            raise AuthError(
                "missing_token", "missing bearer token: send 'Authorization: Bearer <JWT>'"
            )
        key, algorithm = self._key_for(bearer)
        require = list(_REQUIRED_CLAIMS) + ["iss"] * (self._issuer is not None)
        try:
            return jwt.decode(
                bearer,
                key,
                algorithms=[algorithm],
                audience=self._audience,
                issuer=self._issuer,
                leeway=self._leeway_s,
                options={"require": require, "verify_aud": self._audience is not None},
            )
        except jwt.ExpiredSignatureError:
            raise AuthError("token_expired", "bearer token has expired") from None
        except jwt.MissingRequiredClaimError as exc:
            raise AuthError(
                "invalid_token", f"bearer token lacks the required claim {exc.claim!r}"
            ) from None
        except jwt.InvalidTokenError as exc:
            raise AuthError("invalid_token", f"invalid bearer token: {exc}") from None

    def verify(self, bearer: str | None) -> Principal:
        """An end user's token → :class:`Principal` (roles, if any, are ignored)."""
        return principal_from_claims(self.claims(bearer))

    def verify_operator(self, bearer: str | None) -> Operator:
        """An operator issuer's token → :class:`Operator`."""
        return operator_from_claims(self.claims(bearer))

    def _key_for(self, bearer: str) -> tuple[Any, str]:
        try:
            header = jwt.get_unverified_header(bearer)
        except jwt.InvalidTokenError as exc:
            raise AuthError("invalid_token", f"invalid bearer token: {exc}") from None
        algorithm = header.get("alg")
        if self._jwks is None:
            assert self._key is not None
            if algorithm != self._algorithm:
                raise AuthError(
                    "invalid_token",
                    f"invalid bearer token: this issuer signs with {self._algorithm}",
                )
            return self._key, self._algorithm
        if algorithm not in self._allowed:
            raise AuthError(
                "invalid_token",
                f"invalid bearer token: algorithm not allowed (allowed: {', '.join(sorted(self._allowed))})",
            )
        kid = header.get("kid")
        if not isinstance(kid, str) or not kid:
            raise AuthError(
                "invalid_token", "invalid bearer token: the header names no key id (kid)"
            )
        jwk = self._jwks.key(kid)
        if jwk is None:
            raise AuthError("invalid_token", "invalid bearer token: unknown key id (kid)")
        if jwk.algorithm != algorithm:
            raise AuthError(
                "invalid_token", "invalid bearer token: the algorithm does not match the key"
            )
        return jwk.key, algorithm


def principal_from_claims(claims: Mapping) -> Principal:
    """Build a Principal from already-verified claims, refusing any malformed field. Roles are not
    read."""
    scopes = _string_list(claims.get("scopes", []), "scopes")
    pv = claims.get("pv", 0)
    policy_versions: dict[str, int] = {}
    default_policy_version = 0
    if _is_version(pv):
        default_policy_version = pv
    elif isinstance(pv, Mapping) and len(pv) <= MAX_CLAIM_ITEMS:
        for scope, version in pv.items():
            if not _is_identifier(scope) or not _is_version(version):
                raise AuthError(
                    "invalid_token",
                    f"claim 'pv' must map auth scopes to integers in 0..{MAX_VERSION}",
                )
            policy_versions[scope] = version
    else:
        raise AuthError(
            "invalid_token",
            f"claim 'pv' must be an integer in 0..{MAX_VERSION} or a map of auth scope to one",
        )
    return Principal(
        tenant_id=_identifier(claims.get("tenant"), "tenant"),
        subject_id=_identifier(claims.get("sub"), "sub"),
        scopes=frozenset(scopes),
        policy_versions=policy_versions,
        default_policy_version=default_policy_version,
    )


def operator_from_claims(claims: Mapping) -> Operator:
    """Build an Operator from claims the *operator* issuer's verifier checked."""
    if "roles" in claims:
        roles = _string_list(claims["roles"], "roles")
    elif "role" in claims:
        roles = _string_list([claims["role"]], "role")
    else:
        roles = []
    return Operator(
        tenant_id=_identifier(claims.get("tenant"), "tenant"),
        subject_id=_identifier(claims.get("sub"), "sub"),
        roles=frozenset(roles),
    )


def _is_version(value: object) -> bool:
    # bool is an int subclass; ``"pv": true`` is a malformed token, not version 1.
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_VERSION


def _is_identifier(value: object) -> bool:
    """An identifier the event contract accepts (:func:`events.schema.check_identifier`): claims end up
    in block provenance, kv-events and the ledger, so a token must carry none the contract would refuse."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_CLAIM_CHARS:
        return False
    try:
        check_identifier(value)
    except ValueError:
        return False
    return True


def _identifier(value: object, claim: str) -> str:
    if not _is_identifier(value):
        raise AuthError(
            "invalid_token",
            f"claim {claim!r} must be a string of 1..{MAX_CLAIM_CHARS} characters without control characters",
        )
    return value  # type: ignore[return-value]


def _string_list(value: object, claim: str) -> list[str]:
    if (
        not isinstance(value, list)
        or len(value) > MAX_CLAIM_ITEMS
        or not all(_is_identifier(item) for item in value)
    ):
        raise AuthError(
            "invalid_token",
            f"claim {claim!r} must be a list of at most {MAX_CLAIM_ITEMS} strings of 1..{MAX_CLAIM_CHARS} "
            "characters without control characters",
        )
    return value


def _signing_key(private_key_pem: bytes) -> tuple[Any, str]:
    key = serialization.load_pem_private_key(private_key_pem, password=None)
    if isinstance(key, Ed25519PrivateKey):
        return key, "EdDSA"
    if isinstance(key, EllipticCurvePrivateKey) and isinstance(key.curve, SECP256R1):
        return key, "ES256"
    if isinstance(key, RSAPrivateKey):
        return key, "RS256"
    raise ValueError("the private key must be Ed25519, EC P-256 or RSA")


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
    kid: str | None = None,
    issuer: str | None = None,
    audience: str | None = None,
    now: float | None = None,
) -> str:
    """Sign a token for local use (CLI, tests, the dev stack).

    HS256 with ``secret``, or with ``private_key_pem`` the algorithm its key implies
    (Ed25519 → EdDSA, EC P-256 → ES256, RSA → RS256); ``kid`` goes into the header.
    """
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
        "iat": issued_at,
        "exp": issued_at + ttl_s,
    }
    roles = list(roles)
    if roles:
        claims["roles"] = roles
    if issuer is not None:
        claims["iss"] = issuer
    if audience is not None:
        claims["aud"] = audience
    headers = {"kid": kid} if kid is not None else None
    if secret is not None:
        return jwt.encode(claims, _secret_bytes(secret), algorithm="HS256", headers=headers)
    assert private_key_pem is not None, "exactly one of secret or private_key_pem, checked above"
    key, algorithm = _signing_key(private_key_pem)
    return jwt.encode(claims, key, algorithm=algorithm, headers=headers)
