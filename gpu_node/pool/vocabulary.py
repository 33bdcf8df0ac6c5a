"""The block pool's vocabulary: entry states, entries, events, removal reports and stats.

Its own module so the pool (:mod:`gpu_node.pool.block_pool`), its state
(:mod:`gpu_node.pool.state`) and its parts share one definition, and callers
(the cache manager, the publisher, the command applier) import it without the
pool. A block's tier is the contract's one tier enum, :class:`events.tiers.Tier`
(a node block lives in one of its ``STORAGE_TIERS``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum, StrEnum
from pathlib import Path

from events.tiers import Tier
from prefix_keys.blocks import BlockKey, CacheProvenance, CacheScope


class BlockState(Enum):
    """Lifecycle of a pool entry; ABSENT is "not in the pool" and has no member."""

    BUILDING = "building"
    READY = "ready"
    EVICTING = "evicting"
    FAILED = "failed"


class RemovalReason(StrEnum):
    EVICTED = "evicted"
    EXPIRED = "expired"
    INVALIDATED = "invalidated"
    RESTORE_FAILED = "restore_failed"


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """Capacities per tier and per-scope TTLs (None: no TTL) for one namespace."""

    namespace: str
    num_device_blocks: int
    num_host_blocks: int
    max_disk_blocks: int
    disk_dir: Path | None
    ttl_s: Mapping[CacheScope, float | None]
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not self.namespace:
            raise ValueError("namespace must not be empty")
        for name in ("num_device_blocks", "num_host_blocks", "max_disk_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        missing = [scope.label for scope in CacheScope if scope not in self.ttl_s]
        if missing:
            # A forgotten scope must not silently mean "keep forever": retention is a privacy limit.
            raise ValueError(
                f"ttl_s needs an entry (seconds or None) for every scope; missing {missing}"
            )
        for scope, ttl_s in self.ttl_s.items():
            if ttl_s is not None and ttl_s <= 0:
                raise ValueError(
                    f"ttl for {CacheScope(scope).label} scope must be positive or None, got {ttl_s}"
                )


@dataclass(eq=False, slots=True)
class CacheEntry:
    """One block in the pool. ``tier``/``slot`` say where its bytes are (slot: device/host index)."""

    key: BlockKey
    state: BlockState
    tier: Tier | None = None
    slot: int | None = None
    ref_count: int = 0
    last_access: float = 0.0
    expires_at: float | None = None
    tombstoned: bool = False
    removal_reason: RemovalReason | None = None

    @property
    def block_hash(self) -> bytes:
        return self.key.block_hash

    @property
    def provenance(self) -> CacheProvenance:
        return self.key.provenance


METHOD_ZERO_FILL = "zero_fill"
METHOD_OVERWRITE_UNLINK = "overwrite_unlink"


@dataclass(frozen=True, slots=True)
class RemovalEvidence:
    """How one block's bytes were deleted and the post-check result.

    ``zero_fill``: the memory slot was overwritten with zeros and read back as
    zero (NIST 800-88 Clear). ``overwrite_unlink``: the file was zeroed and
    unlinked and its path checked absent; ``encrypted`` says whether it held
    ciphertext, which destroying the scope key additionally purges, and
    ``key_id`` names that key (as written in the file's header; None for
    plaintext), so an erasure knows which keys to destroy.
    """

    block_hash: bytes
    tier: Tier
    method: str
    encrypted: bool
    verified: bool
    key_id: str | None = None


# Pool events: what :meth:`BlockPool.take_events` reports, one per change of bytes, in order. They
# are named apart from the kv-events records of :mod:`events.schema` (``BlockStored``,
# ``BlockRemoved``, ``BlockMoved``) on purpose: a pool event is one block, in-process, with raw
# provenance and removal evidence; a record batches many blocks and carries only what the ledger may
# see. The one translation (pool event → record) is
# :meth:`gpu_node.governance.publisher.NodePublisher._payload`.


@dataclass(frozen=True, slots=True)
class ReplicaSource:
    """Where a pulled block's bytes came from: the peer node that held it and when this node pulled it (wall clock)."""

    node_id: str
    pulled_at_wall: float


@dataclass(frozen=True, slots=True)
class StoredInPool:
    """A block became READY in ``tier`` (built, pulled from a peer, or imported from a record); becomes a ``BlockStored`` record."""

    key: BlockKey
    tier: Tier
    source: ReplicaSource | None = None
    """Set for a replica pulled from a peer (``gpu_node.cache.peers``); None for a block computed or
    warmed here."""


@dataclass(frozen=True, slots=True)
class RemovedFromPool:
    """Bytes of a block were deleted; ``evidence`` is set by the pool for every removal. Becomes a
    ``BlockRemoved`` record."""

    block_hash: bytes
    tier: Tier
    reason: RemovalReason
    evidence: RemovalEvidence | None = None


@dataclass(frozen=True, slots=True)
class MovedInPool:
    """A READY block's bytes moved between tiers (demotion or promotion); becomes a ``BlockMoved``
    record."""

    block_hash: bytes
    from_tier: Tier
    to_tier: Tier


PoolEvent = StoredInPool | RemovedFromPool | MovedInPool

IndexKey = tuple
"""Names the entries that may match a removal predicate (:meth:`BlockPool.remove_where`'s
``candidates``).

One of ``("tenant", tenant_id)``, ``("document", tenant_id, doc_id)`` (any
version of the document), ``("policy", tenant_id, auth_scope)`` (any policy
version) or ``("namespace", namespace)``. The entries under a key are a
superset of what a predicate on it can match; the predicate still decides.
"""

INDEX_KINDS = frozenset({"tenant", "document", "policy", "namespace"})


def provenance_index_keys(provenance: CacheProvenance) -> list[IndexKey]:
    """The provenance index keys a block is filed under (every key but ``namespace``, which is the
    whole pool)."""
    tenant = provenance.tenant_id
    keys: list[IndexKey] = [("tenant", tenant)]
    for tag in provenance.documents:
        keys.append(("document", tenant, tag.rpartition("@")[0]))
    for scope, _ in provenance.auth_scopes:
        keys.append(("policy", tenant, scope))
    return keys


@dataclass(frozen=True, slots=True)
class RemovalReport:
    """Outcome of :meth:`BlockPool.remove_where`, the basis of a command ack.

    ``removed`` had their bytes deleted now (``num_removed`` per tier,
    ``evidence`` one per block); ``deferred`` are held by readers, tombstoned,
    and deleted when released (their ``RemovedFromPool`` event carries evidence);
    ``discarded_building`` will be discarded at commit and never become READY.
    """

    reason: RemovalReason
    num_removed: Mapping[Tier, int]
    removed: tuple[bytes, ...]
    deferred: tuple[bytes, ...]
    discarded_building: tuple[bytes, ...]
    evidence: tuple[RemovalEvidence, ...]

    @property
    def all_verified(self) -> bool:
        return all(item.verified for item in self.evidence)


@dataclass(frozen=True, slots=True)
class PoolStats:
    """Entries and bytes per tier (disk bytes are file sizes), plus lifetime counters."""

    num_entries: Mapping[Tier, int]
    tier_bytes: Mapping[Tier, int]
    num_building: int
    num_evictions: int
    num_expired: int
    num_demotions: int
    num_promotions: int
    num_restore_failures: int
