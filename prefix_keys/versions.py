"""What a node (and a fleet router) knows about current document and policy versions (docs/design.md
§4, §5).

The coordinator turns ``DocumentUpdated``/``DocumentDeleted``/``PermissionRevoked``
into ``Invalidate`` commands; every node applies them in command order. Deleting
the superseded blocks is not enough on its own: a client that still sends the old
document version (or a token issued under the old policy version) would rebuild
and reuse exactly the superseded KV. So each command also moves this registry,
and the API refuses such requests (409 ``stale_document_version`` / 401
``stale_authorization``) before any key is computed.

The registry is not a durable store: at every start the node fills it from the
coordinator's governance state (:mod:`gpu_node.governance.sync`), or, without a
coordinator URL, by reading ``kvledger.commands`` from the beginning (see
:mod:`gpu_node.governance.commands`), so it is complete before the node turns ready; commands
consumed afterwards move it on. A fleet router keeps one too (``router.feed``), so it
refuses a stale request itself with the node's very answer (:attr:`Staleness.status_code`,
:attr:`Staleness.code`, :attr:`Staleness.message`, :attr:`Staleness.param`) instead of
sending it on; the node still checks every request itself.

"Current" is the ``below_version`` of the *latest decision* for a document or
policy, ordered by the decision time every command carries (its ``cutoff``, the
coordinator's database time; decisions about one document or scope are taken one
after another, so that order is the coordinator's). Order of arrival is not enough:
a re-sent command (``coordinator.handlers.resend``) or the governance state can arrive after a
newer decision, and must not move the registry back. A ``DocumentDeleted`` arrives as
a document command with a ``below_version`` above any real version, which makes every
version stale until a later decision re-creates the document.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from events import schema
from prefix_keys.blocks import TENANT_WIDE_AUTH_SCOPE, CacheScope, Principal
from prefix_keys.prompt import ChatMessage


@dataclass(frozen=True, slots=True)
class Staleness:
    """Why a request may not be served: ``name`` (a doc id or auth scope) at ``requested`` <
    ``current``."""

    kind: Literal["document", "policy"]
    message_index: int
    name: str
    requested: int
    current: int

    @property
    def status_code(self) -> int:
        """401 for a token issued under a superseded policy (a new token fixes it), 409 for a
        superseded document."""
        return 401 if self.kind == "policy" else 409

    @property
    def code(self) -> str:
        return "stale_authorization" if self.kind == "policy" else "stale_document_version"

    @property
    def message(self) -> str:
        if self.kind == "policy":
            return (
                f"the token was issued under policy version {self.requested} of auth scope {self.name!r}; "
                f"the current version is {self.current}. Obtain a new token."
            )
        return f"document {self.name!r} version {self.requested} is stale; the current version is {self.current}"

    @property
    def param(self) -> str | None:
        return None if self.kind == "policy" else f"messages[{self.message_index}].document.version"


class VersionRegistry:
    """Current document versions, policy versions and retired namespaces, as commanded.

    Only touched from one event loop (the command consumer writes, the API reads),
    so it needs no lock.
    """

    def __init__(self) -> None:
        # key → (decided at, below_version) of the latest decision recorded for it
        self._documents: dict[tuple[str, str], tuple[datetime, int]] = {}
        self._policies: dict[tuple[str, str], tuple[datetime, int]] = {}
        self._retired: set[str] = set()

    def apply(self, predicate: schema.Predicate, decided_at: datetime) -> None:
        """Record what an ``Invalidate`` predicate decided at ``decided_at`` (the command's cutoff)
        says is current.

        A decision older than the one recorded for the same document or policy is
        ignored; one at the same time or later replaces it. Subject and tenant
        predicates remove data but make no version current, so they leave the
        registry unchanged; a retired namespace stays retired.
        """
        match predicate:
            case schema.DocumentPredicate():
                _record(
                    self._documents,
                    (predicate.tenant, predicate.doc_id),
                    decided_at,
                    predicate.below_version,
                )
            case schema.PolicyPredicate():
                _record(
                    self._policies,
                    (predicate.tenant, predicate.auth_scope),
                    decided_at,
                    predicate.below_version,
                )
            case schema.NamespacePredicate():
                self._retired.add(predicate.ns)

    def document_version(self, tenant_id: str, doc_id: str) -> int | None:
        """The current version of a tenant's document; None when no command named it."""
        recorded = self._documents.get((tenant_id, doc_id))
        return None if recorded is None else recorded[1]

    def policy_version(self, tenant_id: str, auth_scope: str) -> int | None:
        """The current policy version of a tenant's auth scope; None when no command named it."""
        recorded = self._policies.get((tenant_id, auth_scope))
        return None if recorded is None else recorded[1]

    def is_retired(self, namespace: str) -> bool:
        return namespace in self._retired

    def check(self, principal: Principal, messages: Sequence[ChatMessage]) -> Staleness | None:
        """The first reason ``principal`` may not be served ``messages``; None when everything is
        current.

        Authorization is checked before documents, over all messages: a caller
        whose token is stale learns nothing about document versions. The auth
        scopes a request uses are those its tenant-scope blocks are salted with
        (each document's scope, and the tenant-wide scope for other tenant
        messages), read from the token exactly as key derivation reads them.
        """
        tenant = principal.tenant_id
        for index, message in enumerate(messages):
            if message.document is not None:
                auth_scope = message.document.auth_scope
            elif message.scope == CacheScope.TENANT:
                auth_scope = TENANT_WIDE_AUTH_SCOPE
            else:
                continue
            current = self.policy_version(tenant, auth_scope)
            requested = principal.policy_version(auth_scope)
            if current is not None and requested < current:
                return Staleness("policy", index, auth_scope, requested, current)
        for index, message in enumerate(messages):
            document = message.document
            if document is None:
                continue
            current = self.document_version(tenant, document.doc_id)
            if current is not None and document.version < current:
                return Staleness("document", index, document.doc_id, document.version, current)
        return None


def _record(
    registry: dict[tuple[str, str], tuple[datetime, int]],
    key: tuple[str, str],
    decided_at: datetime,
    version: int,
) -> None:
    recorded = registry.get(key)
    if recorded is None or decided_at >= recorded[0]:
        registry[key] = (decided_at, version)
