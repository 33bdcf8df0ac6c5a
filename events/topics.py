"""Kafka topics and record keys (docs/design.md §5).

Keys decide partitions, and Kafka only orders records within a partition, so a key
is chosen per *thing whose events must stay in order*: one document, one tenant's
auth scope, one subject, one node. Keys are for ordering only — nothing parses them
back (a ``:`` inside an id merely changes which partition a key hashes to).
"""

from __future__ import annotations

from events.schema import (
    BlockMoved,
    BlockRemoved,
    BlockStored,
    CommandAck,
    DocumentDeleted,
    DocumentUpdated,
    Envelope,
    ErasureRequested,
    Invalidate,
    Inventory,
    InventoryRequested,
    NodeEvent,
    NodeHeartbeat,
    NodeStarted,
    PermissionRevoked,
    SnapshotDeleted,
    SnapshotWritten,
    UsageReported,
)

DOCUMENTS = "kvledger.documents"
PERMISSIONS = "kvledger.permissions"
ERASURES = "kvledger.erasures"
KV_EVENTS = "kvledger.kv-events"
COMMANDS = "kvledger.commands"
ACKS = "kvledger.acks"
DEAD_LETTER = "kvledger.dead-letter"
"""Records the coordinator's consumers refused, each letter signed by the coordinator: the only topic replay reads."""
NODE_DEAD_LETTER = "kvledger.node-dead-letter"
"""Records GPU nodes refused or could not send. Nodes write here, never to :data:`DEAD_LETTER`, so a node's
credentials cannot plant a letter that replay would republish with the coordinator's; listed, never replayed."""
DEAD_LETTER_TOPICS: tuple[str, ...] = (DEAD_LETTER, NODE_DEAD_LETTER)

ALL_TOPICS: tuple[str, ...] = (DOCUMENTS, PERMISSIONS, ERASURES, KV_EVENTS, COMMANDS, ACKS, DEAD_LETTER, NODE_DEAD_LETTER)

_DAY_MS = 24 * 3600 * 1000

TOPIC_CONFIGS: dict[str, dict[str, str]] = {
    # Nodes rebuild their version registry and retired namespaces from this topic at every
    # start, so a command must outlive any node's downtime: kept forever. Not compacted: every
    # invalidation shares one key (one partition, one order), so compaction would keep only the last.
    COMMANDS: {"cleanup.policy": "delete", "retention.ms": "-1"},
    # Users' decisions: kept for the longest coordinator outage supported (30 days).
    DOCUMENTS: {"cleanup.policy": "delete", "retention.ms": str(30 * _DAY_MS)},
    PERMISSIONS: {"cleanup.policy": "delete", "retention.ms": str(30 * _DAY_MS)},
    ERASURES: {"cleanup.policy": "delete", "retention.ms": str(30 * _DAY_MS)},
    # Node reports and acks: the ledger holds their effect once consumed; 7 days of outage.
    KV_EVENTS: {"cleanup.policy": "delete", "retention.ms": str(7 * _DAY_MS)},
    ACKS: {"cleanup.policy": "delete", "retention.ms": str(7 * _DAY_MS)},
    # Refused records wait for an operator to inspect and replay them.
    DEAD_LETTER: {"cleanup.policy": "delete", "retention.ms": str(90 * _DAY_MS)},
    NODE_DEAD_LETTER: {"cleanup.policy": "delete", "retention.ms": str(90 * _DAY_MS)},
}
"""The configs each topic is created with (``events.kafka.ensure_topics``); see docs/operations.md, "Topics"."""

ALERT_TOPICS: frozenset[str] = frozenset({ERASURES, PERMISSIONS})
"""Topics where a dead-lettered record is an alert, not just a count: dropping one would
leave personal data or revoked access in the cache."""

BROADCAST_TARGET = "*"
"""Command key for commands every node executes (invalidations). One key keeps them in
one partition, so every node applies them in the order the coordinator decided them."""

TOPIC_BY_TYPE: dict[str, str] = {
    DocumentUpdated.TYPE: DOCUMENTS,
    DocumentDeleted.TYPE: DOCUMENTS,
    PermissionRevoked.TYPE: PERMISSIONS,
    ErasureRequested.TYPE: ERASURES,
    NodeStarted.TYPE: KV_EVENTS,
    BlockStored.TYPE: KV_EVENTS,
    BlockRemoved.TYPE: KV_EVENTS,
    BlockMoved.TYPE: KV_EVENTS,
    SnapshotWritten.TYPE: KV_EVENTS,
    SnapshotDeleted.TYPE: KV_EVENTS,
    Inventory.TYPE: KV_EVENTS,
    NodeHeartbeat.TYPE: KV_EVENTS,
    UsageReported.TYPE: KV_EVENTS,
    Invalidate.TYPE: COMMANDS,
    InventoryRequested.TYPE: COMMANDS,
    CommandAck.TYPE: ACKS,
}


def _require(**parts: str | None) -> None:
    for name, value in parts.items():
        if not value:
            raise ValueError(f"{name} must be a non-empty string")


def document_key(tenant_id: str, doc_id: str) -> str:
    _require(tenant_id=tenant_id, doc_id=doc_id)
    return f"{tenant_id}:{doc_id}"


def permission_key(tenant_id: str, auth_scope: str) -> str:
    _require(tenant_id=tenant_id, auth_scope=auth_scope)
    return f"{tenant_id}:{auth_scope}"


def erasure_key(tenant_id: str, subject_id: str) -> str:
    _require(tenant_id=tenant_id, subject_id=subject_id)
    return f"{tenant_id}:{subject_id}"


def node_key(node_id: str) -> str:
    _require(node_id=node_id)
    return node_id


def command_key(target: str) -> str:
    """``target`` is a node id, or :data:`BROADCAST_TARGET` for commands to every node."""
    _require(target=target)
    return target


def route(envelope: Envelope) -> tuple[str, str]:
    """The topic and key an envelope is published under."""
    payload = envelope.payload
    topic = TOPIC_BY_TYPE[envelope.type]
    tenant = envelope.tenant_id or ""  # user events without a tenant fail the key's check
    match payload:
        case DocumentUpdated() | DocumentDeleted():
            return topic, document_key(tenant, payload.doc_id)
        case PermissionRevoked():
            return topic, permission_key(tenant, payload.auth_scope)
        case ErasureRequested():
            return topic, erasure_key(tenant, payload.subject_id)
        case NodeEvent() | NodeHeartbeat() | CommandAck():
            return topic, node_key(payload.node_id)
        case InventoryRequested():
            return topic, command_key(payload.node_id)
        case Invalidate():
            return topic, command_key(BROADCAST_TARGET)
    raise AssertionError(f"no routing rule for event type {envelope.type!r}")
