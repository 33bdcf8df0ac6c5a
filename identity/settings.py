"""How the tokens of one issuer are verified (pydantic settings group).

A deployment has two issuers: the customer's identity provider for end users
and the operator issuer for people who run the platform. Both use this model;
keeping them in separate groups (``auth`` and ``operator_auth``) and refusing
one key for both is what stops an end user's token from acting as an operator.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, model_validator

AsymmetricAlgorithm = Literal["EdDSA", "ES256", "RS256"]
ALL_ASYMMETRIC_ALGORITHMS: tuple[AsymmetricAlgorithm, ...] = ("EdDSA", "ES256", "RS256")
JWT_SECRET_ENV = "KVLEDGER_JWT_SECRET"
"""The stack-wide HS256 secret of end-user tokens, read when the ``auth`` issuer names no key."""


class IssuerSettings(BaseModel):
    """Keys and checks for one token issuer. At most one key source may be set.

    * ``jwks_url`` / ``jwks_file`` — a JWKS document (production). Keys are chosen by
      the token's ``kid``; ``algorithms`` is the allow-list and a token's ``alg`` must
      also match its key's type and curve. The document is cached ``jwks_cache_ttl_s``
      and refetched when a token names an unknown ``kid`` (key rotation), at most once
      per ``jwks_refetch_interval_s`` so that made-up ``kid`` values cannot flood the issuer.
    * ``jwt_public_key_file`` — one Ed25519 public key (PEM); tokens use EdDSA.
    * ``jwt_secret`` — an HS256 shared secret: for the dev stack and tests only, because
      everyone who can verify such a token can also mint one.

    ``issuer`` and ``audience``, when set, must match the token's ``iss`` and ``aud``.
    """

    jwt_secret: SecretStr | None = None
    jwt_public_key_file: Path | None = None
    jwks_file: Path | None = None
    jwks_url: str | None = None
    algorithms: list[AsymmetricAlgorithm] = Field(
        default_factory=lambda: list(ALL_ASYMMETRIC_ALGORITHMS), min_length=1
    )
    issuer: str | None = None
    audience: str | None = None
    leeway_s: float = Field(5.0, ge=0)
    jwks_cache_ttl_s: float = Field(300.0, gt=0)
    jwks_refetch_interval_s: float = Field(30.0, ge=0)
    jwks_fetch_timeout_s: float = Field(5.0, gt=0)

    @model_validator(mode="after")
    def _one_key_source(self) -> IssuerSettings:
        sources = [
            name
            for name in ("jwt_secret", "jwt_public_key_file", "jwks_file", "jwks_url")
            if getattr(self, name)
        ]
        if len(sources) > 1:
            raise ValueError(f"configure one key source per issuer, not {' and '.join(sources)}")
        if self.jwks_url is not None and not self.jwks_url.startswith(("https://", "http://")):
            raise ValueError("jwks_url must be an http(s) URL")
        return self

    @property
    def configured(self) -> bool:
        return any((self.jwt_secret, self.jwt_public_key_file, self.jwks_file, self.jwks_url))

    def shares_key_with(self, other: IssuerSettings, *, other_secret: str | None = None) -> bool:
        """Whether a token signed for ``other`` could verify here: same secret, key file, JWKS file or URL.

        ``other_secret`` is the secret ``other`` falls back to when it names none
        (the end-user issuer reads ``KVLEDGER_JWT_SECRET``).
        """
        if self.jwt_secret is not None:
            secrets = {
                other_secret,
                other.jwt_secret.get_secret_value() if other.jwt_secret else None,
            }
            if self.jwt_secret.get_secret_value() in secrets:
                return True
        if self.jwt_public_key_file is not None and other.jwt_public_key_file is not None:
            if _same_content(self.jwt_public_key_file, other.jwt_public_key_file):
                return True
        if self.jwks_file is not None and other.jwks_file is not None:
            if _same_content(self.jwks_file, other.jwks_file):
                return True
        return self.jwks_url is not None and self.jwks_url == other.jwks_url


def _same_content(a: Path, b: Path) -> bool:
    """Unreadable files compare unequal here; the verifier reports them when it loads them."""
    try:
        return Path(a).read_bytes().strip() == Path(b).read_bytes().strip()
    except OSError:
        return False
