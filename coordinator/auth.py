"""Role checks for the coordinator API (DESIGN §6).

Tokens are the stack's one JWT format (``kvledger token --role …``), verified by
the same :class:`gpu_node.auth.TokenVerifier` the nodes use, so both sides agree on
algorithms, required claims and key handling. Here only the roles matter:
``admin`` may do everything; ``privacy-officer`` and ``auditor`` read the ledger.
``node`` is the GPU nodes' own role and the only one that may fetch data keys
(``coordinator.keys_api``): raw keys unseal tenant and user data, and no person
needs them, so not even ``admin`` gets them.
"""

from __future__ import annotations

from gpu_node.auth import AuthError, TokenVerifier
from gpu_node.kv_cache_utils import Principal

ADMIN = "admin"
PRIVACY_OFFICER = "privacy-officer"
AUDITOR = "auditor"
NODE = "node"
LEDGER_READERS = frozenset({ADMIN, PRIVACY_OFFICER, AUDITOR})
KEY_CLIENTS = frozenset({NODE})


class ForbiddenError(Exception):
    """A verified caller without a role the endpoint requires (HTTP 403)."""

    def __init__(self, allowed: frozenset[str]) -> None:
        self.code = "insufficient_role"
        self.message = f"requires one of the roles: {', '.join(sorted(allowed))}"
        super().__init__(self.message)


def authorize(verifier: TokenVerifier, authorization: str | None, allowed: frozenset[str]) -> Principal:
    """Verify the ``Authorization`` header and check the caller holds one of ``allowed`` roles.

    Raises :class:`gpu_node.auth.AuthError` (401) or :class:`ForbiddenError` (403).
    """
    scheme, _, token = (authorization or "").partition(" ")
    if authorization and scheme.lower() != "bearer":
        raise AuthError("invalid_token", "Authorization header must be 'Bearer <token>'")
    principal = verifier.verify(token.strip() or None)
    if not principal.roles & allowed:
        raise ForbiddenError(allowed)
    return principal
