"""The router's exact block index: block hash → {node: tier}, fed by kv-events, rebuilt from the
ledger.

Pure (no I/O, no clock of its own: callers pass ``now``), so every update and every lookup is
unit-tested with exact expectations (tests/router/test_index.py).

**What a lookup answers.** For the caller's block keys (the chained hashes ``prefix_keys``
computes, first block first), every node's *run*: how many keys from the first one it holds in a
serving tier without a hole, and that run weighted by tier (:class:`TierWeights`: device > host >
disk). Snapshot copies are not listed at all: a node serves from its tiers, and a snapshot is
only read at a warm start, whose blocks then arrive as ``BlockStored``.

**How it stays exact.** Every node's kv-events carry ``(epoch, seq)``; :meth:`PrefixIndex.apply`
applies the next seq, skips duplicates and older epochs, and on a hole (a lost record, a new epoch
that did not begin with ``NodeStarted``, a heartbeat naming a seq never received, a node never
seen) applies what it has and marks the node for a re-read (:attr:`NodeState.reread_reason`):
the feed then reads the node's live placements from the ledger and hands them to
:meth:`PrefixIndex.replace_node`, which also replays the node's records consumed after the
ledger's last seq (:data:`RECENT_EVENTS` are kept per node), so the index is never wrong for
longer than one read. ``NodeStarted`` of a new epoch drops the node's device and host copies (the
process restarted; disk copies survive and its ``Inventory`` confirms or removes them), as the
ledger does. A complete ``Inventory`` replaces the node's copies.

**Governance.** :meth:`PrefixIndex.invalidate` drops every block a coordinator decision matches
(the same predicates a node applies, ``events.schema.Predicate``) and that was created before
the decision's cutoff, from every node at once, so a block being deleted stops attracting
traffic before any node acks. The cutoff keeps a replayed old command from dropping blocks built
after it; a node whose clock runs ahead of the coordinator's may keep a just-built match listed
until its own ``BlockRemoved`` arrives — a wasted routing choice, never a served block (the node
enforces every decision itself). Keys are salted by scope (``prefix_keys.blocks.scope_salt``), so
a caller's keys can only ever match blocks of its own scopes and public ones.

**Why lookups are cheap.** Block keys are chained: each commits to its parent, and every
``BlockStored`` names the parent it was chained from. So each entry keeps, along the parents the
index holds, its chain's *run* (the bit mask of the nodes holding every block from the chain's
start to it: its own mask AND its parent's run) and the chain's tier weights for those nodes, packed
into one integer, a :data:`LANE_BITS`-bit lane per node. A change to one node's copy recomputes the
entries below it only as far as their values change (a node's run changes only below where it
changed), so a store at the end of a chain costs one entry. A lookup fetches the caller's entries up
to the first missing key (the floor of any exact index kept in a Python dict), checks that each
one's recorded parent is the key before it, and, along the run masks (which only lose bits down a
chain), bisects to each point where some nodes' runs end; the matches ending at an entry are built
once and kept on it until its values change. Keys that are not a recorded chain (a parent the
first ``BlockStored`` did not name, a ledger read that carries none, keys that do not start a
chain) are counted along the keys instead (:attr:`PrefixIndex.num_walks`): the same answer, one AND
and one sum per key. Both are checked against a naive count over random event sequences
(tests/router/test_index_chains.py).
"""

from __future__ import annotations

import bisect
import collections
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate
from operator import and_, attrgetter
from typing import NamedTuple

from events.schema import (
    BlockMoved,
    BlockProvenance,
    BlockRemoved,
    BlockStored,
    DocumentPredicate,
    Inventory,
    NamespacePredicate,
    NodeEvent,
    NodeHeartbeat,
    NodeStarted,
    PolicyPredicate,
    Predicate,
    SubjectPredicate,
    TenantPredicate,
)
from events.tiers import Tier

LANE_BITS = 32
"""Bits of one node's lane in an entry's packed weights: room for 2^32 / the device weight blocks in
one run."""
_LANE_MASK = (1 << LANE_BITS) - 1

MAX_NODES = 4096
"""Nodes one index tracks (each takes a bit and a lane for good): far more than a fleet, a bound on
hostile ids."""
MAX_CACHED_MASKS = 65_536
"""Node masks whose bit positions a lookup remembers (``PrefixIndex._bits``)."""
RECENT_EVENTS = 4096
"""Records kept per node for the replay after a ledger read (:meth:`PrefixIndex.replace_node`)."""

_TIER_BITS = {Tier.DEVICE: 1, Tier.HOST: 2, Tier.DISK: 4}
SERVING_TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)

APPLIED = "applied"
DUPLICATE = "duplicate"
STALE = "stale"
GAP = "gap"
RESTARTED = "restarted"


@dataclass(frozen=True, slots=True)
class TierWeights:
    """What one cached block is worth by the tier it would be read from (integers: they are packed into lanes).

    Device is read in place; host is a copy to the device; disk a file read, decryption and copy.
    A block held in several tiers of one node counts by its best one.
    """

    device: int = 4
    host: int = 3
    disk: int = 1

    def __post_init__(self) -> None:
        if not self.device >= self.host >= self.disk >= 1:
            raise ValueError("tier weights must satisfy device >= host >= disk >= 1")

    def of_bits(self, bits: int) -> int:
        if bits & 1:
            return self.device
        return self.host if bits & 2 else self.disk


@dataclass(frozen=True, slots=True)
class BlockTags:
    """What a decision's predicate is matched against (a block's provenance as the ledger records it).

    ``subject_id`` is the keyed subject digest of a user block; ``created_at`` is POSIX seconds.
    """

    namespace: str
    tenant_id: str | None
    subject_id: str | None
    documents: tuple[tuple[str, int], ...]
    auth_scopes: tuple[tuple[str, int], ...]
    created_at: float

    @classmethod
    def of(cls, provenance: BlockProvenance) -> BlockTags:
        documents = []
        for tag in provenance.documents:
            doc_id, _, version = tag.rpartition("@")
            documents.append((doc_id, int(version)))
        return cls(
            namespace=provenance.namespace,
            tenant_id=provenance.tenant_id,
            subject_id=provenance.subject_id,
            documents=tuple(documents),
            auth_scopes=tuple((scope, version) for scope, version in provenance.auth_scopes),
            created_at=provenance.created_at.timestamp(),
        )


@dataclass(frozen=True, slots=True)
class Placement:
    """One live copy as the ledger lists it (:meth:`PrefixIndex.replace_node`); ``parent_hash``
    links it into its chain (None: its entry is looked up by walking until a ``BlockStored`` names
    its parent)."""

    block_hash: bytes
    tier: Tier
    tags: BlockTags
    creators: tuple[str, ...] = ()
    parent_hash: bytes | None = None


class PrefixMatch(NamedTuple):
    """A node's run over a caller's keys: ``num_blocks`` from the first, ``weighted_blocks`` in device blocks.

    A NamedTuple: a lookup builds one per node, and a tuple is the cheapest object to build.
    """

    node_id: str
    num_blocks: int
    weighted_blocks: float


class _Entry:
    __slots__ = (
        "block_hash",
        "mask",
        "packed",
        "tiers",
        "tags",
        "creators",
        "parent_hash",
        "parent",
        "run",
        "below",
        "cum",
        "groups",
    )

    def __init__(self, block_hash: bytes, tags: BlockTags, parent_hash: bytes | None) -> None:
        self.block_hash = block_hash
        self.mask = 0
        self.packed = 0
        self.tiers: dict[int, int] = {}
        """Node index → tier bits held there."""
        self.tags = tags
        self.creators: set[str] = set()
        self.parent_hash = parent_hash
        """The parent the block's first ``BlockStored`` named (None: not known)."""
        self.parent: _Entry | None = None
        """The entry of ``parent_hash`` while the index holds it (None: this entry starts a chain)."""
        self.run = 0
        """Nodes holding every block of the chain from its start to this one (``mask`` AND the parent's ``run``)."""
        self.below = 0
        """``-run``: ascending along a chain, so a lookup bisects the entries themselves."""
        self.cum = 0
        """The tier weights of the chain up to this block, a lane per node of ``run`` (other lanes 0)."""
        self.groups: dict[int, tuple[PrefixMatch, ...]] | None = None
        """The matches of the nodes of a mask whose run ends here, built by a lookup; dropped when
        ``run`` or ``cum`` change."""


_new_match = tuple.__new__
"""Builds a :class:`PrefixMatch` without the Python-level ``__new__`` of a NamedTuple (a lookup builds one per node)."""
_MASK = attrgetter("mask")
_PACKED = attrgetter("packed")
_PARENT = attrgetter("parent")
_BELOW = attrgetter("below")


class NodeState:
    """One node as the index knows it: its bit, its position in its event stream, its copies, when it was last heard."""

    __slots__ = (
        "node_id",
        "index",
        "epoch",
        "last_seq",
        "reread_reason",
        "last_seen",
        "recent",
        "blocks",
        "num_blocks",
        "_inventory",
    )

    def __init__(self, node_id: str, index: int) -> None:
        self.node_id = node_id
        self.index = index
        self.epoch: int | None = None
        self.last_seq: int | None = None
        self.reread_reason: str | None = None
        """Why the node's copies must be read from the ledger again (None: they are exact)."""
        self.last_seen: float | None = None
        self.recent: collections.deque[NodeEvent] = collections.deque(maxlen=RECENT_EVENTS)
        self.blocks: set[bytes] = set()
        self.num_blocks: collections.Counter[Tier] = collections.Counter()
        self._inventory: dict[tuple[object, int], dict[int, Inventory]] = {}

    def _verdict(self, event: NodeEvent) -> str:
        if self.epoch is None:
            return RESTARTED if isinstance(event, NodeStarted) else GAP
        if event.epoch < self.epoch:
            return STALE
        if event.epoch > self.epoch:
            return RESTARTED if isinstance(event, NodeStarted) else GAP
        assert self.last_seq is not None, "an epoch is always known with its seq"
        if event.seq <= self.last_seq:
            return DUPLICATE
        return APPLIED if event.seq == self.last_seq + 1 else GAP


class OldestFirstEviction:
    """Which entries leave an index grown past its bound: the least recently *stored* (dict order).

    The index mirrors what the fleet holds, so it only overflows when the bound is set below the
    fleet's capacity; forgetting a block then costs a routing choice, never correctness.
    """

    def victims(self, blocks: dict[bytes, _Entry], count: int) -> list[bytes]:
        return list(itertools.islice(iter(blocks), count))


class PrefixIndex:
    """The index of one router process (see the module docstring). Not thread-safe: one event loop owns it."""

    def __init__(
        self,
        weights: TierWeights | None = None,
        max_blocks: int = 10_000_000,
        eviction: OldestFirstEviction | None = None,
    ) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self.weights = weights or TierWeights()
        if max_blocks * self.weights.device > _LANE_MASK:
            raise ValueError("max_blocks × the device weight must fit a lane (a chain's weight)")
        self.max_blocks = max_blocks
        self.eviction = eviction or OldestFirstEviction()
        self._blocks: dict[bytes, _Entry] = {}
        self._nodes: dict[str, NodeState] = {}
        self._node_ids: list[str] = []
        self._by_tenant: dict[str, set[bytes]] = collections.defaultdict(set)
        self._by_namespace: dict[str, set[bytes]] = collections.defaultdict(set)
        self._by_creator: dict[str, set[bytes]] = collections.defaultdict(set)
        self._children: dict[bytes, set[_Entry]] = {}
        """Parent hash → the entries that named it, whether the index holds the parent or not."""
        self._indexes: dict[int, tuple[int, ...]] = {}
        self._lanes: dict[int, int] = {}
        self.num_evicted = 0
        self.num_walks = 0
        """Lookups whose keys were not a recorded chain, counted along the keys instead."""

    # -- reading ----------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._blocks)

    def node(self, node_id: str) -> NodeState | None:
        return self._nodes.get(node_id)

    @property
    def nodes(self) -> list[NodeState]:
        return list(self._nodes.values())

    def holders(self, block_hash: bytes) -> dict[str, Tier]:
        """The nodes holding ``block_hash`` and the best tier each holds it in."""
        entry = self._blocks.get(block_hash)
        if entry is None:
            return {}
        return {self._node_ids[index]: _best_tier(bits) for index, bits in entry.tiers.items()}

    def match(self, keys: Sequence[bytes]) -> list[PrefixMatch]:
        """Every node's run over ``keys`` (nodes with a run of at least one block), shortest first.

        When ``keys`` follow the chain the index recorded (the first starts a chain, each next
        one's parent is the one before: what ``prefix_keys`` computes), every entry already carries
        its chain's runs and weights, and only the points where a run ends are visited; otherwise
        the runs are counted along the keys (:attr:`num_walks`). Both answer the same.
        """
        # Entries up to the first missing key (a None appended ends every list): what follows it,
        # None included, is cut at once.
        entries: list[_Entry] = list(map(self._blocks.get, keys))  # type: ignore[arg-type]
        entries.append(None)  # type: ignore[arg-type]
        end = entries.index(None)  # type: ignore[arg-type]
        del entries[end:]
        if end == 0:
            return []
        parents = list(map(_PARENT, entries))
        if parents[0] is not None or parents[1:] != entries[:-1]:
            self.num_walks += 1
            return self._match_walk(entries, end)
        # A recorded chain: each entry's ``run`` is the AND of the masks up to it, so bisection
        # finds where runs end, and ``cum`` holds the weights up to there.
        matches: list[PrefixMatch] = []
        value = entries[0].run
        deepest = entries[-1].run
        start = 0
        while value:
            if value == deepest:  # these runs reach the last key (often all of them)
                stop = end
            else:
                # ``below`` (-run) only grows along a chain: the first entry past the stretch.
                stop = bisect.bisect_right(entries, -value, start, end, key=_BELOW)
            last = entries[stop - 1]
            following = entries[stop].run if stop < end else 0
            leaving = value & ~following
            groups = last.groups
            if groups is None:
                groups = last.groups = {}
            group = groups.get(leaving)
            if group is None:
                group = groups[leaving] = self._group(leaving, stop, last.cum)
            matches += group
            value, start = following, stop
        return matches

    def _group(self, leaving: int, num_blocks: int, cum: int) -> tuple[PrefixMatch, ...]:
        """The matches of the nodes of ``leaving``, whose runs end after ``num_blocks`` with lanes
        ``cum``."""
        node_ids, device = self._node_ids, self.weights.device
        return tuple(
            _new_match(
                PrefixMatch,
                (node_ids[index], num_blocks, (cum >> index * LANE_BITS & _LANE_MASK) / device),
            )
            for index in self._indexes.get(leaving) or self._bits(leaving)
        )

    def _match_walk(self, entries: list[_Entry], end: int) -> list[PrefixMatch]:
        """The runs counted along the caller's entries, whatever chain they belong to."""
        assert end * self.weights.device <= _LANE_MASK, "a run's weight must fit its lane"
        masks = list(accumulate(map(_MASK, entries), and_))
        totals = list(accumulate(map(_PACKED, entries)))
        ascending = masks[::-1]
        node_ids, device, indexes, new = (
            self._node_ids,
            self.weights.device,
            self._indexes,
            _new_match,
        )
        matches = []
        value = masks[0]
        while value:
            # The last position holding ``value``: masks only lose bits, so they never increase.
            stop = end - bisect.bisect_left(ascending, value)
            total = totals[stop - 1]
            following = masks[stop] if stop < end else 0
            leaving = value & ~following
            for index in indexes.get(leaving) or self._bits(leaving):
                matches.append(
                    new(
                        PrefixMatch,
                        (node_ids[index], stop, (total >> index * LANE_BITS & _LANE_MASK) / device),
                    )
                )
            value = following
        return matches

    def _bits(self, mask: int) -> tuple[int, ...]:
        """The node indexes of ``mask``'s bits, remembered (at most :data:`MAX_CACHED_MASKS` masks)."""
        bits = tuple(index for index in range(mask.bit_length()) if mask >> index & 1)
        if len(self._indexes) < MAX_CACHED_MASKS:
            self._indexes[mask] = bits
        return bits

    def num_blocks(self) -> dict[str, dict[Tier, int]]:
        """Copies per node and tier (the router's ``index blocks`` gauge)."""
        return {
            node.node_id: {tier: node.num_blocks[tier] for tier in SERVING_TIERS}
            for node in self._nodes.values()
        }

    # -- node events ------------------------------------------------------------

    def apply(self, event: NodeEvent | NodeHeartbeat, now: float) -> str:
        """Apply one verified kv-event; returns how it was taken (``APPLIED``, ``DUPLICATE``,
        ``STALE``, ``GAP``, ``RESTARTED``)."""
        node = self._node(event.node_id)
        if node is None:
            return STALE
        node.last_seen = now
        if isinstance(event, NodeHeartbeat):
            return self._heartbeat(node, event)
        verdict = self._take(node, event)
        if verdict in (APPLIED, GAP, RESTARTED):
            node.recent.append(event)
        return verdict

    def _take(self, node: NodeState, event: NodeEvent) -> str:
        verdict = node._verdict(event)
        if verdict in (DUPLICATE, STALE):
            return verdict
        if verdict == RESTARTED:
            for tier in (Tier.DEVICE, Tier.HOST):
                self._drop_tier(node, tier)
            node._inventory.clear()
        elif verdict == GAP:
            node.reread_reason = node.reread_reason or (
                f"seq {event.seq} of epoch {event.epoch} follows {node.last_seq} of epoch {node.epoch}"
                if node.epoch is not None
                else "first record of a node the index never read"
            )
        node.epoch, node.last_seq = event.epoch, event.seq
        self._apply_body(node, event)
        return verdict

    def _heartbeat(self, node: NodeState, heartbeat: NodeHeartbeat) -> str:
        if node.epoch is None or heartbeat.epoch > node.epoch:
            node.reread_reason = (
                node.reread_reason
                or f"heartbeat of epoch {heartbeat.epoch}, whose records were not received"
            )
            return GAP
        if (
            heartbeat.epoch == node.epoch
            and heartbeat.seq is not None
            and node.last_seq is not None
            and heartbeat.seq > node.last_seq
        ):
            node.reread_reason = (
                node.reread_reason
                or f"heartbeat names seq {heartbeat.seq}; the last received is {node.last_seq}"
            )
            return GAP
        return APPLIED

    def _apply_body(self, node: NodeState, event: NodeEvent) -> None:
        if isinstance(event, BlockStored):
            for block in event.blocks:
                block_hash = bytes.fromhex(block.block_hash)
                self._add(
                    node,
                    block_hash,
                    block.tier,
                    self._tags(block_hash, block),
                    block.creator_subject_id,
                    parent_hash=_parent_of(block),
                )
        elif isinstance(event, BlockRemoved):
            for removed in event.blocks:
                self._remove(node, bytes.fromhex(removed.block_hash), removed.tier)
        elif isinstance(event, BlockMoved):
            for moved in event.blocks:
                block_hash = bytes.fromhex(moved.block_hash)
                entry = self._blocks.get(block_hash)
                self._remove(node, block_hash, moved.from_tier)
                if entry is not None:  # a block the index dropped (decided, evicted) stays unknown
                    self._add(node, block_hash, moved.to_tier, entry.tags, None)
        elif isinstance(event, Inventory):
            self._inventory_chunk(node, event)

    def _inventory_chunk(self, node: NodeState, inventory: Inventory) -> None:
        """A complete set of chunks replaces the node's copies (what the ledger's reconciliation
        does)."""
        chunks = node._inventory.setdefault((inventory.request_id, inventory.epoch), {})
        chunks[inventory.chunk] = inventory
        if len(chunks) < inventory.chunks or inventory.chunk != inventory.chunks - 1:
            return
        del node._inventory[(inventory.request_id, inventory.epoch)]
        provenance = {
            block.block_hash: block for chunk in chunks.values() for block in chunk.blocks
        }
        for tier in SERVING_TIERS:
            self._drop_tier(node, tier)
        for chunk in chunks.values():
            for placement in chunk.placements:
                if placement.tier == Tier.SNAPSHOT:
                    continue
                block = provenance[placement.block_hash]
                block_hash = bytes.fromhex(placement.block_hash)
                self._add(
                    node,
                    block_hash,
                    placement.tier,
                    self._tags(block_hash, block),
                    block.creator_subject_id,
                    parent_hash=_parent_of(block),
                )

    # -- the ledger -------------------------------------------------------------

    def replace_node(
        self,
        node_id: str,
        epoch: int,
        last_seq: int,
        placements: Iterable[Placement],
        now: float | None = None,
    ) -> str | None:
        """Make ``node_id``'s copies exactly ``placements`` (the ledger's live ones as of ``(epoch,
        last_seq)``), then replay its records consumed after that; returns the node's new re-read
        reason (None: exact)."""
        node = self._node(node_id)
        if node is None:
            return None
        for tier in SERVING_TIERS:
            self._drop_tier(node, tier)
        node._inventory.clear()
        node.epoch, node.last_seq, node.reread_reason = epoch, last_seq, None
        if now is not None:
            node.last_seen = now if node.last_seen is None else max(node.last_seen, now)
        for placement in placements:
            if placement.tier != Tier.SNAPSHOT:
                self._add(
                    node,
                    placement.block_hash,
                    placement.tier,
                    placement.tags,
                    None,
                    placement.creators,
                    placement.parent_hash,
                )
        for event in list(node.recent):
            self._take(node, event)
        return node.reread_reason

    # -- decisions --------------------------------------------------------------

    def invalidate(self, predicate: Predicate, cutoff_s: float) -> int:
        """Drop every block ``predicate`` matches that was created before ``cutoff_s``; returns how
        many blocks went."""
        matches = _matcher(predicate)
        if isinstance(predicate, NamespacePredicate):
            candidates: Iterable[bytes] = self._by_namespace.get(predicate.ns, ())
        elif isinstance(predicate, SubjectPredicate):
            candidates = self._by_tenant.get(predicate.tenant, set()) | self._by_creator.get(
                predicate.subject_id, set()
            )
        else:
            candidates = self._by_tenant.get(predicate.tenant, ())
        doomed = [
            block_hash
            for block_hash in candidates
            if (entry := self._blocks[block_hash]).tags.created_at < cutoff_s
            and matches(entry.tags, entry.creators)
        ]
        for block_hash in doomed:
            self._forget(block_hash)
        return len(doomed)

    # -- internals --------------------------------------------------------------

    def _node(self, node_id: str) -> NodeState | None:
        node = self._nodes.get(node_id)
        if node is None:
            if len(self._node_ids) >= MAX_NODES:
                return None
            node = self._nodes[node_id] = NodeState(node_id, len(self._node_ids))
            self._node_ids.append(node_id)
        return node

    def _tags(self, block_hash: bytes, block: BlockProvenance) -> BlockTags:
        """The tags of a block the index holds stay its first record's (only a new entry reads
        ``block``'s)."""
        entry = self._blocks.get(block_hash)
        return BlockTags.of(block) if entry is None else entry.tags

    def _add(
        self,
        node: NodeState,
        block_hash: bytes,
        tier: Tier,
        tags: BlockTags,
        creator: str | None,
        creators: Iterable[str] = (),
        parent_hash: bytes | None = None,
    ) -> None:
        entry = self._blocks.get(block_hash)
        adopted: Iterable[_Entry] = ()
        if entry is None:
            if len(self._blocks) >= self.max_blocks:
                for victim in self.eviction.victims(
                    self._blocks, len(self._blocks) - self.max_blocks + 1
                ):
                    self._forget(victim)
                    self.num_evicted += 1
            entry = self._blocks[block_hash] = _Entry(block_hash, tags, None)
            if tags.tenant_id is not None:
                self._by_tenant[tags.tenant_id].add(block_hash)
            self._by_namespace[tags.namespace].add(block_hash)
            adopted = self._adopt(entry)
        if parent_hash is not None and entry.parent_hash is None:
            self._name_parent(entry, parent_hash)
        for digest in (creator, *creators):
            if digest is not None and digest not in entry.creators:
                entry.creators.add(digest)
                self._by_creator[digest].add(block_hash)
        bits = entry.tiers.get(node.index, 0)
        bit = _TIER_BITS[tier]
        if bits & bit:
            return
        entry.tiers[node.index] = bits | bit
        node.blocks.add(block_hash)
        node.num_blocks[tier] += 1
        # Adopted children have a new parent: every node's values below them may change.
        self._refresh(entry, -1 if adopted else 1 << node.index)
        for child in adopted:
            self._settle(child)

    def _remove(self, node: NodeState, block_hash: bytes, tier: Tier) -> None:
        entry = self._blocks.get(block_hash)
        if entry is None:
            return
        bits = entry.tiers.get(node.index, 0)
        bit = _TIER_BITS[tier]
        if not bits & bit:
            return
        node.num_blocks[tier] -= 1
        if bits == bit:
            del entry.tiers[node.index]
            node.blocks.discard(block_hash)
        else:
            entry.tiers[node.index] = bits & ~bit
        if entry.tiers:
            self._refresh(entry, 1 << node.index)
        else:
            self._forget(block_hash)

    def _drop_tier(self, node: NodeState, tier: Tier) -> None:
        for block_hash in list(node.blocks):
            self._remove(node, block_hash, tier)

    def _forget(self, block_hash: bytes) -> None:
        entry = self._blocks.pop(block_hash)
        if entry.parent_hash is not None:
            siblings = self._children[entry.parent_hash]
            siblings.discard(entry)
            if not siblings:
                del self._children[entry.parent_hash]
        for child in self._children.get(block_hash, ()):
            child.parent = None  # it starts a chain until its parent is stored again
            self._settle(child)
        for index, bits in entry.tiers.items():
            node = self._nodes[self._node_ids[index]]
            node.blocks.discard(block_hash)
            for tier in _tiers_of(bits):
                node.num_blocks[tier] -= 1
        _discard(self._by_namespace, entry.tags.namespace, block_hash)
        if entry.tags.tenant_id is not None:
            _discard(self._by_tenant, entry.tags.tenant_id, block_hash)
        for digest in entry.creators:
            _discard(self._by_creator, digest, block_hash)

    def _refresh(self, entry: _Entry, nodes: int) -> None:
        """Recompute ``entry``'s mask and weights after the copies of ``nodes`` (bits) changed."""
        mask = packed = 0
        for index, bits in entry.tiers.items():
            mask |= 1 << index
            packed |= self.weights.of_bits(bits) << (index * LANE_BITS)
        entry.mask, entry.packed = mask, packed
        self._settle(entry, nodes)

    # -- chains -----------------------------------------------------------------

    def _adopt(self, entry: _Entry) -> list[_Entry]:
        """Link a new entry's waiting children to it (they started chains of their own); returns
        them, to be settled once the entry's own run is."""
        children = self._children.get(entry.block_hash)
        if not children:
            return []
        for child in children:
            child.parent = entry
        return list(children)

    def _name_parent(self, entry: _Entry, parent_hash: bytes) -> None:
        """Record the parent a ``BlockStored`` names for ``entry`` (the first one named stays) and
        link it if the index holds it; a parent that would close a loop of entries is not
        recorded (chained hashes cannot form one: only a wrong record can)."""
        if parent_hash == entry.block_hash:
            return
        parent = self._blocks.get(parent_hash)
        if self._children.get(entry.block_hash):  # only an entry with children can close a loop
            ancestor = parent
            while ancestor is not None:
                if ancestor is entry:
                    return
                ancestor = ancestor.parent
        entry.parent_hash = parent_hash
        self._children.setdefault(parent_hash, set()).add(entry)
        if parent is not None:
            entry.parent = parent
            if entry.mask:  # a new entry (no holder yet) is settled once it has one
                self._settle(entry)

    def _settle(self, start: _Entry, nodes: int = -1) -> None:
        """Recompute ``run`` and ``cum`` of ``start``, then of the children of every entry whose
        values changed (a node's run only changes below where it changed).

        ``nodes``: the nodes whose bits and lanes may have changed at ``start`` (-1: any, when its
        parent changed). Below it only theirs can change, so a child none of them holds keeps its
        values and is not visited.
        """
        pending = [start]
        lanes, children = self._lanes, self._children
        while pending:
            entry = pending.pop()
            parent = entry.parent
            if parent is None:
                run, cum = entry.mask, entry.packed
            else:
                run = entry.mask & parent.run
                lane_mask = lanes.get(run)
                if lane_mask is None:
                    lane_mask = self._lane_mask(run)
                # Lanes never carry: each holds at most max_blocks × the device weight.
                cum = (parent.cum + entry.packed) & lane_mask
            if run == entry.run and cum == entry.cum:
                continue
            entry.run, entry.below, entry.cum, entry.groups = run, -run, cum, None
            below = children.get(entry.block_hash)
            if below:
                pending.extend([child for child in below if child.mask & nodes])

    def _lane_mask(self, mask: int) -> int:
        """All bits of the lanes of ``mask``'s nodes, remembered like :meth:`_bits`."""
        lane_mask = 0
        for index in self._indexes.get(mask) or self._bits(mask):
            lane_mask |= _LANE_MASK << index * LANE_BITS
        if len(self._lanes) < MAX_CACHED_MASKS:
            self._lanes[mask] = lane_mask
        return lane_mask


def _parent_of(block: BlockProvenance) -> bytes | None:
    return None if block.parent_hash is None else bytes.fromhex(block.parent_hash)


def _tiers_of(bits: int) -> Iterator[Tier]:
    return (tier for tier, bit in _TIER_BITS.items() if bits & bit)


def _best_tier(bits: int) -> Tier:
    return next(_tiers_of(bits))


def _discard(index: dict[str, set[bytes]], key: str, block_hash: bytes) -> None:
    members = index.get(key)
    if members is not None:
        members.discard(block_hash)
        if not members:
            del index[key]


def _matcher(predicate: Predicate) -> Callable[[BlockTags, set[str]], bool]:
    """``(tags, creators) -> bool`` for ``predicate``, matching what a node removes for it
    (``gpu_node.governance.commands``)."""
    match predicate:
        case DocumentPredicate(tenant=tenant, doc_id=doc_id, below_version=below):
            return lambda tags, _: (
                tags.tenant_id == tenant
                and any(d == doc_id and v < below for d, v in tags.documents)
            )
        case PolicyPredicate(tenant=tenant, auth_scope=auth_scope, below_version=below):
            return lambda tags, _: (
                tags.tenant_id == tenant
                and any(s == auth_scope and v < below for s, v in tags.auth_scopes)
            )
        case SubjectPredicate(tenant=tenant, subject_id=digest):
            return lambda tags, creators: (
                digest in creators or (tags.tenant_id == tenant and tags.subject_id == digest)
            )
        case NamespacePredicate(ns=namespace):
            return lambda tags, _: tags.namespace == namespace
        case TenantPredicate(tenant=tenant):
            return lambda tags, _: tags.tenant_id == tenant
    raise AssertionError(f"no block predicate for {type(predicate).__name__}")
