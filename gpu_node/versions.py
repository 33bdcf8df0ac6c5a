"""What this node knows about current document and policy versions (docs/design.md §4, §5).

The coordinator turns ``DocumentUpdated``/``DocumentDeleted``/``PermissionRevoked``
into ``Invalidate`` commands; every node applies them in command order. Deleting
the superseded blocks is not enough on its own: a client that still sends the old
document version (or a token issued under the old policy version) would rebuild
and reuse exactly the superseded KV. So each command also moves this registry,
and the API refuses such requests (409 ``stale_document_version`` / 401
``stale_authorization``) before any key is computed.

The registry is a fold over the command log, not a durable store: the node
rebuilds it by reading ``kvledger.commands`` from the beginning at every start
(see :mod:`gpu_node.commands`), so it is complete before the node turns ready.

"Current" is the ``below_version`` of the *latest* command for a document or
policy in command order — the coordinator decides the order, and a
``DocumentDeleted`` arrives as a document command with a ``below_version``
above any real version, which makes every version stale.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from events import schema
from gpu_node.kv_cache_utils import TENANT_WIDE_AUTH_SCOPE, CacheScope, Principal
from gpu_node.prompt import ChatMessage


@dataclass(frozen=True, slots=True)
class Staleness:
    """Why a request may not be served: ``name`` (a doc id or auth scope) at ``requested`` < ``current``."""

    kind: Literal["document", "policy"]
    message_index: int
    name: str
    requested: int
    current: int


class VersionRegistry:
    """Current document versions, policy versions and retired namespaces, as commanded.

    Only touched from the node's event loop (the command consumer writes, the API
    reads), so it needs no lock.
    """

    def __init__(self) -> None:
        self._documents: dict[tuple[str, str], int] = {}
        self._policies: dict[tuple[str, str], int] = {}
        self._retired: set[str] = set()
        self._applied: set[uuid.UUID] = set()
        """Ids of the version-moving commands already folded in; ~100 bytes each, one per document or policy
        command in the command log (which the node reads whole at every start anyway)."""

    def apply(self, predicate: schema.Predicate, command_id: uuid.UUID | None = None) -> None:
        """Record what an ``Invalidate`` predicate says about current versions.

        Subject and tenant predicates remove data but make no version current,
        so they leave the registry unchanged. A command counts once, where it
        first appears in command order: the coordinator re-sends a command (same
        ``command_id``) to a node that has not acked it yet, possibly after newer
        commands for the same document or policy, and a re-send folded in again
        would move the version *back* — tokens and documents an update had
        superseded would be served again, in this run and after every replay.
        """
        if command_id is not None:
            if command_id in self._applied:
                return
            if isinstance(predicate, (schema.DocumentPredicate, schema.PolicyPredicate)):
                self._applied.add(command_id)
        match predicate:
            case schema.DocumentPredicate():
                self._documents[(predicate.tenant, predicate.doc_id)] = predicate.below_version
            case schema.PolicyPredicate():
                self._policies[(predicate.tenant, predicate.auth_scope)] = predicate.below_version
            case schema.NamespacePredicate():
                self._retired.add(predicate.ns)

    def document_version(self, tenant_id: str, doc_id: str) -> int | None:
        """The current version of a tenant's document; None when no command named it."""
        return self._documents.get((tenant_id, doc_id))

    def policy_version(self, tenant_id: str, auth_scope: str) -> int | None:
        """The current policy version of a tenant's auth scope; None when no command named it."""
        return self._policies.get((tenant_id, auth_scope))

    def is_retired(self, namespace: str) -> bool:
        return namespace in self._retired

    def check(self, principal: Principal, messages: Sequence[ChatMessage]) -> Staleness | None:
        """The first reason ``principal`` may not be served ``messages``; None when everything is current.

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
