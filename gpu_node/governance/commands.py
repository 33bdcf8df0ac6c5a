"""The node's side of ``kvledger.commands``: invalidations in, verified deletions and acks out
(docs/design.md §5).

For every ``Invalidate`` the node

1. moves its :class:`~prefix_keys.versions.VersionRegistry`, so the API refuses
   requests that name a superseded document or policy version;
2. tombstones and deletes every matching block that exists when it applies the
   command — whatever the command's cutoff says (docs/design.md §5, "Cutoffs"):
   device/host slots are zeroed and read back, disk files overwritten
   and unlinked (:meth:`BlockPool.remove_where`), blocks a reader still holds are
   deleted when released (waited for, bounded), BUILDING matches are discarded
   at commit by the pool, and for an erasure matching builds keyed before the
   application (on the node's own clock) but claimed after the removal are
   refused for a bounded window (:meth:`BlockPool.guard_builds`);
   then every snapshot of the node is rewritten without the matches;
3. for a subject (erasure) command, crypto-erases: destroys the subject's data
   keys in the node's key provider — the ones it resolved for the subject and
   the ones named by the sealed copies it removed — so any copy of those
   blocks, including one copied off the node, no longer decrypts here;
4. publishes a ``CommandAck`` to ``kvledger.acks`` with one ``TierEvidence`` per
   tier touched — also when nothing matched, so the coordinator can complete. An ack
   too large for one record goes out as several signed parts (:mod:`events.ack_parts`),
   which the coordinator assembles before it counts the evidence.

The pool's removals still reach ``kvledger.kv-events`` as ``BlockRemoved`` records through
the publisher, as for every other change of bytes.

Ordering and restarts. Invalidations share one key, so they sit in one partition
and every node applies them in the coordinator's order. A node with a coordinator
URL (``coordinator_url``) does not depend on how long the broker keeps the topic: at
every start it notes the topic's end offsets, then fetches the governance state from
the coordinator (:mod:`gpu_node.governance.sync`) — the decisions its version registry
must hold and the commands still pending for it — applies the decisions to the
registry, applies and acks the pending commands exactly as commands from the topic,
and only then consumes the topic, from the offsets it noted: every decision missing
from the state was committed after the fetch, so its command lies past them. Until
the state is fetched and applied the node stays not ready and retries with capped
backoff. A node without a coordinator URL reads the topic from the beginning instead:
commands below its group's committed offset were applied in an earlier life and only
rebuild the registry; later ones are applied and acked now — complete only as long as
the topic's retention. Either way the node reports ready only once it has consumed up
to the end offsets it saw at start, so a node that was down applies what it missed
before it serves.

Re-sent commands. The coordinator re-sends a command to a node that has not acked it
(``coordinator.handlers.resend``): a new record, same ``command_id``. A command this node already
applied in this run is not applied again: its ack — the same envelope, same ``event_id`` and
evidence, every part of it — is published again, so a lost ack is recovered and an ack that did
arrive is a duplicate the coordinator's inbox drops. A command applied in an earlier life (its ack
and evidence are gone with the process) is applied again: that is idempotent, removes what matches
now, and acks that. The registry keeps, per document and policy, the latest decision by its time
(:mod:`prefix_keys.versions`), so a re-sent older command never moves it back.

Trust. Only commands signed by the coordinator's command key, which the node pins
(``identity.coordinator_public_key_file``), are applied, remembered or answered —
also during the replay at start. An unsigned, tampered or otherwise-signed record is
dead-lettered and counted (the node's ``kvledger_unverified_commands_total``) the first time it
is met and ignored on every later replay. Acks leave signed with the node's own key
(the publisher's signer). See ``docs/security.md``, "Node identity and signed records".
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from events import schema, topics
from events.ack_parts import TierReport, ack_parts
from events.codec import decode_event, decode_key
from events.fault_points import fault_point
from events.kafka.consumer import StallClock, get_fresh_batch
from events.kafka.dead_letters import send_to_dead_letter
from events.kafka.producer import EventProducer
from events.kafka.settings import KafkaSettings, kafka_client_kwargs
from events.metrics import HANDLER_FAILURES_TOTAL
from events.tiers import Tier
from gpu_node.governance.sync import (
    GovernanceClient,
    GovernanceRefused,
    GovernanceState,
    GovernanceUnavailable,
)
from gpu_node.keys.crypto import DataKeyProvider
from gpu_node.pool import snapshots
from gpu_node.pool.vocabulary import (
    IndexKey,
    PoolEvent,
    RemovalEvidence,
    RemovalReason,
    RemovedFromPool,
)
from identity.signing import SIGNATURE_ERROR, signature_problem
from prefix_keys.blocks import CacheProvenance

if TYPE_CHECKING:
    from gpu_node.engine.async_engine import AsyncEngine
    from gpu_node.governance.publisher import NodePublisher

log = logging.getLogger(__name__)

DEFAULT_DEFERRED_WAIT_S = 10.0
EVIDENCE_SUBSCRIBER = "command-evidence"
"""The :class:`InvalidationApplier`'s name among the cache manager's pool-event subscribers."""
MAX_REMEMBERED_ACKS = 10_000
"""Acks kept per node for re-sent commands (a few hundred bytes each): the coordinator re-sends a
command within minutes of its decision, so only the most recent commands need theirs."""
BUILD_GUARD_MARGIN_S = 60.0
"""Slack on top of the singleflight wait for how long an erasure keeps refusing matching builds keyed before it was
applied: a request claims its blocks at most the singleflight wait after it computed its keys (and their ``created_at``)."""


# --------------------------------------------------------------------------- predicates


def block_predicate(
    predicate: schema.Predicate, keyed_before: datetime | None, subject_key: bytes
) -> Callable[[CacheProvenance], bool]:
    """Which blocks an ``Invalidate`` names: provenance matches ``predicate`` (and was keyed before
    ``keyed_before``).

    The handler removes with ``keyed_before=None``: every matching block that
    exists when it applies the command, by the pool's order, whatever anyone's
    clock says. Only its guard against builds claimed later (an erasure's) needs a
    time: the moment of application on the clock the node's own ``created_at``
    values come from (the pool's wall clock) — never the command's cutoff, the
    coordinator's database time, which a node clock ahead of it would compare
    against to spare blocks built before the request, and one behind it to remove
    blocks built after the command was applied (docs/design.md §5, "Cutoffs").
    Subjects are compared as the keyed digest the command carries (commands never
    hold a raw subject id); the node digests its own blocks' subjects with the
    shared key, once per (tenant, subject). A subject predicate also matches every
    block of any scope whose ``creator_subject_id`` is that digest: an erasure covers
    the public and tenant blocks the subject's requests created (a shared block is
    then recomputed by its next caller).
    """
    keyed_before_s = None if keyed_before is None else keyed_before.timestamp()
    match predicate:
        case schema.DocumentPredicate(tenant=tenant, doc_id=doc_id, below_version=below):

            def matches(provenance: CacheProvenance) -> bool:
                if provenance.tenant_id != tenant:
                    return False
                for tag in provenance.documents:
                    tag_doc, _, version = tag.rpartition("@")
                    if tag_doc == doc_id and int(version) < below:
                        return True
                return False

        case schema.PolicyPredicate(tenant=tenant, auth_scope=auth_scope, below_version=below):

            def matches(provenance: CacheProvenance) -> bool:
                return provenance.tenant_id == tenant and any(
                    scope == auth_scope and version < below
                    for scope, version in provenance.auth_scopes
                )

        case schema.SubjectPredicate(tenant=tenant, subject_id=digest):
            digests: dict[str, str] = {}

            def matches(provenance: CacheProvenance) -> bool:
                if provenance.creator_subject_id == digest:
                    return True
                subject = provenance.subject_id
                if provenance.tenant_id != tenant or subject is None:
                    return False
                if subject not in digests:
                    digests[subject] = schema.subject_digest(subject_key, tenant, subject)
                return digests[subject] == digest

        case schema.NamespacePredicate(ns=namespace):

            def matches(provenance: CacheProvenance) -> bool:
                return provenance.namespace == namespace

        case schema.TenantPredicate(tenant=tenant):

            def matches(provenance: CacheProvenance) -> bool:
                return provenance.tenant_id == tenant

        case _:
            raise AssertionError(f"no block predicate for {type(predicate).__name__}")

    if keyed_before_s is None:
        return matches

    def keyed_in_time(provenance: CacheProvenance) -> bool:
        return provenance.created_at < keyed_before_s and matches(provenance)

    return keyed_in_time


def predicate_index_key(predicate: schema.Predicate) -> IndexKey | None:
    """The pool's provenance index key whose entries include every block :func:`block_predicate` can
    match.

    Only narrows the scan (:meth:`BlockPool.remove_where`); the block predicate
    still decides each candidate. A subject predicate has none (``None``: the whole
    pool): it matches the blocks the subject created in every scope, public ones
    (filed under no tenant) included, and the user blocks of records that predate
    ``creator_subject_id``; erasures are rare and the check per block is one compare.
    """
    match predicate:
        case schema.DocumentPredicate(tenant=tenant, doc_id=doc_id):
            return ("document", tenant, doc_id)
        case schema.PolicyPredicate(tenant=tenant, auth_scope=auth_scope):
            return ("policy", tenant, auth_scope)
        case schema.SubjectPredicate():
            return None
        case schema.TenantPredicate(tenant=tenant):
            return ("tenant", tenant)
        case schema.NamespacePredicate(ns=namespace):
            return ("namespace", namespace)
        case _:
            raise AssertionError(f"no index key for {type(predicate).__name__}")


# --------------------------------------------------------------------------- snapshots


@dataclass(frozen=True, slots=True)
class SnapshotRemoval:
    """Blocks one snapshot no longer holds; ``verified``: every replaced shard file is absent.

    ``key_ids``: the data keys that sealed the matching records removed.
    """

    snapshot_id: str
    block_hashes: tuple[bytes, ...]
    verified: bool
    key_ids: frozenset[str] = frozenset()


def fetch_snapshot_keys(root: Path, key_provider: DataKeyProvider) -> None:
    """Ask ``key_provider`` (a blocking view) for every data key that sealed a snapshot under ``root``.

    Blocking, and meant for a thread: run before :func:`remove_from_snapshots`,
    it leaves the keys in memory, so the pass on the model worker waits on the
    key service only for a snapshot written in between. Raises
    :class:`gpu_node.keys.crypto.KeyServiceUnavailable` when a key can be neither
    fetched nor known destroyed: the command fails and is retried, its
    snapshots untouched.
    """
    for directory in snapshots.complete_snapshots(root):
        for key_id in sorted(snapshots.sealing_key_ids(directory)):
            key_provider.key_by_id(key_id)


def remove_from_snapshots(
    root: Path,
    predicates: Sequence[Callable[[CacheProvenance], bool]],
    key_provider: DataKeyProvider,
) -> list[list[SnapshotRemoval]]:
    """Rewrite every snapshot under ``root`` without blocks any predicate matches; per predicate, what it removed.

    Blocking: reads every shard once, whatever the number of predicates — a
    batch of commands costs one pass, not one per command. Each removed record
    is attributed to every predicate matching its provenance; a record removed
    because it could no longer be decoded (see
    :func:`snapshots.remove_from_snapshot`) to the first predicate, the one
    that would have removed it had the commands been applied one by one.
    """
    removals: list[list[SnapshotRemoval]] = [[] for _ in predicates]
    if not predicates:
        return removals
    for directory in snapshots.complete_snapshots(root):
        before = snapshots.read_manifest(directory)
        records = snapshots.remove_from_snapshot(
            directory, lambda p: any(match(p) for match in predicates), key_provider
        )
        if not records:
            continue
        live_shards = set(snapshots.read_manifest(directory).shards)
        verified = all(
            not (directory / name).exists() for name in before.shards if name not in live_shards
        )
        for index, match in enumerate(predicates):
            mine = [
                r
                for r in records
                if (match(r.provenance) if r.provenance is not None else index == 0)
            ]
            if mine:
                hashes = tuple(dict.fromkeys(r.block_hash for r in mine))
                key_ids = frozenset(r.key_id for r in mine if r.key_id is not None)
                removals[index].append(
                    SnapshotRemoval(before.snapshot_id, hashes, verified, key_ids)
                )
    return removals


# --------------------------------------------------------------------------- crypto-erase


@dataclass(frozen=True, slots=True)
class CryptoErasure:
    """Data keys destroyed for one subject; ``verified``: none of them can be obtained any more."""

    key_ids: tuple[str, ...]
    verified: bool


def crypto_erase_subject(
    key_provider: DataKeyProvider, predicate: schema.SubjectPredicate, sealed_key_ids: set[str]
) -> CryptoErasure:
    """Destroy the subject's keys in ``key_provider`` and check each is gone (blocking: a local store fsyncs).

    The keys are the ones the provider can attribute to the subject's digest
    plus ``sealed_key_ids``, read from the headers of the subject's removed
    sealed copies — a provider that fetched a key by id to read a file does
    not know whose it is. With the coordinator's key service the authoritative
    destruction is the coordinator's; what the node destroys is its cached
    copy, after which it refuses to fetch the key again.
    """
    candidates = sorted(
        set(key_provider.subject_key_ids(predicate.tenant, predicate.subject_id)) | sealed_key_ids
    )
    # A key that survives destroy() is one its authority still serves (issued after the erasure
    # started, for the subject's newer data): not destroyed, so never reported as destroyed.
    key_ids = [
        key_id
        for key_id in candidates
        if key_provider.destroy(key_id) or key_provider.key_by_id(key_id) is None
    ]
    return CryptoErasure(
        tuple(key_ids), all(key_provider.key_by_id(key_id) is None for key_id in key_ids)
    )


# --------------------------------------------------------------------------- invalidation


class DeferredRemovalTimeout(TimeoutError):
    """Readers still held matching blocks after the bounded wait; the command is retried, not acked."""


@dataclass
class _Progress:
    """What one command has removed so far, kept across attempts until it is acked.

    ``since`` is the handler's removal sequence number when the command was
    first seen: any removal observed after it counts as this command's
    evidence for a block it left ``pending`` — so a referenced block released
    between attempts (or while ``remove_where`` was running) still contributes.
    """

    since: int
    removed: dict[tuple[bytes, Tier], RemovalEvidence] = field(default_factory=dict)
    pending: set[bytes] = field(default_factory=set)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    snapshot_hashes: set[bytes] = field(default_factory=set)
    snapshots_verified: bool = True
    snapshot_key_ids: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class _Plan:
    command: schema.Invalidate
    matches: Callable[[CacheProvenance], bool]
    progress: _Progress


_POOL_METHODS: dict[Tier, tuple[schema.EraseMethod, schema.PostCheck]] = {
    Tier.DEVICE: ("overwrite", "readback_zero"),
    Tier.HOST: ("overwrite", "readback_zero"),
    Tier.DISK: ("unlink", "file_absent"),
}


class InvalidationApplier:
    """Applies ``Invalidate`` commands to one engine and returns the per-tier evidence for each ack.

    Commands are applied in batches (:meth:`apply_batch`): one hop to a worker
    thread removes the matches of every command of the batch (memory slots
    zeroed in one operation per tier), and snapshots are scanned once per
    batch, only when the node holds any. What remains per command is
    bookkeeping, so a node keeps up with a burst of commands while its event
    loop shares the interpreter with the model worker.

    It subscribes to the cache manager's pool events as ``"command-evidence"``
    (:meth:`KVCacheManager.subscribe`, beside the publisher's ``"kv-events"``, in
    either order): a block a reader held when the command arrived is deleted on
    release, and its evidence only exists in that removal event.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        subject_key: bytes,
        deferred_wait_s: float = DEFAULT_DEFERRED_WAIT_S,
    ) -> None:
        if deferred_wait_s <= 0:
            raise ValueError("deferred_wait_s must be positive")
        self.engine = engine
        self.subject_key = subject_key
        self.deferred_wait_s = deferred_wait_s
        self._progress: dict[uuid.UUID, _Progress] = {}
        # Removals observed while any command is in progress: block hash → (sequence number,
        # evidence).
        self._seen: dict[bytes, tuple[int, RemovalEvidence]] = {}
        self._num_seen = 0
        engine.manager.subscribe(EVIDENCE_SUBSCRIBER, self._on_pool_events)

    def remember(self, command: schema.Invalidate) -> None:
        """Registry only: for commands this node applied in an earlier life (their bytes are gone)."""
        self.remember_decision(command.predicate, command.cutoff)

    def remember_decision(self, predicate: schema.Predicate, decided_at: datetime) -> None:
        """Registry only: a decision of the governance state, or a command's (decided at its
        cutoff)."""
        self.engine.versions.apply(predicate, decided_at)
        if (
            isinstance(predicate, schema.NamespacePredicate)
            and predicate.ns == self.engine.namespace.namespace
        ):
            log.warning(
                "this node's namespace is retired: requests are served without the prefix cache"
            )

    async def apply(self, command: schema.Invalidate) -> list[TierReport]:
        """Apply one command fully; returns the ack's evidence (a batch of one, see
        :meth:`apply_batch`)."""
        async with contextlib.aclosing(self.apply_batch([command])) as applied:
            async for _, evidence in applied:
                return evidence
        raise AssertionError("apply_batch yields every command it completes")

    async def apply_batch(
        self, commands: Sequence[schema.Invalidate]
    ) -> AsyncIterator[tuple[schema.Invalidate, list[TierReport]]]:
        """Apply ``commands`` in order; yields each with its ack's evidence as soon as it is complete.

        Every command's registry move and tombstones happen before the first is
        yielded, so no match of any of them is served from then on. Idempotent,
        so a retry is safe. Raises :class:`DeferredRemovalTimeout` at the first
        command whose referenced matches outlive the bounded wait; the commands
        yielded before it are complete, its evidence and the later commands'
        are kept for the retry.
        """
        pool = self.engine.pool
        plans = []
        applied_at = datetime.fromtimestamp(pool.wall_time(), UTC)
        for command in commands:
            self.remember(command)
            matches = block_predicate(command.predicate, None, self.subject_key)
            if isinstance(command.predicate, schema.SubjectPredicate):
                # Erasures only: they are rare, and every guard is checked at every build while it
                # lasts.
                keyed_before = block_predicate(command.predicate, applied_at, self.subject_key)
                pool.guard_builds(
                    keyed_before, self.engine.manager.singleflight_wait_s + BUILD_GUARD_MARGIN_S
                )
            progress = self._progress.setdefault(command.command_id, _Progress(self._num_seen))
            plans.append(_Plan(command, matches, progress))
        reports = await asyncio.to_thread(
            pool.remove_many,
            [(plan.matches, predicate_index_key(plan.command.predicate)) for plan in plans],
            RemovalReason.INVALIDATED,
        )
        self.engine.manager.drain_events()
        for plan, report in zip(plans, reports, strict=True):
            for evidence in report.evidence:
                plan.progress.removed[(evidence.block_hash, evidence.tier)] = evidence
            plan.progress.pending.update(report.deferred)
        if self.engine.may_hold_snapshots():
            keys = pool.key_provider.blocking()
            await asyncio.to_thread(fetch_snapshot_keys, self.engine.snapshot_root, keys)
            removals = await self.engine.run_exclusive(
                remove_from_snapshots,
                self.engine.snapshot_root,
                [plan.matches for plan in plans],
                keys,
            )
            for plan, removed in zip(plans, removals, strict=True):
                for removal in removed:
                    plan.progress.snapshot_hashes.update(removal.block_hashes)
                    plan.progress.snapshots_verified = (
                        plan.progress.snapshots_verified and removal.verified
                    )
                    plan.progress.snapshot_key_ids.update(removal.key_ids)
        for plan in plans:
            await self._wait_for_release(plan.progress)
            erasure = None
            if isinstance(plan.command.predicate, schema.SubjectPredicate):
                removed = plan.progress.removed.values()
                sealed = {
                    item.key_id for item in removed if item.key_id is not None
                } | plan.progress.snapshot_key_ids
                erasure = await asyncio.to_thread(
                    crypto_erase_subject, pool.key_provider, plan.command.predicate, sealed
                )
            self._finish(plan.command.command_id)
            yield plan.command, _evidence(plan.progress, erasure)

    def _finish(self, command_id: uuid.UUID) -> None:
        # pop: a command delivered twice in one batch (a re-published outbox row) shares one
        # progress.
        self._progress.pop(command_id, None)
        if not self._progress:
            self._seen.clear()

    async def _wait_for_release(self, progress: _Progress) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.deferred_wait_s
        while True:
            for block_hash in list(progress.pending):
                seen = self._seen.get(block_hash)
                if seen is not None and seen[0] > progress.since:
                    evidence = seen[1]
                    progress.removed[(block_hash, evidence.tier)] = evidence
                    progress.pending.discard(block_hash)
            if not progress.pending:
                return
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise DeferredRemovalTimeout(
                    f"{len(progress.pending)} matching blocks are still referenced"
                )
            progress.changed.clear()
            try:
                await asyncio.wait_for(progress.changed.wait(), remaining)
            except TimeoutError:
                pass

    def _on_pool_events(self, events: Sequence[PoolEvent]) -> None:
        if self._progress:
            num_seen = self._num_seen
            for event in events:
                if isinstance(event, RemovedFromPool) and event.evidence is not None:
                    num_seen += 1
                    self._seen[event.block_hash] = (num_seen, event.evidence)
            if num_seen != self._num_seen:
                self._num_seen = num_seen
                for progress in self._progress.values():
                    progress.changed.set()


def _evidence(progress: _Progress, erasure: CryptoErasure | None) -> list[TierReport]:
    """One :class:`TierReport` (a whole tier's ``TierEvidence``, however many blocks) per tier touched.

    Disk and snapshot copies of a crypto-erased subject report ``crypto_erase``
    / ``key_destroyed`` with the destroyed key ids — only when every removed
    copy named one of them in its header — verified only if the keys are gone
    *and* the files are absent; otherwise (nothing sealed, no key destroyed, or
    a copy sealed under a key its authority keeps live) they report what was
    done: ``unlink``.
    """
    by_tier: dict[Tier, list[RemovalEvidence]] = {}
    for evidence in progress.removed.values():
        by_tier.setdefault(evidence.tier, []).append(evidence)
    destroyed = frozenset(() if erasure is None else erasure.key_ids)
    result = []
    for tier in Tier:
        items = by_tier.get(tier)
        if not items:
            continue
        method, post_check = _POOL_METHODS[tier]
        verified = all(item.verified for item in items)
        key_ids: list[str] = []
        if (
            tier is Tier.DISK
            and destroyed
            and all(item.encrypted and item.key_id in destroyed for item in items)
        ):
            method, post_check, key_ids = "crypto_erase", "key_destroyed", list(erasure.key_ids)
            verified = verified and erasure.verified
        result.append(
            TierReport(
                tier=tier,
                block_hashes=[item.block_hash.hex() for item in items],
                method=method,
                post_check=post_check,
                verified=verified,
                key_ids=key_ids,
            )
        )
    if progress.snapshot_hashes:
        method, post_check, key_ids, verified = (
            "unlink",
            "file_absent",
            [],
            progress.snapshots_verified,
        )
        if destroyed and progress.snapshot_key_ids <= destroyed:
            method, post_check, key_ids = "crypto_erase", "key_destroyed", list(erasure.key_ids)
            verified = verified and erasure.verified
        result.append(
            TierReport(
                tier=Tier.SNAPSHOT,
                block_hashes=sorted(block_hash.hex() for block_hash in progress.snapshot_hashes),
                method=method,
                post_check=post_check,
                verified=verified,
                key_ids=key_ids,
            )
        )
    return result


# --------------------------------------------------------------------------- acks


AckRecords = tuple[schema.Envelope, ...]
"""One command's ack as the records that carry it: one, or the parts of
:func:`events.ack_parts.ack_parts`."""


def ack_records(
    command: schema.Invalidate,
    node_id: str,
    epoch: int,
    evidence: Sequence[TierReport],
    after_seq: int,
) -> AckRecords:
    """The envelopes of the ack of ``command``, each small enough to be sent once signed.

    Built once per application and kept: a re-sent command gets these same envelopes (same
    event ids, same parts) again, so the coordinator's inbox drops the parts it holds and
    stages the ones it missed. ``after_seq`` is the publisher's fence
    (:meth:`gpu_node.governance.publisher.NodePublisher.fence`).
    """
    parts = ack_parts(command.command_id, node_id, epoch, evidence, after_seq=after_seq)
    return tuple(schema.make_event(part) for part in parts)


# --------------------------------------------------------------------------- consumer


class CommandConsumer:
    """Consumes ``kvledger.commands`` for one node, applies them in order, acks, and gates readiness.

    Its own consumer group (``kvledger-node-{node_id}``) holds the node's
    progress; every partition is assigned to it directly (the node is the
    group's only member, so there is nothing to balance and no join to wait
    for). At start it reads the end offsets; with ``governance`` it fetches and
    applies the governance state and consumes from those offsets, without it it
    seeks to the beginning (see the module docstring); once it has consumed up to
    them, it sets ``engine.ready`` — never earlier. The
    commands of one poll are applied in order, each ack published (batched by
    the producer) once its command is applied, and the offsets committed once
    per poll after all its acks — in the background, while the next poll's
    commands are applied; a failure acks what was applied, seeks back and
    retries after a backoff, never skipping a command (see :meth:`_handle`). Malformed records go to the dead-letter topic.
    """

    def __init__(
        self,
        handler: InvalidationApplier,
        publisher: NodePublisher,
        kafka: KafkaSettings,
        *,
        command_key: Ed25519PublicKey,
        governance: GovernanceClient | None = None,
        poll_timeout_ms: int = 200,
        max_records: int = 100,
        initial_backoff_s: float = 0.1,
        max_backoff_s: float = 10.0,
        stall_after_s: float = 60.0,
    ) -> None:
        self.handler = handler
        self.engine = handler.engine
        self.publisher = publisher
        self.node_id = publisher.node_id
        self.group_id = f"kvledger-node-{self.node_id}"
        self.replayed = asyncio.Event()
        self._command_key = command_key
        self.governance = governance
        self._poll_timeout_ms = poll_timeout_ms
        self._top_up_ms = kafka.top_up_ms
        self._max_records = max_records
        self._initial_backoff_s = initial_backoff_s
        self._max_backoff_s = max_backoff_s
        # Commands that keep failing are retried forever (never skipped): the clock makes that
        # visible.
        self.stall = StallClock(stall_after_s)
        self.engine.metrics.consumer_stalled.labels(group=self.group_id).set_function(
            lambda: float(self.stall.stalled)
        )
        self._consumer = AIOKafkaConsumer(
            **kafka_client_kwargs(kafka),
            group_id=self.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            **kafka.timing_fields(),
        )
        self._producer = EventProducer(kafka, sign=publisher.signer)
        self._committed: dict[TopicPartition, int] = {}
        # Records handled in this run whose offsets are not committed yet → the ack's parts to
        # publish (None: no ack).
        self._unacked: dict[tuple[TopicPartition, int], AckRecords | None] = {}
        # command_id → its ack's parts, for commands applied in this run (a re-send is re-acked, not
        # re-applied).
        self._acks: collections.OrderedDict[uuid.UUID, AckRecords] = collections.OrderedDict()
        self._end_offsets: dict[TopicPartition, int] = {}
        # Per partition, the offset after the last record handled in this run (see _rewind).
        self._handled_upto: dict[TopicPartition, int] = {}
        self._task: asyncio.Task | None = None
        # The latest poll's acks and offset commit, chained after the previous poll's (see _handle).
        self._flushing: asyncio.Task | None = None

    async def start(self) -> None:
        """Assign every partition, note what was applied before and where the log ends, start
        consuming.

        The topic must exist (the publisher's start creates it).
        """
        await self._producer.start()
        try:
            await self._consumer.start()
            await self._consumer.topics()
            partitions = self._consumer.partitions_for_topic(topics.COMMANDS)
            if not partitions:
                raise RuntimeError(
                    f"topic {topics.COMMANDS} has no partitions; create the topics first"
                )
            assigned = [
                TopicPartition(topics.COMMANDS, partition) for partition in sorted(partitions)
            ]
            self._consumer.assign(assigned)
            for tp in assigned:
                self._committed[tp] = await self._consumer.committed(tp) or 0
            self._end_offsets = await self._consumer.end_offsets(assigned)
            if self.governance is None:
                await self._consumer.seek_to_beginning(*assigned)
                self._handled_upto = await self._consumer.beginning_offsets(assigned)
            else:
                # Read before the governance state is fetched (in _run): every decision whose
                # command lies below these offsets is in that state, so the records below them are
                # never read.
                for tp, end in self._end_offsets.items():
                    self._consumer.seek(tp, end)
                    self._committed[tp] = max(self._committed[tp], end)
                self._handled_upto = dict(self._end_offsets)
        except BaseException:
            await self._consumer.stop()
            await self._producer.stop()
            raise
        self._task = asyncio.create_task(self._run(), name=f"commands-{self.node_id}")

    async def stop(self, flush_timeout_s: float = 10.0) -> None:
        """Stop consuming; the acks and commit in flight get ``flush_timeout_s`` to finish (else they are redone next start)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._flushing is not None:
            await asyncio.wait({self._flushing}, timeout=flush_timeout_s)
            self._flushing.cancel()
            await asyncio.gather(self._flushing, return_exceptions=True)
        await self._consumer.stop()
        await self._producer.stop()

    async def _run(self) -> None:
        if self.governance is not None:
            await self._sync_governance()
        backoff = self._initial_backoff_s
        while True:
            try:
                self._raise_if_flush_failed()
                batch = await get_fresh_batch(
                    self._consumer,
                    timeout_ms=self._poll_timeout_ms,
                    max_records=self._max_records,
                    top_up_ms=self._top_up_ms,
                )
                if any(batch.values()):
                    self.stall.waiting()
                await self._handle(batch)
                self.stall.advanced()
                if not self.replayed.is_set() and not any(batch.values()):
                    await self._check_replayed()
                backoff = self._initial_backoff_s
            except Exception as exc:  # noqa: BLE001 - a failed command is retried, never skipped
                HANDLER_FAILURES_TOTAL.labels(group=self.group_id).inc()
                # Exception text may quote record data; only its type is logged.
                log.warning(
                    "node %s: command failed (%s); retrying in %.1fs",
                    self.node_id,
                    type(exc).__name__,
                    backoff,
                )
                log.debug("command failure detail", exc_info=True)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._max_backoff_s)

    async def _sync_governance(self) -> None:
        """Fetch and apply the governance state, retrying with capped backoff until it is applied; the node stays not ready."""
        backoff = self._initial_backoff_s
        while True:
            try:
                state = await self.governance.fetch()
                await self._apply_governance(state)
                return
            except Exception as exc:  # noqa: BLE001 - never ready on a partial or unverified state, never a crash loop
                reason = (
                    str(exc)
                    if isinstance(exc, (GovernanceUnavailable, GovernanceRefused))
                    else type(exc).__name__
                )
                kind = "apply_failed"
                if isinstance(exc, (GovernanceUnavailable, GovernanceRefused)):
                    kind = "unavailable" if isinstance(exc, GovernanceUnavailable) else "refused"
                self.engine.metrics.governance_failures.labels(reason=kind).inc()
                log.warning(
                    "node %s: governance state not applied (%s); not ready, retrying in %.1fs",
                    self.node_id,
                    reason,
                    backoff,
                )
                log.debug("governance failure detail", exc_info=True)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._max_backoff_s)

    async def _apply_governance(self, state: GovernanceState) -> None:
        """The registry decisions, then the pending commands as from the topic: applied (once in this run) and acked."""
        for predicate, decided_at in state.decisions:
            self.handler.remember_decision(predicate, decided_at)
        sending = [
            asyncio.create_task(self._producer.send_many(self._acks[command.command_id]))
            for command in state.pending
            if command.command_id in self._acks
        ]
        to_apply = [command for command in state.pending if command.command_id not in self._acks]
        try:
            async with contextlib.aclosing(self.handler.apply_batch(to_apply)) as applied:
                async for command, evidence in applied:
                    ack = await self._ack(command, evidence)
                    self._remember_ack(command.command_id, ack)
                    sending.append(asyncio.create_task(self._producer.send_many(ack)))
        finally:
            results = await asyncio.gather(*sending, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        log.info(
            "node %s: governance state applied (as of decision %d): %d decisions, %d pending commands",
            self.node_id,
            state.as_of_decision,
            len(state.decisions),
            len(state.pending),
        )

    async def _ack(self, command: schema.Invalidate, evidence: list[TierReport]) -> AckRecords:
        """The ack of an applied command, whether it came from the topic or from the governance state at start.

        Fenced: the block events of the command's removals (and the ``SnapshotWritten`` of every
        snapshot it rewrote) are on the broker before the ack is built, and the ack names the
        last seq among them, so the coordinator never applies the ack ahead of them (they
        travel on another topic, to another consumer group).
        """
        fault_point("node.between_delete_and_ack")
        after_seq = await self.publisher.fence()
        return ack_records(command, self.node_id, self.publisher.epoch, evidence, after_seq)

    async def _check_replayed(self) -> None:
        """Ready once an empty poll finds the position at or past the end noted at start.

        The empty poll matters: some brokers (Tansu) report the end offset as the start
        of the last record batch, so a position past it alone does not prove that the
        rest of that batch was applied.
        """
        for tp, end in self._end_offsets.items():
            if await self._consumer.position(tp) < end:
                return
        self.engine.ready = True
        self.replayed.set()
        log.info("node %s: commands replayed; ready", self.node_id)

    async def _handle(self, batch: dict[TopicPartition, list[ConsumerRecord]]) -> None:
        """Apply a batch in order per partition, publishing each ack once its command is applied;
        commit once.

        Consecutive commands to apply are applied together
        (:meth:`InvalidationApplier.apply_batch`). An ack is handed to the
        producer right after its command was applied (never before), without
        waiting for the broker: the producer batches those that accumulate. Then a
        flush task awaits the batch's acks and commits its offsets once per
        partition, after the previous batch's flush — so an offset is committed
        only after every ack below it was published — while the node goes on to
        the next poll: waiting for the broker twice per batch would hold back
        every command behind it. A failed flush is raised at the next poll
        (:meth:`_raise_if_flush_failed`). On a failed command the acks of the
        commands applied before it are still awaited and committed. After any
        failure every partition rewinds to its first record neither handled in this
        run nor committed (:meth:`_rewind`): the failed command is retried, none is
        skipped. A command applied but not acked (its
        ack could not be published) is not applied again on the retry; its ack,
        kept in ``_unacked`` with the evidence of the application, is sent again.
        """
        handled: dict[TopicPartition, int] = {}
        sending: list[asyncio.Task] = []
        try:
            for tp, records in batch.items():
                await self._handle_partition(tp, records, handled, sending)
        except Exception:
            self._handled_upto.update(handled)
            try:
                await self._flush_after(self._flushing, sending, handled)
            except Exception:  # noqa: BLE001 - the command's failure is the one raised
                log.debug("acks after a failed command could not be published", exc_info=True)
            self._flushing = None
            self._rewind()
            raise
        except BaseException:  # cancelled (stop): earlier batches' flushes are left to stop()
            for task in sending:
                task.cancel()
            raise
        self._handled_upto.update(handled)
        if sending or handled:
            self._flushing = asyncio.create_task(
                self._flush_after(self._flushing, sending, handled)
            )

    def _raise_if_flush_failed(self) -> None:
        """Raise the failure of the last flush, if it failed, after rewinding to what is committed."""
        if self._flushing is None or not self._flushing.done():
            return
        flushing, self._flushing = self._flushing, None
        if flushing.exception() is not None:
            self._rewind()
            raise flushing.exception()

    async def _handle_partition(
        self,
        tp: TopicPartition,
        records: list[ConsumerRecord],
        handled: dict[TopicPartition, int],
        sending: list[asyncio.Task],
    ) -> None:
        """Handle one partition's records in order; ``handled[tp]`` follows the last one done, acks go to ``sending``."""
        to_apply: list[tuple[int, schema.Invalidate]] = []
        for record in records:
            envelope, error = self._verified(record)
            key = (tp, record.offset)
            # A command already waiting in ``to_apply`` (re-sent while this node was down or slow,
            # so several copies arrive in one batch) is not applied twice: the commands before it
            # are applied first, then this copy is answered with that application's ack
            # (_handle_record).
            if (
                envelope is not None
                and isinstance(envelope.payload, schema.Invalidate)
                and record.offset >= self._committed[tp]
                and key not in self._unacked
                and envelope.payload.command_id not in self._acks
                and all(
                    envelope.payload.command_id != waiting.command_id for _, waiting in to_apply
                )
            ):
                to_apply.append((record.offset, envelope.payload))
                continue
            await self._apply(tp, to_apply, handled, sending)
            to_apply = []
            ack = await self._handle_record(tp, record, envelope, error)
            if ack is not None:
                sending.append(asyncio.create_task(self._producer.send_many(ack)))
            handled[tp] = record.offset + 1
        await self._apply(tp, to_apply, handled, sending)

    def _verified(self, record: ConsumerRecord) -> tuple[schema.Envelope | None, str | None]:
        """(envelope, None) for a valid command signed by the pinned coordinator key; (None, why)
        otherwise."""
        try:
            envelope = decode_event(record.value)
            key = decode_key(record.key)
        except schema.EventValidationError as exc:
            return None, str(exc)
        misrouted = topics.routing_problem(record.topic, key, envelope)
        if misrouted is not None:
            return None, topics.ROUTING_ERROR + misrouted
        problem = signature_problem(envelope, self._command_key)
        if problem is not None:
            return None, SIGNATURE_ERROR + problem
        return envelope, None

    async def _apply(
        self,
        tp: TopicPartition,
        commands: list[tuple[int, schema.Invalidate]],
        handled: dict[TopicPartition, int],
        sending: list[asyncio.Task],
    ) -> None:
        """Apply consecutive commands of ``tp`` (offset, command) together, handing each ack to the
        producer as it completes."""
        if not commands:
            return
        offsets = iter(commands)
        async with contextlib.aclosing(
            self.handler.apply_batch([command for _, command in commands])
        ) as applied:
            async for command, evidence in applied:
                offset, expected = next(offsets)
                assert command is expected, "apply_batch yields the commands in order"
                ack = await self._ack(command, evidence)
                self._unacked[(tp, offset)] = ack
                self._remember_ack(command.command_id, ack)
                sending.append(asyncio.create_task(self._producer.send_many(ack)))
                handled[tp] = offset + 1
                log.info(
                    "node %s: applied %s command, %d blocks removed",
                    self.node_id,
                    command.predicate.kind,
                    sum(item.removed for item in evidence),
                )

    def _remember_ack(self, command_id: uuid.UUID, ack: AckRecords) -> None:
        self._acks[command_id] = ack
        self._acks.move_to_end(command_id)
        while len(self._acks) > MAX_REMEMBERED_ACKS:
            self._acks.popitem(last=False)

    def _rewind(self) -> None:
        """After a failure, seek every partition back to its first record neither handled in this run nor committed.

        Records from the committed offset on are handled again: the applied ones are only
        acked again (``_unacked``). One still being replayed below its committed offset
        resumes at its first record not yet handled, so none of those is skipped either.
        """
        for tp, handled_upto in self._handled_upto.items():
            self._handled_upto[tp] = min(handled_upto, self._committed[tp])
            self._consumer.seek(tp, self._handled_upto[tp])

    async def _flush_after(
        self,
        previous: asyncio.Task | None,
        sending: list[asyncio.Task],
        handled: dict[TopicPartition, int],
    ) -> None:
        """:meth:`_flush` once ``previous`` (the flush of the batch before) succeeded; its failure
        fails this one too."""
        if previous is not None:
            try:
                await previous
            except BaseException:
                await asyncio.gather(*sending, return_exceptions=True)
                raise
        await self._flush(sending, handled)

    async def _flush(self, sending: list[asyncio.Task], handled: dict[TopicPartition, int]) -> None:
        """Wait until every ack in flight was published, then commit what was handled."""
        if sending:
            results = await asyncio.gather(*sending, return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
        offsets = {
            tp: offset for tp, offset in handled.items() if offset > self._committed.get(tp, 0)
        }
        if offsets:
            await self._consumer.commit(offsets)
            self._committed.update(offsets)
        for tp, offset in offsets.items():
            for done in [key for key in self._unacked if key[0] == tp and key[1] < offset]:
                del self._unacked[done]

    async def _handle_record(
        self,
        tp: TopicPartition,
        record: ConsumerRecord,
        envelope: schema.Envelope | None,
        error: str | None,
    ) -> AckRecords | None:
        """Everything but applying a command: dead letters, replays, acks to resend, inventory
        requests.

        Returns the ack's parts to publish (None when there is none). Commits nothing.
        """
        applied_before = record.offset < self._committed[tp]
        if envelope is None:
            if not applied_before and (tp, record.offset) not in self._unacked:
                await self._dead_letter(record, error)
                self._unacked[(tp, record.offset)] = None
            return None
        payload = envelope.payload
        assert isinstance(payload, schema.Command), (
            f"routing admits only commands on this topic, got {envelope.type}"
        )
        if isinstance(payload, schema.Invalidate):
            # Applied in an earlier life, or in this run with its ack not yet published, or a
            # re-send of a command applied in this run: remember, never apply again; a re-send gets
            # the command's ack again.
            self.handler.remember(payload)
            if applied_before:
                return None
            key = (tp, record.offset)
            if key not in self._unacked:
                assert payload.command_id in self._acks, (
                    f"command {payload.command_id} neither applied nor remembered"
                )
                self._unacked[key] = self._acks[payload.command_id]
                self.engine.metrics.commands_reacked.inc()
                log.info(
                    "node %s: re-acking a re-sent %s command", self.node_id, payload.predicate.kind
                )
            return self._unacked[key]
        if (
            isinstance(payload, schema.InventoryRequested)
            and payload.node_id == self.node_id
            and not applied_before
        ):
            if (tp, record.offset) not in self._unacked:
                await self.publisher.publish_inventory(payload.request_id)
                self._unacked[(tp, record.offset)] = None
        return None

    async def _dead_letter(self, record: ConsumerRecord, error: str) -> None:
        # The node's own topic: nodes never write kvledger.dead-letter, whose letters replay
        # republishes.
        await send_to_dead_letter(
            self._producer, record, error, self.group_id, topic=topics.NODE_DEAD_LETTER
        )
        if error.startswith(topics.ROUTING_ERROR):
            self.engine.metrics.misrouted_commands.labels(
                reason=error.removeprefix(topics.ROUTING_ERROR)
            ).inc()
        if error.startswith(SIGNATURE_ERROR):
            self.engine.metrics.unverified_commands.labels(
                reason=error.removeprefix(SIGNATURE_ERROR)
            ).inc()
