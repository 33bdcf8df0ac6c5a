"""The event and command contract between GPU nodes, users and the coordinator (docs/events.md).

Every Kafka record value is one JSON :class:`Envelope`::

    {"event_id": "<uuid>", "type": "<Type>", "schema_version": 1,
     "occurred_at": "<RFC3339>", "tenant_id": "<str|null>", "payload": {...}}

``type`` names exactly one payload model in :data:`EVENT_TYPES`; the payload is
validated against it on *both* ends (producers build models, consumers call
:func:`parse_event`). Models forbid unknown fields: a typo or a producer on a
newer contract must fail loudly (and land on the dead-letter topic) rather than
be half-understood. An incompatible change bumps ``schema_version``, which v1
consumers reject.

Privacy rules encoded here:

* ``subject_id`` inside node events (block provenance) and in commands
  (:class:`SubjectPredicate`) is a **keyed digest** (:func:`subject_digest`), never
  the raw JWT ``sub``: ``kvledger.kv-events`` and ``kvledger.commands`` are
  retained, broadcast and read by every node, so they must not carry personal
  identifiers. Only user-facing input events (:class:`ErasureRequested`,
  :class:`PermissionRevoked`) carry the raw subject, because their publishers do
  not hold the key; the coordinator digests it on ingest.
* Block events are batches (many blocks per record) so a node emits one record
  per engine step and the coordinator ingests them with bulk statements.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import uuid
from datetime import UTC, datetime
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    Strict,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails

from events.logs import escape_control
from events.tiers import StorageTier, Tier

SCHEMA_VERSION = 1

# ---------------------------------------------------------------------------
# Scalar types: the bounds every field that reaches Postgres or Kafka obeys
# (docs/events.md "Field limits"). Nodes, coordinator and CLI reuse them, so a
# value one side accepts is a value every other side, and the database, accepts.
# ---------------------------------------------------------------------------

MAX_ID_CHARS = 256
"""Longest identifier (characters): room for UUIDs, URNs and paths, small enough to index."""
MAX_SAFE_INT = 2**53 - 1
"""Largest version/counter: exact in a JSON double and inside Postgres BIGINT."""
MAX_INT32 = 2**31 - 1
"""Largest value of a Postgres INTEGER column (token offsets, inventory chunk numbers)."""
MAX_REASON_CHARS = 2000
"""Longest free-text reason (an erasure request's)."""
MAX_BLOCKS_PER_EVENT = 1000
"""Most blocks (or placements) one record lists: ~450 bytes each keeps a record well under the
broker's default 1 MiB message limit. Producers split larger sets into several records."""
MAX_HASHES_PER_EVENT = 12_000
"""Most bare block hashes one record lists (a snapshot's, an ack's evidence): 67 bytes each keeps
the record under 1 MiB, which the producer refuses to send anyway."""
MAX_LIST_ITEMS = 256
"""Most entries of a small list (auth scopes or documents of one block, evidence of one ack)."""
MAX_ACK_PARTS = 128
"""Most records one command's ack is split into (``CommandAck.parts``): room for about 1.5 million
removed blocks per node and command, and a bound on what the coordinator stages and assembles."""

_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f]")
"""C0 controls, DEL and C1 controls: NUL is refused by Postgres text, newlines forge log lines and
header-like framing, and none of them belongs in an identifier."""
_CONTROL_CHARS_EXCEPT_WHITESPACE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def check_identifier(value: str) -> str:
    """Validator of :data:`Name`: no control characters, not blank (length is checked beside it).

    Lone surrogates (valid Python ``str``, not UTF-8, refused by Postgres) never get here:
    pydantic's string validation refuses them, from JSON and from Python alike.
    """
    if _CONTROL_CHARS.search(value):
        raise ValueError("must not contain control characters")
    if not value.strip():
        raise ValueError("must not be blank")
    return value


def _check_text(value: str) -> str:
    if _CONTROL_CHARS_EXCEPT_WHITESPACE.search(value):
        raise ValueError("must not contain control characters other than tab and newline")
    if not value.strip():
        raise ValueError("must not be blank")
    return value


Name = Annotated[
    str,
    Strict(),
    StringConstraints(min_length=1, max_length=MAX_ID_CHARS),
    AfterValidator(check_identifier),
]
"""A non-empty identifier (tenant, document, auth scope, node, snapshot id, namespace ...): at most
:data:`MAX_ID_CHARS` characters (code points), valid UTF-8, no control characters, not only
whitespace."""

ReasonText = Annotated[
    str,
    Strict(),
    StringConstraints(min_length=1, max_length=MAX_REASON_CHARS),
    AfterValidator(_check_text),
]
"""Free text (a reason): bounded, valid UTF-8, no control characters but tab and newline."""

HexDigest = Annotated[str, StringConstraints(pattern=r"^(?:[0-9a-f]{2}){16,64}$")]
"""Lower-case hex of a 16..64-byte digest (sha256 block hashes are 64 hex chars)."""

Count = Annotated[int, Strict(), Field(ge=0, le=MAX_SAFE_INT)]
"""A version, counter, epoch or seq: an integer in 0..2^53-1. Strict so ``"3"`` or ``true`` is a
contract violation, not a 3 or a 1; bounded so it survives JSON doubles and Postgres BIGINT."""

MAX_DOCUMENT_VERSION = MAX_SAFE_INT - 1
"""The largest document version: one below :data:`ANY_VERSION`, so a deletion matches every version."""

DocumentVersion = Annotated[int, Strict(), Field(ge=0, le=MAX_DOCUMENT_VERSION)]
"""A document's version: 0..2^53-2. One short of :data:`Count` because :data:`ANY_VERSION` must lie
above every version and still be an integer RFC 8785 canonical JSON carries (what a command's
signature covers)."""

VersionBound = Annotated[int, Strict(), Field(ge=0, le=MAX_SAFE_INT)]
"""An exclusive upper bound on a version (``below_version``), at most :data:`ANY_VERSION`."""
ANY_VERSION = MAX_SAFE_INT
"""``below_version`` of a deleted document: above every :data:`DocumentVersion`, so every version
matches."""

SmallCount = Annotated[int, Strict(), Field(ge=0, le=MAX_INT32)]
"""A count stored in a Postgres INTEGER column (token offset, inventory chunk number)."""

MAX_TAG_CHARS = MAX_ID_CHARS + 1 + len(str(MAX_SAFE_INT))


def _check_document_tag(value: str) -> str:
    doc_id, _, version = value.rpartition("@")
    check_identifier(doc_id)
    if len(doc_id) > MAX_ID_CHARS:
        raise ValueError(f"document id longer than {MAX_ID_CHARS} characters")
    if int(version) > MAX_DOCUMENT_VERSION:
        raise ValueError(f"document version above {MAX_DOCUMENT_VERSION}")
    return value


DocumentTag = Annotated[
    str,
    Strict(),
    StringConstraints(pattern=r"^[\s\S]+@(?:0|[1-9][0-9]*)$", max_length=MAX_TAG_CHARS),
    AfterValidator(_check_document_tag),
]
"""``doc_id@version`` as it appears in a block's prefix (a :data:`Name` and a
:data:`DocumentVersion`)."""

CacheScopeLabel = Literal["public", "tenant", "user"]
RemovalReason = Literal["evicted", "expired", "invalidated", "restore_failed", "replaced"]
EraseMethod = Literal["overwrite", "unlink", "crypto_erase"]
"""How bytes were destroyed: ``overwrite`` is NIST 800-88 Clear (memory slots zeroed);
``unlink`` removes a plaintext file (public-scope disk data); ``crypto_erase`` is Purge
by destroying the data key of encrypted disk/snapshot data."""
PostCheck = Literal["readback_zero", "file_absent", "key_destroyed"]
"""The check performed *after* erasing: slot read back as zero, file no longer exists, key gone."""


def subject_digest(key: bytes, tenant_id: str, subject_id: str) -> str:
    """Keyed digest that stands for a subject in every node event, command and receipt.

    HMAC-SHA256 under a deployment secret shared by nodes and coordinator, over
    ``tenant_id NUL subject_id`` (subjects are only unique within a tenant). Keyed so
    that a reader of the topics cannot confirm a guessed identifier by hashing it.
    """
    if len(key) < 16:
        raise ValueError("subject digest key must be at least 16 bytes")
    if not tenant_id or not subject_id:
        raise ValueError("tenant_id and subject_id must be non-empty")
    message = tenant_id.encode() + b"\x00" + subject_id.encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


class _Model(BaseModel):
    """Frozen, closed models: unknown fields are errors and a received event cannot be altered in
    place."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# ---------------------------------------------------------------------------
# Payloads
# ---------------------------------------------------------------------------


class EventPayload(_Model):
    """Base of every payload. ``TYPE`` is the envelope ``type`` string.

    ``TENANT_REQUIRED`` payloads are about one tenant's data, so their envelope must
    name the tenant (it is also part of the record key).
    """

    TYPE: ClassVar[str]
    TENANT_REQUIRED: ClassVar[bool] = False


# --- users → coordinator ----------------------------------------------------


class DocumentUpdated(EventPayload):
    """A document now has ``version``; cached blocks holding older versions must go."""

    TYPE: ClassVar[str] = "DocumentUpdated"
    TENANT_REQUIRED: ClassVar[bool] = True
    doc_id: Name
    version: DocumentVersion


class DocumentDeleted(EventPayload):
    """A document is gone; every cached block holding any version of it must go."""

    TYPE: ClassVar[str] = "DocumentDeleted"
    TENANT_REQUIRED: ClassVar[bool] = True
    doc_id: Name


class PermissionRevoked(EventPayload):
    """The tenant's policy for ``auth_scope`` moved to ``policy_version``.

    Blocks built under an older policy version stop being reusable. ``subject_id``
    (raw, as the user's system knows it) narrows the revocation to one subject.
    """

    TYPE: ClassVar[str] = "PermissionRevoked"
    TENANT_REQUIRED: ClassVar[bool] = True
    auth_scope: Name
    policy_version: Count
    subject_id: Name | None = None


class ErasureRequested(EventPayload):
    """Erase every cached byte derived from one subject's data (raw id; digested on ingest).

    ``erasure_id`` makes the request idempotent: redelivery or a retry with the same
    id is the same erasure. Without one the coordinator derives it from the event id.
    """

    TYPE: ClassVar[str] = "ErasureRequested"
    TENANT_REQUIRED: ClassVar[bool] = True
    erasure_id: uuid.UUID | None = None
    subject_id: Name
    reason: ReasonText


# --- nodes → coordinator (kvledger.kv-events) -------------------------------


class NodeEvent(EventPayload):
    """Every node event carries the node's identity, its restart ``epoch`` and a per-epoch ``seq``.

    ``seq`` increases by one per record within an epoch; the coordinator detects gaps
    (lost or reordered records) and then asks for an :class:`Inventory`.
    """

    node_id: Name
    epoch: Count
    seq: Count


class BlockProvenance(_Model):
    """Whose data one block holds (docs/design.md §2), as recorded in the ledger.

    ``subject_id`` is the :func:`subject_digest` of the JWT subject, never the raw id.
    The scope fields must be consistent, because the coordinator matches predicates
    on them: public blocks belong to nobody (no tenant, subject, auth scope or
    document); tenant blocks have a tenant and no subject; user blocks have both.

    ``creator_subject_id`` is the :func:`subject_digest` of the subject whose request
    created this copy of the block, in every scope (a public or tenant block holds its
    creator's text too), so an erasure of that subject removes the copy whatever its
    scope. It names the creator of the node's copy, not everyone who sent the same
    tokens since. Optional: absent from records of nodes that predate it, and left out
    of the encoding when unset. In a user block it can only be the block's subject.
    """

    block_hash: HexDigest
    parent_hash: HexDigest | None
    namespace: Name
    tenant_id: Name | None
    scope: CacheScopeLabel
    auth_scopes: Annotated[list[tuple[Name, Count]], Field(max_length=MAX_LIST_ITEMS)]
    subject_id: HexDigest | None
    documents: Annotated[list[DocumentTag], Field(max_length=MAX_LIST_ITEMS)]
    token_offset: SmallCount
    created_at: AwareDatetime
    creator_subject_id: HexDigest | None = Field(None, exclude_if=lambda value: value is None)

    @model_validator(mode="after")
    def _scope_is_consistent(self) -> BlockProvenance:
        if self.scope == "public":
            if (
                self.tenant_id is not None
                or self.subject_id is not None
                or self.auth_scopes
                or self.documents
            ):
                raise ValueError(
                    "a public block has no tenant_id, subject_id, auth_scopes or documents"
                )
        elif self.tenant_id is None:
            raise ValueError(f"a {self.scope} block needs tenant_id")
        elif self.scope == "tenant" and self.subject_id is not None:
            raise ValueError("a tenant block has no subject_id")
        elif self.scope == "user" and self.subject_id is None:
            raise ValueError("a user block needs subject_id (a keyed digest)")
        if self.scope == "user" and self.creator_subject_id not in (None, self.subject_id):
            raise ValueError(
                "a user block is created by its own subject: creator_subject_id must equal subject_id"
            )
        return self


class ReplicaOrigin(_Model):
    """Where a node's copy came from when it was pulled from a peer instead of computed
    (``gpu_node.cache.peers``)."""

    source_node_id: Name
    pulled_at: AwareDatetime


class StoredBlock(BlockProvenance):
    """A block whose bytes were written to ``tier``.

    ``replica_of`` is set when the bytes were pulled from a peer node: the copy's provenance
    in the ledger (``replicas``). Optional, and left out of the encoding when unset, so the
    records of blocks computed on the node encode as before.
    """

    tier: StorageTier
    replica_of: ReplicaOrigin | None = Field(None, exclude_if=lambda value: value is None)


class RemovedBlock(_Model):
    block_hash: HexDigest
    tier: StorageTier


class MovedBlock(_Model):
    block_hash: HexDigest
    from_tier: StorageTier
    to_tier: StorageTier

    @model_validator(mode="after")
    def _tiers_differ(self) -> MovedBlock:
        if self.from_tier == self.to_tier:
            raise ValueError("from_tier and to_tier must differ")
        return self


class NodeStarted(NodeEvent):
    """A node (re)started with a new ``epoch``: its device/host placements of older epochs are gone."""

    TYPE: ClassVar[str] = "NodeStarted"
    namespace: Name


class BlockStored(NodeEvent):
    TYPE: ClassVar[str] = "BlockStored"
    blocks: Annotated[list[StoredBlock], Field(min_length=1, max_length=MAX_BLOCKS_PER_EVENT)]


class BlockRemoved(NodeEvent):
    TYPE: ClassVar[str] = "BlockRemoved"
    blocks: Annotated[list[RemovedBlock], Field(min_length=1, max_length=MAX_BLOCKS_PER_EVENT)]
    reason: RemovalReason


class BlockMoved(NodeEvent):
    TYPE: ClassVar[str] = "BlockMoved"
    blocks: Annotated[list[MovedBlock], Field(min_length=1, max_length=MAX_BLOCKS_PER_EVENT)]


class SnapshotWritten(NodeEvent):
    """A consistent snapshot now holds ``block_hashes`` (a tier of its own in the ledger).

    A snapshot too large for one record is listed by ``parts`` consecutive records (this
    node's next seqs), part ``part`` carrying a slice: part 0 replaces what the ledger held
    for the snapshot, each later part adds to it. The part fields are left out of a
    snapshot of one record, which encodes as before.
    """

    TYPE: ClassVar[str] = "SnapshotWritten"
    snapshot_id: Name
    block_hashes: Annotated[list[HexDigest], Field(max_length=MAX_HASHES_PER_EVENT)]
    part: SmallCount = Field(0, exclude_if=lambda value: value == 0)
    parts: Annotated[int, Strict(), Field(ge=1, le=MAX_INT32)] = Field(
        1, exclude_if=lambda value: value == 1
    )

    @model_validator(mode="after")
    def _part_in_range(self) -> SnapshotWritten:
        if self.part >= self.parts:
            raise ValueError(f"part {self.part} is out of range for {self.parts} parts")
        return self


class SnapshotDeleted(NodeEvent):
    TYPE: ClassVar[str] = "SnapshotDeleted"
    snapshot_id: Name


class Placement(_Model):
    """One copy of a block on a node; ``snapshot_id`` is set exactly for the ``snapshot`` tier."""

    block_hash: HexDigest
    tier: Tier
    snapshot_id: Name | None = None

    @model_validator(mode="after")
    def _snapshot_id_matches_tier(self) -> Placement:
        if (self.tier == Tier.SNAPSHOT) != (self.snapshot_id is not None):
            raise ValueError("snapshot_id is required for tier 'snapshot' and forbidden otherwise")
        return self


class Inventory(NodeEvent):
    """Everything a node holds, for reconciliation after a ``seq`` gap or a restart.

    ``blocks`` carries provenance for every hash in ``placements``, so the coordinator
    can (re)create ledger rows it never saw. A large inventory is split into
    ``chunks`` records sharing ``request_id``/``epoch``; the coordinator reconciles
    (and treats unlisted placements as gone) only once chunk ``chunks - 1`` of a
    complete set has arrived.
    """

    TYPE: ClassVar[str] = "Inventory"
    request_id: uuid.UUID | None = None
    placements: Annotated[list[Placement], Field(max_length=MAX_BLOCKS_PER_EVENT)]
    blocks: Annotated[list[BlockProvenance], Field(max_length=MAX_BLOCKS_PER_EVENT)]
    chunk: SmallCount = 0
    chunks: Annotated[int, Strict(), Field(ge=1, le=MAX_INT32)] = 1

    @model_validator(mode="after")
    def _consistent(self) -> Inventory:
        if self.chunk >= self.chunks:
            raise ValueError(f"chunk {self.chunk} is out of range for {self.chunks} chunks")
        described = {block.block_hash for block in self.blocks}
        missing = sorted({p.block_hash for p in self.placements} - described)
        if missing:
            raise ValueError(
                f"placements without provenance in blocks: {len(missing)} (first {missing[0]})"
            )
        return self


class NodeHeartbeat(EventPayload):
    """Liveness; ``seq`` is the node's last used kv-event seq, so a silent gap is noticed too."""

    TYPE: ClassVar[str] = "NodeHeartbeat"
    node_id: Name
    epoch: Count
    seq: Count | None = None


class UsageReported(NodeEvent):
    """What one node served one tenant in ``[window_start, window_end)``: counts only, never content.

    The ledger's source for ``kvledger cost report`` (docs/operations.md, "Cost"). One record per
    tenant and reporting interval, in the node's seq chain, so a resent record (same event id)
    is counted once by the inbox and a lost one shows as a gap.
    """

    TYPE: ClassVar[str] = "UsageReported"
    tenant_id: Name
    window_start: AwareDatetime
    window_end: AwareDatetime
    num_requests: Annotated[int, Strict(), Field(ge=1, le=MAX_SAFE_INT)]
    num_prompt_tokens: Count
    num_cached_tokens: Count
    num_output_tokens: Count

    @model_validator(mode="after")
    def _consistent(self) -> UsageReported:
        if self.window_end < self.window_start:
            raise ValueError("window_end must not precede window_start")
        if self.num_cached_tokens > self.num_prompt_tokens:
            raise ValueError("num_cached_tokens cannot exceed num_prompt_tokens")
        return self


# --- coordinator → nodes (kvledger.commands) --------------------------------


class DocumentPredicate(_Model):
    """Blocks of ``tenant`` containing ``doc_id`` at a version below ``below_version``."""

    kind: Literal["document"] = "document"
    tenant: Name
    doc_id: Name
    below_version: VersionBound


class PolicyPredicate(_Model):
    """Blocks of ``tenant`` built under ``auth_scope`` at a policy version below ``below_version``."""

    kind: Literal["policy"] = "policy"
    tenant: Name
    auth_scope: Name
    below_version: VersionBound


class SubjectPredicate(_Model):
    """Blocks of one subject: its user blocks, and every block of any scope that its requests created.

    ``subject_id`` is its :func:`subject_digest`, compared with both ``subject_id`` and
    ``creator_subject_id`` of a block's provenance.
    """

    kind: Literal["subject"] = "subject"
    tenant: Name
    subject_id: HexDigest


class NamespacePredicate(_Model):
    """Every block of a namespace (model/tokenizer/template retired)."""

    kind: Literal["namespace"] = "namespace"
    ns: Name


class TenantPredicate(_Model):
    """Every block of a tenant (offboarding)."""

    kind: Literal["tenant"] = "tenant"
    tenant: Name


Predicate = Annotated[
    DocumentPredicate | PolicyPredicate | SubjectPredicate | NamespacePredicate | TenantPredicate,
    Field(discriminator="kind"),
]


class Invalidate(EventPayload):
    """Remove every block matching ``predicate`` that was created before ``cutoff``.

    The node tombstones matches first (no further hits), then destroys bytes in every
    tier, then answers with a :class:`CommandAck`. ``cutoff`` lets blocks built after
    the decision (from already-current data) survive.
    """

    TYPE: ClassVar[str] = "Invalidate"
    command_id: uuid.UUID
    predicate: Predicate
    cutoff: AwareDatetime


class InventoryRequested(EventPayload):
    """Ask ``node_id`` for an :class:`Inventory` answering ``request_id``."""

    TYPE: ClassVar[str] = "InventoryRequested"
    node_id: Name
    request_id: uuid.UUID


Command = Invalidate | InventoryRequested
"""What the coordinator tells nodes on ``kvledger.commands``, each signed with its command key;
that topic carries these payloads and no others (``events.topics.TYPES_BY_TOPIC``)."""


# --- nodes → coordinator (kvledger.acks) ------------------------------------


class TierEvidence(_Model):
    """What one tier of a node did for a command, and the check made afterwards.

    ``block_hashes`` lists the removed blocks (the receipt commits to them);
    ``key_ids`` names data keys destroyed by ``crypto_erase``. ``verified`` is the
    outcome of ``post_check``; a false value keeps the command (and any erasure
    depending on it) from being reported as done.
    """

    tier: Tier
    removed: Count
    block_hashes: Annotated[list[HexDigest], Field(max_length=MAX_HASHES_PER_EVENT)]
    method: EraseMethod
    post_check: PostCheck
    verified: Annotated[bool, Strict()]
    key_ids: Annotated[list[Name], Field(max_length=MAX_HASHES_PER_EVENT)] = []

    @model_validator(mode="after")
    def _count_matches(self) -> TierEvidence:
        if self.removed != len(self.block_hashes):
            raise ValueError(
                f"removed={self.removed} but {len(self.block_hashes)} block_hashes listed"
            )
        return self


class CommandAck(EventPayload):
    """A node finished ``command_id`` in ``epoch``; ``evidence`` has one entry per tier touched.

    An ack too large for one record is split into ``parts`` records sharing ``ack_id``, part
    ``part`` listing a slice of the evidence (``events.ack_parts``); the ack is the union of all
    of them. The part fields are left out of an ack of one record, which encodes as before.

    ``after_seq`` fences the ack into the node's kv-events stream: the last ``seq`` of ``epoch``
    the broker had taken from the node when the ack was built, so every block event that
    describes the command's removals (and every ``SnapshotWritten`` it rewrote) is at or below
    it. The coordinator applies the ack only once its ledger holds the node's events through
    that seq (``coordinator.handlers.acks``). Left out when unset (a node that does not fence).
    """

    TYPE: ClassVar[str] = "CommandAck"
    command_id: uuid.UUID
    node_id: Name
    epoch: Count
    evidence: Annotated[list[TierEvidence], Field(max_length=MAX_LIST_ITEMS)]
    ack_id: uuid.UUID | None = Field(None, exclude_if=lambda value: value is None)
    """Names one ack split into ``parts`` records (``events.ack_parts``): every part carries it; unset on an ack of one record."""
    part: SmallCount = Field(0, exclude_if=lambda value: value == 0)
    parts: Annotated[int, Strict(), Field(ge=1, le=MAX_ACK_PARTS)] = Field(
        1, exclude_if=lambda value: value == 1
    )
    after_seq: Count | None = Field(None, exclude_if=lambda value: value is None)

    @model_validator(mode="after")
    def _part_in_range(self) -> CommandAck:
        if self.part >= self.parts:
            raise ValueError(f"part {self.part} is out of range for {self.parts} parts")
        if self.parts > 1 and self.ack_id is None:
            raise ValueError("an ack of several parts needs ack_id")
        return self


EVENT_TYPES: dict[str, type[EventPayload]] = {
    model.TYPE: model
    for model in (
        DocumentUpdated,
        DocumentDeleted,
        PermissionRevoked,
        ErasureRequested,
        NodeStarted,
        BlockStored,
        BlockRemoved,
        BlockMoved,
        SnapshotWritten,
        SnapshotDeleted,
        Inventory,
        NodeHeartbeat,
        UsageReported,
        Invalidate,
        InventoryRequested,
        CommandAck,
    )
}
"""Envelope ``type`` → payload model: the single registry both ends validate against."""


# ---------------------------------------------------------------------------
# Envelope
# ---------------------------------------------------------------------------


class RecordSignature(_Model):
    """Who signed an envelope and how: ``kid`` names the Ed25519 key (hex of the first 16 bytes of the
    SHA-256 of its raw public key), ``sig`` is the unpadded base64url signature over the RFC 8785
    canonical JSON of the envelope without ``signature`` (``identity.signing``, ``docs/events.md``)."""

    kid: str = Field(pattern=r"^[0-9a-f]{32}$")
    sig: str = Field(pattern=r"^[A-Za-z0-9_-]{86}$")


class Envelope(_Model):
    """One record value. ``event_id`` is the idempotency key of the consumers' inbox.

    ``signature`` is absent on records nobody signs (customer events); commands carry the
    coordinator's, kv-events and acks their node's. It is left out of the encoding when unset.
    """

    event_id: uuid.UUID
    type: str
    schema_version: Literal[1]
    occurred_at: AwareDatetime
    tenant_id: Name | None
    payload: SerializeAsAny[EventPayload]
    signature: RecordSignature | None = Field(None, exclude_if=lambda value: value is None)

    @field_validator("occurred_at", mode="before")
    @classmethod
    def _rfc3339_text(cls, value: Any) -> Any:
        # Pydantic would also take a unix number; the contract says RFC 3339 text.
        if not isinstance(value, (str, datetime)):
            raise ValueError("occurred_at must be an RFC 3339 timestamp string")
        return value

    @model_validator(mode="before")
    @classmethod
    def _typed_payload(cls, data: Any) -> Any:
        """Validate ``payload`` against the model that ``type`` names, reporting errors under
        ``payload``."""
        if not isinstance(data, dict):
            return data
        event_type = data.get("type")
        payload = data.get("payload")
        if (
            not isinstance(event_type, str)
            or isinstance(payload, EventPayload)
            or not isinstance(payload, dict)
        ):
            return data  # field validation reports the missing/mistyped fields
        model = EVENT_TYPES.get(event_type)
        if model is None:
            raise ValueError(
                f"unknown event type {event_type[:64]!r}"
            )  # bounded: the text is the sender's
        try:
            typed = model.model_validate(payload)
        except ValidationError as exc:
            raise ValidationError.from_exception_data(
                cls.__name__,
                [_prefixed(error, "payload") for error in exc.errors()],
            ) from None
        return {**data, "payload": typed}

    @model_validator(mode="after")
    def _type_matches(self) -> Envelope:
        model = EVENT_TYPES.get(self.type)
        if model is None:
            raise ValueError(f"unknown event type {self.type!r}")
        if type(self.payload) is not model:
            raise ValueError(
                f"type {self.type!r} does not match payload {type(self.payload).__name__}"
            )
        if model.TENANT_REQUIRED and self.tenant_id is None:
            raise ValueError(f"{self.type} events must carry tenant_id")
        return self


def _prefixed(error: Any, prefix: str) -> InitErrorDetails:
    details: InitErrorDetails = {
        "type": error["type"],
        "loc": (prefix, *error["loc"]),
        "input": error["input"],
    }
    if "ctx" in error:
        details["ctx"] = error["ctx"]
    return details


class EventValidationError(ValueError):
    """A record that does not satisfy this contract. ``str()`` is a one-line, human-readable reason.

    The message names fields and problems but never echoes input values, so it is safe to
    log and to put on the dead-letter topic next to the (separately encoded) raw record.
    """


MAX_LOCATION_PART_CHARS = 64
"""The longest part of a field's location a validation error names: the sender chose the keys."""
MAX_DESCRIBED_ERRORS = 10
"""How many of a record's validation errors are described; the rest are counted."""


def _location_part(part: str | int) -> str:
    text = str(part)
    if len(text) > MAX_LOCATION_PART_CHARS:
        text = text[: MAX_LOCATION_PART_CHARS - 1] + "…"
    return escape_control(text)


def describe_validation_error(exc: ValidationError) -> str:
    """Fields and problems of ``exc`` on one line, never the input values (safe to log and
    dead-letter).

    A location is made of the sender's key names, so each part is bounded and escaped
    (``events.logs.escape_control``): a key holding a newline or an ANSI sequence cannot
    forge a log line or a terminal's output. At most :data:`MAX_DESCRIBED_ERRORS` are
    described, so a record with thousands of bad fields has a short description.
    """
    errors = exc.errors(include_url=False, include_input=False)
    parts = []
    for error in errors[:MAX_DESCRIBED_ERRORS]:
        location = ".".join(_location_part(part) for part in error["loc"])
        message = escape_control(error["msg"])
        parts.append(f"{location}: {message}" if location else message)
    if len(errors) > MAX_DESCRIBED_ERRORS:
        parts.append(f"and {len(errors) - MAX_DESCRIBED_ERRORS} more errors")
    return "; ".join(parts)


def parse_event(data: bytes | str) -> Envelope:
    """Decode and validate one record value, payload typed by ``type``.

    Raises :class:`EventValidationError` for anything malformed: not JSON, not an
    object, unknown ``type``, missing or extra fields, wrong ``schema_version``.
    """
    try:
        return Envelope.model_validate_json(data)
    except ValidationError as exc:
        raise EventValidationError(describe_validation_error(exc)) from None


def make_event(payload: EventPayload, tenant_id: str | None = None) -> Envelope:
    """Wrap a payload in a fresh envelope (new event id, ``occurred_at`` = now, UTC)."""
    return Envelope(
        event_id=uuid.uuid4(),
        type=payload.TYPE,
        schema_version=SCHEMA_VERSION,
        occurred_at=datetime.now(UTC),
        tenant_id=tenant_id,
        payload=payload,
    )
