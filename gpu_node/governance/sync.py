"""A starting node fetches the governance state it must enforce from the coordinator (docs/design.md
§6).

``GET /v1/governance`` (``coordinator.api.routes.governance``) answers, page by page, the
decisions the node's version registry must hold (retired namespaces, current policy
and document versions, each with its decision time) and the commands still pending
for this node. The node asks with its own credential (the enrolled node key, as for
data keys) and a fresh random nonce per page, and accepts a page only when it is
signed by the coordinator's command key it pins, names this node and echoes the
nonce — a man in the middle can neither relax the state nor replay an older one —
and every pending command in it is itself a valid command signed by that key.

:class:`GovernanceClient` fetches and checks; :class:`gpu_node.governance.commands.CommandConsumer`
applies the state (registry first, then the pending commands through the same path as
a command from the topic, acked) before the node reports ready, then consumes the
topic from the end offsets it noted before fetching. Any failure — coordinator
unreachable, an error answer, a bad signature — leaves the node not ready; the consumer
retries with capped backoff (see ``docs/operations.md``, "Node start").
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import TypeAdapter, ValidationError

from events import schema
from identity.signing import (
    GOVERNANCE_CONTEXT,
    SIGNATURE_ERROR,
    document_signature_problem,
    signature_problem,
)

DEFAULT_TIMEOUT_S = 10.0
MAX_PAGES = 10_000
"""Pages one fetch follows (10 million entries at the coordinator's page size): a coordinator that
keeps answering with a next page is refused rather than followed forever."""

_PREDICATE = TypeAdapter(schema.Predicate)
_DECIDED_AT = TypeAdapter(datetime)


class GovernanceUnavailable(Exception):
    """The coordinator could not be asked or answered with an error: retried."""


class GovernanceRefused(Exception):
    """The answer is not one the coordinator's command key vouches for, for this node and this request: retried,
    never applied. The message names the check that failed, never the content."""


@dataclass(slots=True)
class GovernanceState:
    """What the node must enforce: registry decisions (predicate, decided at) and its pending commands, in order."""

    decisions: list[tuple[schema.Predicate, datetime]] = field(default_factory=list)
    pending: list[schema.Invalidate] = field(default_factory=list)
    as_of_decision: int = 0


class GovernanceClient:
    """Fetches :class:`GovernanceState` for ``node_id`` from ``coordinator_url``; see the module
    docstring.

    ``token_factory`` returns a fresh node credential (called per request).
    """

    def __init__(
        self,
        coordinator_url: str,
        token_factory: Callable[[], str],
        node_id: str,
        command_key: Ed25519PublicKey,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._url = coordinator_url
        self._token_factory = token_factory
        self._node_id = node_id
        self._command_key = command_key
        self._timeout_s = timeout_s
        self._transport = transport

    async def fetch(self) -> GovernanceState:
        """Every page, checked; :class:`GovernanceUnavailable` or :class:`GovernanceRefused`
        otherwise."""
        state = GovernanceState()
        cursor: str | None = None
        async with httpx.AsyncClient(
            base_url=self._url, timeout=self._timeout_s, transport=self._transport
        ) as client:
            for _ in range(MAX_PAGES):
                nonce = secrets.token_urlsafe(24)
                params = {"nonce": nonce} if cursor is None else {"nonce": nonce, "cursor": cursor}
                try:
                    response = await client.get(
                        "/v1/governance",
                        params=params,
                        headers={"Authorization": f"Bearer {self._token_factory()}"},
                    )
                except httpx.HTTPError as error:
                    raise GovernanceUnavailable(
                        f"coordinator unreachable ({type(error).__name__})"
                    ) from None
                if response.status_code != 200:
                    raise GovernanceUnavailable(
                        f"coordinator answered HTTP {response.status_code} {_error_code(response)}"
                    )
                cursor = self._read_page(response, nonce, state)
                if cursor is None:
                    return state
        raise GovernanceRefused(f"the governance state did not end within {MAX_PAGES} pages")

    def _read_page(
        self, response: httpx.Response, nonce: str, state: GovernanceState
    ) -> str | None:
        """Check one page and add it to ``state``; its next cursor (None on the last page)."""
        try:
            body = response.json()
        except ValueError:
            raise GovernanceRefused("the answer is not JSON") from None
        if not isinstance(body, dict):
            raise GovernanceRefused("the answer is not a JSON object")
        signature = body.pop("signature", None)
        problem = document_signature_problem(body, signature, self._command_key, GOVERNANCE_CONTEXT)
        if problem is not None:
            raise GovernanceRefused(SIGNATURE_ERROR + problem)
        if body.get("node_id") != self._node_id or body.get("nonce") != nonce:
            raise GovernanceRefused("the signed answer is for another node or another request")
        try:
            for item in body["decisions"]:
                state.decisions.append(
                    (
                        _PREDICATE.validate_python(item["predicate"]),
                        _DECIDED_AT.validate_python(item["decided_at"]),
                    )
                )
            for item in body["pending_commands"]:
                envelope = schema.parse_event(json.dumps(item).encode())
                problem = signature_problem(envelope, self._command_key)
                if problem is not None:
                    raise GovernanceRefused(f"a pending command: {SIGNATURE_ERROR}{problem}")
                if not isinstance(envelope.payload, schema.Invalidate):
                    raise GovernanceRefused("a pending command is not an Invalidate")
                state.pending.append(envelope.payload)
            state.as_of_decision = max(state.as_of_decision, int(body["as_of_decision"]))
            cursor = body["next_cursor"]
        except (
            KeyError,
            TypeError,
            ValueError,
            ValidationError,
            schema.EventValidationError,
        ) as error:
            raise GovernanceRefused(
                f"malformed governance state ({type(error).__name__})"
            ) from None
        if cursor is not None and not isinstance(cursor, str):
            raise GovernanceRefused("malformed governance state (cursor)")
        return cursor


def _error_code(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "(no error code)"
