"""Who may call the coordinator API (see docs/security.md, "Identities and roles").

Callers are operators with a token of the *operator* issuer
(``CoordinatorSettings.operator_auth``), never end users. ``tenant-admin``,
``privacy-officer`` and ``auditor`` act only inside the tenant of their token;
``platform-admin`` acts on every tenant and on what belongs to none. A
tenant-bound operator asking about anything outside its tenant gets
:class:`TenantForbiddenError` — the same answer whether the thing exists in
another tenant or not, so the API is no oracle for other tenants' ids or subjects.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Request

from coordinator.http import ApiError
from identity.tokens import AuthError, Operator, TokenVerifier


class ForbiddenError(ApiError):
    """A verified caller who may not do this (HTTP 403)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(403, "permission_error", code, message)


class TenantForbiddenError(ForbiddenError):
    """A tenant-bound operator reaching outside its tenant, or for something that may lie outside
    it."""

    def __init__(self) -> None:
        super().__init__("tenant_forbidden", "operators act only inside the tenant of their token")


def authorize(
    verifier: TokenVerifier, authorization: str | None, allowed: frozenset[str]
) -> Operator:
    """Verify the ``Authorization`` header and check the caller holds one of ``allowed`` roles.

    Raises :class:`identity.tokens.AuthError` (401) or :class:`ForbiddenError` (403).
    """
    scheme, _, token = (authorization or "").partition(" ")
    if authorization and scheme.lower() != "bearer":
        raise AuthError("invalid_token", "Authorization header must be 'Bearer <token>'")
    operator = verifier.verify_operator(token.strip() or None)
    if not operator.roles & allowed:
        raise ForbiddenError(
            "insufficient_role", f"requires one of the roles: {', '.join(sorted(allowed))}"
        )
    return operator


def require_tenant(operator: Operator, tenant_id: str | None) -> None:
    """Raise :class:`TenantForbiddenError` unless ``operator`` may act on ``tenant_id`` (None: no
    tenant)."""
    if not operator.may_act_on(tenant_id):
        raise TenantForbiddenError()


def requires(allowed: frozenset[str]) -> Callable[[Request], Operator]:
    """A FastAPI dependency: the calling operator, who must hold one of ``allowed`` roles.

    A plain function, so FastAPI runs it in its thread pool: verifying may fetch
    the operator issuer's JWKS over the network and must not stall the event loop.
    """

    def operator(request: Request) -> Operator:
        return authorize(
            request.app.state.operator_verifier, request.headers.get("authorization"), allowed
        )

    return operator
