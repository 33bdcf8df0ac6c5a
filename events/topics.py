"""Kafka topics and record keys (docs/design.md §5).

Keys decide partitions, and Kafka only orders records within a partition, so a key
is chosen per *thing whose events must stay in order*: one document, one tenant's
auth scope, one subject, one node. Nothing parses a key back (a ``:`` inside an id merely
changes which partition a key hashes to), but a customer event's key must be exactly the one
:func:`route` gives its envelope, and every topic carries only its own event types
(:data:`TYPES_BY_TOPIC`): consumers check both (:func:`routing_problem`).
"""

from __future__ import annotations

from typing import get_args

from events.schema import (
    BlockMoved,
    BlockRemoved,
    BlockStored,
    Command,
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
"""Records GPU nodes refused or could not send. Nodes write here, never to :data:`DEAD_LETTER`, so a
node's credentials cannot plant a letter that replay would republish with the coordinator's; listed,
never replayed."""
DEAD_LETTER_TOPICS: tuple[str, ...] = (DEAD_LETTER, NODE_DEAD_LETTER)

ALL_TOPICS: tuple[str, ...] = (
    DOCUMENTS,
    PERMISSIONS,
    ERASURES,
    KV_EVENTS,
    COMMANDS,
    ACKS,
    DEAD_LETTER,
    NODE_DEAD_LETTER,
)

_DAY_MS = 24 * 3600 * 1000

TOPIC_CONFIGS: dict[str, dict[str, str]] = {
    # Nodes rebuild their version registry and retired namespaces from this topic at every start, so
    # a command must outlive any node's downtime: kept forever. Not compacted: every invalidation
    # shares one key (one partition, one order), so compaction would keep only the last.
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
"""The configs each topic is created with (``events.kafka.admin.ensure_topics``); see
docs/operations.md, "Topics"."""

ALERT_TOPICS: frozenset[str] = frozenset({ERASURES, PERMISSIONS})
"""Topics where a dead-lettered record is an alert, not just a count: dropping one would
leave personal data or revoked access in the cache."""

BROADCAST_TARGET = "*"
"""Command key for commands every node executes (invalidations). One key keeps them in
one partition, so every node applies them in the order the coordinator decided them."""

TYPES_BY_TOPIC: dict[str, frozenset[str]] = {
    DOCUMENTS: frozenset({DocumentUpdated.TYPE, DocumentDeleted.TYPE}),
    PERMISSIONS: frozenset({PermissionRevoked.TYPE}),
    ERASURES: frozenset({ErasureRequested.TYPE}),
    KV_EVENTS: frozenset(
        {
            NodeStarted.TYPE,
            BlockStored.TYPE,
            BlockRemoved.TYPE,
            BlockMoved.TYPE,
            SnapshotWritten.TYPE,
            SnapshotDeleted.TYPE,
            Inventory.TYPE,
            NodeHeartbeat.TYPE,
            UsageReported.TYPE,
        }
    ),
    COMMANDS: frozenset(model.TYPE for model in get_args(Command)),
    ACKS: frozenset({CommandAck.TYPE}),
}
"""The event types each topic carries, and no others: the one table producers route by and every
consumer enforces (:func:`routing_problem`). Per-topic ACLs rest on it: a principal allowed to
write ``kvledger.documents`` must not start an erasure by writing an ``ErasureRequested`` there."""

TOPIC_BY_TYPE: dict[str, str] = {
    event_type: topic for topic, types in TYPES_BY_TOPIC.items() for event_type in types
}
"""The topic of each event type (the inverse of :data:`TYPES_BY_TOPIC`)."""

CUSTOMER_TOPICS: frozenset[str] = frozenset({DOCUMENTS, PERMISSIONS, ERASURES})
"""Topics of customer events (users' decisions), whose record key starts with the envelope's tenant."""

ROUTING_ERROR = "routing: "
"""Prefix of the dead-letter error of a record refused by :func:`routing_problem`; a reason below
follows."""
WRONG_TOPIC = "wrong_topic"
"""The record's event type is not one its topic carries (:data:`TYPES_BY_TOPIC`)."""
KEY_TENANT_MISMATCH = "key_tenant_mismatch"
"""A customer event whose record key is not the one its envelope routes to (``tenant:…``): the key
names one tenant and the envelope another, or the key is missing or for another
document/scope/subject."""


def routing_problem(topic: str, key: str | None, envelope: Envelope) -> str | None:
    """Why a record read from ``topic`` under ``key`` may not be handled (a reason constant), or None.

    A record's type must be one its topic carries, and a customer event's key must be exactly the
    key :func:`route` gives its envelope, so the tenant in the key (which a broker ACL on key
    prefixes could check) and the tenant the handler acts on are the same.
    """
    carried = TYPES_BY_TOPIC.get(topic)
    if carried is None:
        return None  # not a kvledger topic (a test's scratch topic): no rule to hold it to
    if envelope.type not in carried:
        return WRONG_TOPIC
    if topic in CUSTOMER_TOPICS and key != route(envelope)[1]:
        return KEY_TENANT_MISMATCH
    return None


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
