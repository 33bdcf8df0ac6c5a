"""The ledger schema (docs/design.md §6) as SQLAlchemy 2 typed models.

These classes are for querying; the schema itself is created only by the Alembic
migrations in ``migrations/versions`` (never ``create_all``). The migration test
compares the migrated database against this metadata, so the two cannot drift.

Design notes:

* Enumerations are ``text`` + ``CHECK`` rather than Postgres enum types, so a later
  migration can add a value without ``ALTER TYPE`` gymnastics.
* Hashes are ``bytea`` (32 bytes instead of 64 hex characters in every index).
* Subjects are stored only as the keyed digest the nodes send (``subject_hash``);
  the raw subject never reaches this database.
* ``placements`` keeps one row per (block, node, tier, snapshot) whose ``state``
  flips between ``live`` and ``deleted``: the uniqueness of a live copy is then a
  plain unique constraint that ``INSERT … ON CONFLICT`` can target, and the table
  is bounded by the number of distinct copies instead of growing with every
  eviction/promotion cycle. Erasure evidence lives in acks and receipts, not here.
* Invalidations (migration ``0002_invalidation``) are one row per command plus one
  row per expected node (``invalidation_targets``). ``documents``, ``policies`` and
  ``namespaces`` point at the invalidation that enforced their current state, so a
  late ``BlockStored`` of superseded data finds the decided predicate with one join;
  ``placements.invalidation_id`` names the command that is deleting (or deleted) a copy.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    DateTime,
    ForeignKey,
    ForeignKeyConstraint,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    Uuid,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from coordinator.ledger.states import (
    ErasureStatus,
    InvalidationStatus,
    NamespaceStatus,
    NodeStatus,
    PlacementState,
    TargetStatus,
)
from events.tiers import (
    VOLATILE_TIERS as VOLATILE_TIERS,
)  # the ledger ingest asks the models which tiers a restart empties
from events.tiers import Tier

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

SCOPES = ("public", "tenant", "user")
PREDICATE_KINDS = ("document", "policy", "subject", "namespace", "tenant")
INVALIDATION_TRIGGERS = ("event", "api", "late_block")


def _one_of(column: str, values: Iterable[str]) -> str:
    """The CHECK text for an enumeration; ``str()`` keeps an enum member's value, so the text is the
    migrated one."""
    return f"{column} IN ({', '.join(repr(str(value)) for value in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {
        datetime: DateTime(timezone=True),
        bytes: LargeBinary,
        str: Text,
        uuid.UUID: Uuid,
        dict[str, Any]: JSONB,
    }


def _now() -> Any:
    return mapped_column(DateTime(timezone=True), server_default=func.now())


class Namespace(Base):
    """A cache namespace (model/tokenizer/template/KV-format digest) and its lifecycle."""

    __tablename__ = "namespaces"
    __table_args__ = (CheckConstraint(_one_of("status", NamespaceStatus), name="status"),)

    namespace: Mapped[str] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(server_default=NamespaceStatus.ACTIVE.value)
    first_seen_at: Mapped[datetime] = _now()
    updated_at: Mapped[datetime] = _now()
    invalidation_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("invalidations.command_id")
    )
    """The namespace-wide invalidation that drains it (set when retirement starts)."""


class Node(Base):
    """A GPU node: its restart epoch and the last kv-event ``seq`` applied in that epoch."""

    __tablename__ = "nodes"
    __table_args__ = (CheckConstraint(_one_of("status", NodeStatus), name="status"),)

    node_id: Mapped[str] = mapped_column(primary_key=True)
    epoch: Mapped[int] = mapped_column(BigInteger)
    last_seq: Mapped[int] = mapped_column(BigInteger)
    namespace: Mapped[str | None]
    status: Mapped[str] = mapped_column(server_default=NodeStatus.ACTIVE.value)
    started_at: Mapped[datetime] = _now()
    last_heartbeat: Mapped[datetime | None]
    last_event_at: Mapped[datetime] = _now()
    inventory_request_id: Mapped[uuid.UUID | None]
    inventory_requested_at: Mapped[datetime | None]


class Block(Base):
    """One KV block and its provenance: whose data it holds. Immutable once written
    (content-addressed)."""

    __tablename__ = "blocks"
    __table_args__ = (
        CheckConstraint(_one_of("scope", SCOPES), name="scope"),
        CheckConstraint(
            "(scope = 'public' AND tenant_id IS NULL AND subject_hash IS NULL)"
            " OR (scope = 'tenant' AND tenant_id IS NOT NULL AND subject_hash IS NULL)"
            " OR (scope = 'user' AND tenant_id IS NOT NULL AND subject_hash IS NOT NULL)",
            name="scope_owner",
        ),
        Index(None, "tenant_id", "subject_hash"),
        Index(None, "namespace"),
    )

    block_hash: Mapped[bytes] = mapped_column(primary_key=True)
    parent_hash: Mapped[bytes | None]
    namespace: Mapped[str] = mapped_column(ForeignKey("namespaces.namespace"))
    tenant_id: Mapped[str | None]
    scope: Mapped[str]
    subject_hash: Mapped[bytes | None]
    token_offset: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime]
    first_seen_at: Mapped[datetime] = _now()


class BlockAuthScope(Base):
    """An (auth scope, policy version) a tenant block was built under."""

    __tablename__ = "block_auth_scopes"
    __table_args__ = (Index(None, "auth_scope", "policy_version"),)

    block_hash: Mapped[bytes] = mapped_column(
        ForeignKey("blocks.block_hash", ondelete="CASCADE"), primary_key=True
    )
    auth_scope: Mapped[str] = mapped_column(primary_key=True)
    policy_version: Mapped[int] = mapped_column(BigInteger)


class BlockDocument(Base):
    """A document version whose tokens lie anywhere in the block's prefix."""

    __tablename__ = "block_documents"
    __table_args__ = (Index(None, "doc_id", "version"),)

    block_hash: Mapped[bytes] = mapped_column(
        ForeignKey("blocks.block_hash", ondelete="CASCADE"), primary_key=True
    )
    doc_id: Mapped[str] = mapped_column(primary_key=True)
    version: Mapped[int] = mapped_column(BigInteger, primary_key=True)


class BlockCreator(Base):
    """A subject whose request created a copy of the block on some node, in any scope (keyed digest).

    What an erasure of that subject removes besides its user blocks (docs/security.md, "Erasure").
    A block may have several creators: each node builds its own copy, and so does a node that
    rebuilds a block after evicting it. Written from ``creator_subject_id`` of block provenance.
    """

    __tablename__ = "block_creators"
    __table_args__ = (Index(None, "subject_hash"),)

    block_hash: Mapped[bytes] = mapped_column(
        ForeignKey("blocks.block_hash", ondelete="CASCADE"), primary_key=True
    )
    subject_hash: Mapped[bytes] = mapped_column(primary_key=True)


class Snapshot(Base):
    """A node snapshot (manifest + shards): a tier of its own."""

    __tablename__ = "snapshots"
    __table_args__ = (CheckConstraint(_one_of("state", PlacementState), name="state"),)

    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.node_id"), primary_key=True)
    snapshot_id: Mapped[str] = mapped_column(primary_key=True)
    epoch: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[str]
    num_blocks: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = _now()
    deleted_at: Mapped[datetime | None]


class Replica(Base):
    """A node's copy of a block that was pulled from a peer instead of computed there: its provenance.

    One row per (block, node), the latest pull: the copy's placements (any tier it moves to)
    are the node's ordinary ``placements`` rows, which every invalidation and erasure reaches
    like any other; this says where their bytes came from and when. Written from
    ``replica_of`` of ``BlockStored`` (docs/events.md).
    """

    __tablename__ = "replicas"

    block_hash: Mapped[bytes] = mapped_column(
        ForeignKey("blocks.block_hash", ondelete="CASCADE"), primary_key=True
    )
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.node_id"), primary_key=True)
    source_node_id: Mapped[str]
    """Not a foreign key: the node reports its source, which the ledger may never have seen."""
    pulled_at: Mapped[datetime]


class Placement(Base):
    """A copy of a block on one node in one tier (and snapshot); ``state`` says whether it still
    exists."""

    __tablename__ = "placements"
    __table_args__ = (
        CheckConstraint(_one_of("tier", Tier), name="tier"),
        CheckConstraint(_one_of("state", PlacementState), name="state"),
        CheckConstraint(
            f"(tier = '{Tier.SNAPSHOT}') = (snapshot_id IS NOT NULL)", name="snapshot_tier"
        ),
        UniqueConstraint(
            "block_hash", "node_id", "tier", "snapshot_id", postgresql_nulls_not_distinct=True
        ),
        # Snapshot ids are the node's own names, so a snapshot is identified together with its node.
        ForeignKeyConstraint(
            ["node_id", "snapshot_id"], ["snapshots.node_id", "snapshots.snapshot_id"]
        ),
        Index(None, "node_id", "tier", "state"),
        Index(None, "node_id", "snapshot_id"),
        Index(None, "invalidation_id", postgresql_where=text("invalidation_id IS NOT NULL")),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    block_hash: Mapped[bytes] = mapped_column(ForeignKey("blocks.block_hash"))
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.node_id"))
    tier: Mapped[str]
    snapshot_id: Mapped[str | None]
    state: Mapped[str]
    epoch: Mapped[int] = mapped_column(BigInteger)
    reason: Mapped[str | None]
    updated_at: Mapped[datetime] = _now()
    invalidation_id: Mapped[uuid.UUID | None]
    """The last command that matched this copy: live = deletion pending, deleted = deleted by it.
    Not a foreign key: a decision marks hundreds of copies at once and the per-row check
    was half of that statement (migration 0006); only ids of existing commands are written."""


class Document(Base):
    """The current version of a tenant's document (from ``DocumentUpdated``/``DocumentDeleted``)."""

    __tablename__ = "documents"

    tenant_id: Mapped[str] = mapped_column(primary_key=True)
    doc_id: Mapped[str] = mapped_column(primary_key=True)
    version: Mapped[int] = mapped_column(BigInteger)
    deleted: Mapped[bool] = mapped_column(server_default=text("false"))
    updated_at: Mapped[datetime] = _now()
    invalidation_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("invalidations.command_id")
    )


class Policy(Base):
    """The current policy version of a tenant's auth scope (from ``PermissionRevoked``)."""

    __tablename__ = "policies"

    tenant_id: Mapped[str] = mapped_column(primary_key=True)
    auth_scope: Mapped[str] = mapped_column(primary_key=True)
    policy_version: Mapped[int] = mapped_column(BigInteger)
    updated_at: Mapped[datetime] = _now()
    invalidation_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("invalidations.command_id")
    )


class InboxEntry(Base):
    """An event already applied: a redelivered record with this id is a no-op."""

    __tablename__ = "inbox"
    __table_args__ = (Index(None, "processed_at"),)

    event_id: Mapped[uuid.UUID] = mapped_column(primary_key=True)
    topic: Mapped[str]
    event_type: Mapped[str]
    processed_at: Mapped[datetime] = _now()


class OutboxEntry(Base):
    """A record decided inside a ledger transaction, published to Kafka afterwards by the relay.

    ``lease_until``: the deciding process publishes the row itself right after its commit;
    the relay takes it only once the lease ran out (that process died before publishing).
    """

    __tablename__ = "outbox"
    __table_args__ = (Index("ix_outbox_unsent", "id", postgresql_where=text("sent_at IS NULL")),)

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    topic: Mapped[str]
    key: Mapped[str]
    payload: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = _now()
    sent_at: Mapped[datetime | None]
    lease_until: Mapped[datetime | None]


class DeadLetterCount(Base):
    """Records dead-lettered per source topic, shared by every coordinator replica."""

    __tablename__ = "dead_letters"

    topic: Mapped[str] = mapped_column(primary_key=True)
    num_records: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    last_at: Mapped[datetime] = _now()


class InventoryChunk(Base):
    """A received chunk of a multi-record Inventory, held until the set is complete."""

    __tablename__ = "inventory_chunks"

    node_id: Mapped[str] = mapped_column(
        ForeignKey("nodes.node_id", ondelete="CASCADE"), primary_key=True
    )
    epoch: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    request_key: Mapped[str] = mapped_column(String(64), primary_key=True)
    chunk: Mapped[int] = mapped_column(Integer, primary_key=True)
    num_chunks: Mapped[int] = mapped_column(Integer)
    placements: Mapped[dict[str, Any]]
    received_at: Mapped[datetime] = _now()


class Invalidation(Base):
    """One ``Invalidate`` command: the decision, its predicate and cutoff, and whether every node
    acked.

    ``seq`` orders decisions for listing and paging (many share one ``created_at``: it is
    the deciding transaction's time). ``requested_at`` is when the user asked (the
    event's ``occurred_at`` or the API call), so latency from publish can be reported.
    ``parent_command_id`` links a ``late_block`` re-emission to the decision it repeats.
    """

    __tablename__ = "invalidations"
    __table_args__ = (
        CheckConstraint(_one_of("kind", PREDICATE_KINDS), name="kind"),
        CheckConstraint(_one_of("status", InvalidationStatus), name="status"),
        CheckConstraint(_one_of("trigger", INVALIDATION_TRIGGERS), name="trigger"),
        UniqueConstraint("seq"),
        Index(None, "status", "seq"),
    )

    command_id: Mapped[uuid.UUID] = mapped_column(primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, Identity())
    kind: Mapped[str]
    predicate: Mapped[dict[str, Any]]
    cutoff: Mapped[datetime]
    trigger: Mapped[str]
    source_event_id: Mapped[uuid.UUID | None]
    parent_command_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("invalidations.command_id")
    )
    requested_at: Mapped[datetime]
    created_at: Mapped[datetime] = _now()
    completed_at: Mapped[datetime | None]
    status: Mapped[str] = mapped_column(server_default=InvalidationStatus.PENDING.value)


class InvalidationTarget(Base):
    """A node expected to execute a command (registered at decision time) and what it reported."""

    __tablename__ = "invalidation_targets"
    __table_args__ = (
        CheckConstraint(_one_of("status", TargetStatus), name="status"),
        Index(None, "node_id", "status"),
        Index(
            "ix_invalidation_targets_pending",
            "command_id",
            postgresql_where=text(f"status = '{TargetStatus.PENDING}'"),
        ),
    )

    command_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("invalidations.command_id", ondelete="CASCADE"), primary_key=True
    )
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.node_id"), primary_key=True)
    status: Mapped[str] = mapped_column(server_default=TargetStatus.PENDING.value)
    epoch: Mapped[int | None] = mapped_column(BigInteger)
    acked_at: Mapped[datetime | None]
    evidence: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONB)
    """The ack's ``TierEvidence`` list as received (block hashes included: erasure receipts commit to them)."""
    ack_key_id: Mapped[str | None]
    """The enrolled node key that signed the ack recorded here; an erasure receipt names it."""
    resend_count: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    """How often the command went out again because this node had not acked
    (``coordinator.handlers.resend``)."""
    last_resent_at: Mapped[datetime | None]
    next_resend_at: Mapped[datetime | None]
    """When the next re-send is due; NULL: ``command_resend_after_s`` after the decision."""


def _of_target() -> ForeignKeyConstraint:
    """(command_id, node_id) → the invalidation target an ack row answers; it goes with the target."""
    return ForeignKeyConstraint(
        ["command_id", "node_id"],
        ["invalidation_targets.command_id", "invalidation_targets.node_id"],
        ondelete="CASCADE",
    )


class AckPart(Base):
    """A received part of a command ack split over several records, held until every part is in.

    The parts of one ack share ``ack_id``; the ack counts (``coordinator.handlers.acks``) only once
    ``num_parts`` distinct parts are staged, and its rows go as soon as the target is acked.
    """

    __tablename__ = "ack_parts"
    __table_args__ = (_of_target(),)

    command_id: Mapped[uuid.UUID] = mapped_column(primary_key=True)
    node_id: Mapped[str] = mapped_column(primary_key=True)
    ack_id: Mapped[uuid.UUID] = mapped_column(primary_key=True)
    part: Mapped[int] = mapped_column(Integer, primary_key=True)
    num_parts: Mapped[int] = mapped_column(Integer)
    epoch: Mapped[int] = mapped_column(BigInteger)
    evidence: Mapped[list[dict[str, Any]]] = mapped_column(JSONB)
    key_id: Mapped[str | None]
    after_seq: Mapped[int | None] = mapped_column(BigInteger)
    """The ack's fence (``CommandAck.after_seq``); every part of one ack carries the same."""
    received_at: Mapped[datetime] = _now()


class DeferredAck(Base):
    """A whole ack that arrived before the node's kv-events it is fenced behind, held until the ledger has them.

    The ack names the last kv-event ``seq`` of its ``epoch`` its removals were published under
    (``CommandAck.after_seq``); acks and kv-events travel on different topics to different
    consumer groups, so the ack may overtake them. It is applied (``coordinator.handlers.acks``) as soon
    as the node's ledger row reaches that seq or a later epoch; until then its target stays
    pending.
    """

    __tablename__ = "deferred_acks"
    __table_args__ = (_of_target(),)

    command_id: Mapped[uuid.UUID] = mapped_column(primary_key=True)
    node_id: Mapped[str] = mapped_column(primary_key=True)
    epoch: Mapped[int] = mapped_column(BigInteger)
    after_seq: Mapped[int] = mapped_column(BigInteger)
    evidence: Mapped[list[dict[str, Any]]] = mapped_column(JSONB)
    key_id: Mapped[str | None]
    deferred_at: Mapped[datetime] = _now()


class Erasure(Base):
    """One privacy erasure of a subject in a tenant (docs/design.md §6 "Erasure and receipts").

    The subject is stored only as its keyed digest (``events.schema.subject_digest``).
    ``idempotency_key`` is the caller's request id (``Idempotency-Key`` header, body
    ``request_id``, or the event's ``erasure_id``/event id): a retry with the same key
    in the same tenant is the same erasure. ``command_id`` is the subject ``Invalidate``
    decided with it; late-block re-sends name it as their ``parent_command_id``.
    """

    __tablename__ = "erasures"
    __table_args__ = (
        CheckConstraint(_one_of("status", ErasureStatus), name="status"),
        UniqueConstraint("tenant_id", "idempotency_key"),
        Index(None, "status"),
        Index(None, "tenant_id", "subject_hash"),
        Index(None, "command_id"),
    )

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True)
    tenant_id: Mapped[str]
    subject_hash: Mapped[bytes]
    reason: Mapped[str]
    idempotency_key: Mapped[str]
    status: Mapped[str] = mapped_column(server_default=ErasureStatus.PENDING.value)
    command_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("invalidations.command_id"))
    cutoff: Mapped[datetime]
    requested_at: Mapped[datetime]
    verified_at: Mapped[datetime | None]
    key_ids_destroyed: Mapped[list[str]] = mapped_column(JSONB)
    updated_at: Mapped[datetime] = _now()


class ReceiptKey(Base):
    """An Ed25519 receipt signing key ever used; listed forever in ``GET /v1/receipts/keys``.

    ``private_key`` is the raw private key wrapped under the master key (AES-256-GCM,
    as ``coordinator.keys.data_keys`` wraps data keys) for a key the coordinator generated, and
    NULL for a key that comes from settings (it is never stored then).
    """

    __tablename__ = "receipt_keys"

    key_id: Mapped[str] = mapped_column(primary_key=True)
    public_key: Mapped[bytes]
    private_key: Mapped[bytes | None]
    created_at: Mapped[datetime] = _now()
    retired_at: Mapped[datetime | None]


class Receipt(Base):
    """The signed receipt of a verified erasure: ``{"receipt": body, "signature": …}`` as signed."""

    __tablename__ = "receipts"
    __table_args__ = (UniqueConstraint("erasure_id"), UniqueConstraint("leaf_index"))

    receipt_id: Mapped[uuid.UUID] = mapped_column(primary_key=True)
    erasure_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("erasures.id"))
    document: Mapped[dict[str, Any]]
    leaf_index: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = _now()


class AuditLogEntry(Base):
    """One leaf of the append-only Merkle audit log: ``audit_leaf_hash`` of a signed receipt."""

    __tablename__ = "audit_log"
    __table_args__ = (UniqueConstraint("receipt_id"),)

    leaf_index: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    leaf_hash: Mapped[bytes]
    receipt_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("receipts.receipt_id"))
    appended_at: Mapped[datetime] = _now()


class TreeHead(Base):
    """A signed tree head of the audit log, one per size (each append signs the new size)."""

    __tablename__ = "tree_heads"

    tree_size: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    root_hash: Mapped[bytes]
    timestamp: Mapped[datetime]
    key_id: Mapped[str] = mapped_column(ForeignKey("receipt_keys.key_id"))
    signature: Mapped[str]


class NodeKey(Base):
    """A node's enrolled Ed25519 public key (``coordinator.keys.node_keys``): what its key-service
    credentials, kv-events and acks are checked against. A key belongs to one node for good;
    revocation is final."""

    __tablename__ = "node_keys"
    __table_args__ = (Index(None, "node_id"),)

    key_id: Mapped[str] = mapped_column(primary_key=True)
    node_id: Mapped[str]
    public_key: Mapped[bytes]
    enrolled_at: Mapped[datetime] = _now()
    revoked_at: Mapped[datetime | None]


class ProducerKey(Base):
    """A customer-event producer's enrolled Ed25519 public key (``coordinator.keys.producer_keys``) and the tenants it
    may publish for: ``tenants``, or every tenant when ``all_tenants``. Revocation is final."""

    __tablename__ = "producer_keys"
    __table_args__ = (
        CheckConstraint("all_tenants OR jsonb_array_length(tenants) > 0", name="bound"),
    )

    key_id: Mapped[str] = mapped_column(primary_key=True)
    name: Mapped[str]
    public_key: Mapped[bytes]
    all_tenants: Mapped[bool]
    tenants: Mapped[list[str]] = mapped_column(JSONB)
    enrolled_at: Mapped[datetime] = _now()
    enrolled_by: Mapped[str]
    revoked_at: Mapped[datetime | None]


class UsageReport(Base):
    """What one node served one tenant over one interval (a ``UsageReported`` kv-event): counts only.

    ``kvledger cost report`` sums these per tenant over a time window (docs/operations.md, "Cost").
    Keyed by the record's event id, so a redelivered record cannot count twice.
    """

    __tablename__ = "usage_reports"
    __table_args__ = (Index(None, "window_end"), Index(None, "tenant_id", "window_end"))

    event_id: Mapped[uuid.UUID] = mapped_column(primary_key=True)
    node_id: Mapped[str]
    tenant_id: Mapped[str]
    window_start: Mapped[datetime]
    window_end: Mapped[datetime]
    num_requests: Mapped[int] = mapped_column(BigInteger)
    num_prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    num_cached_tokens: Mapped[int] = mapped_column(BigInteger)
    num_output_tokens: Mapped[int] = mapped_column(BigInteger)
    received_at: Mapped[datetime] = _now()
