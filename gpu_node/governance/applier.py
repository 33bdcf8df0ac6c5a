"""Applying one ``Invalidate`` to a node: versions moved, matches tombstoned and deleted in every tier
and snapshot, an erasure's keys destroyed, and the per-tier evidence its ack carries.

:class:`InvalidationApplier` is what ``gpu_node.governance.commands`` calls for each command; it
owns nothing of the consumer (offsets, acks, replays).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from events import schema
from events.ack_parts import TierReport
from events.tiers import Tier
from gpu_node.pool.vocabulary import PoolEvent, RemovalEvidence, RemovalReason, RemovedFromPool
from prefix_keys.blocks import CacheProvenance

if TYPE_CHECKING:
    from gpu_node.engine.async_engine import AsyncEngine

from gpu_node.governance.erasure import (
    CryptoErasure,
    crypto_erase_subject,
    fetch_snapshot_keys,
    remove_from_snapshots,
)
from gpu_node.governance.predicates import block_predicate, predicate_index_key

log = logging.getLogger(__name__)

DEFAULT_DEFERRED_WAIT_S = 10.0
EVIDENCE_SUBSCRIBER = "command-evidence"
"""The :class:`InvalidationApplier`'s name among the cache manager's pool-event subscribers."""
BUILD_GUARD_MARGIN_S = 60.0
"""Slack on top of the singleflight wait for how long an erasure keeps refusing matching builds keyed before it was
applied: a request claims its blocks at most the singleflight wait after it computed its keys (and their ``created_at``)."""


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
