"""Governed removal: predicate matches tombstoned first, their bytes deleted in bulk, with per-block
evidence.

Its own part of the pool because removal is what an invalidation or erasure
command acks on: its ordering (every match tombstoned before any byte is
touched, the ``node.between_tombstone_and_delete`` fault point between the two)
deserves one place of its own. Entry bookkeeping (tombstone, drop, index) is
the pool state's (:class:`gpu_node.pool.state.PoolState`); this runs under the
state's lock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from events.fault_points import fault_point
from events.tiers import STORAGE_TIERS, Tier
from gpu_node.pool.state import PoolState
from gpu_node.pool.vocabulary import (
    INDEX_KINDS,
    BlockState,
    CacheEntry,
    IndexKey,
    RemovalEvidence,
    RemovalReason,
    RemovalReport,
)
from prefix_keys.blocks import CacheProvenance


class PoolRemover:
    """Serves the pool's ``remove_where``, ``remove_many`` and ``guard_builds`` on one pool state."""

    def __init__(self, state: PoolState) -> None:
        self._state = state

    def guard_builds(self, predicate: Callable[[CacheProvenance], bool], duration_s: float) -> None:
        """Refuse to build blocks matching ``predicate`` for ``duration_s`` (see
        :meth:`gpu_node.pool.block_pool.BlockPool.begin_build`).

        :meth:`remove_where` tombstones the matching builds it finds, but a
        request whose keys were computed before an invalidation's cutoff may
        claim its blocks only after the removal ran (it was waiting on another
        request's build). Registered *before* the removal, a guard closes that
        gap: every matching build is either found by the removal or refused
        there. The predicate carries the cutoff, so later blocks still build.
        """
        state = self._state
        if duration_s <= 0:
            raise ValueError("duration_s must be positive")
        with state.lock:
            now = state.clock()
            state.build_guards = [
                (guard, until) for guard, until in state.build_guards if until > now
            ]
            state.build_guards.append((predicate, now + duration_s))

    def remove_where(
        self,
        predicate: Callable[[CacheProvenance], bool],
        reason: RemovalReason,
        candidates: IndexKey | None = None,
    ) -> RemovalReport:
        """Delete every block whose provenance matches, in every tier, with per-block evidence.

        All matches are tombstoned before any byte is touched, so no match is
        served once this starts. Unreferenced READY matches are deleted now;
        referenced ones on their last release; BUILDING ones at commit.

        ``candidates`` (an :data:`IndexKey`) narrows the scan to the entries
        filed under that key — the caller guarantees every match is among
        them — and ``predicate`` is still applied to each. The report and the
        events are then exactly those of the full scan (same entries, same order).
        """
        return self.remove_many([(predicate, candidates)], reason)[0]

    def remove_many(
        self,
        requests: Sequence[tuple[Callable[[CacheProvenance], bool], IndexKey | None]],
        reason: RemovalReason,
    ) -> list[RemovalReport]:
        """:meth:`remove_where` for each ``(predicate, candidates)`` in order, with one bulk deletion of bytes.

        The reports and events are those of calling :meth:`remove_where` for
        each request in turn: a block deleted for one request is not reported
        again by a later one, while a referenced or BUILDING match is reported
        by every request matching it. All matches of all requests are
        tombstoned before any byte is touched.
        """
        state = self._state
        for _, candidates in requests:
            if candidates is not None and (not candidates or candidates[0] not in INDEX_KINDS):
                raise ValueError(f"unknown index key {candidates!r}")
        with state.lock:
            dropping: set[CacheEntry] = set()
            matches_per_request: list[list[CacheEntry]] = []
            for predicate, candidates in requests:
                scanned = (
                    state.entries.values() if candidates is None else state.candidates(candidates)
                )
                matches = [
                    entry
                    for entry in scanned
                    if entry not in dropping and predicate(entry.provenance)
                ]
                for entry in matches:
                    if not entry.tombstoned:
                        state.tombstone(entry, reason)
                    if entry.state is not BlockState.BUILDING and entry.ref_count == 0:
                        dropping.add(entry)
                matches_per_request.append(matches)
            fault_point("node.between_tombstone_and_delete")
            cleared = self._clear_bytes(list(dropping))
            return [
                self._report_removal(matches, reason, cleared) for matches in matches_per_request
            ]

    def _report_removal(
        self, matches: list[CacheEntry], reason: RemovalReason, cleared: dict[CacheEntry, bool]
    ) -> RemovalReport:
        """Drop the unreferenced ``matches`` whose bytes :meth:`_clear_bytes` deleted; report all of
        them."""
        state = self._state
        num_removed = dict.fromkeys(STORAGE_TIERS, 0)
        removed: list[bytes] = []
        deferred: list[bytes] = []
        building: list[bytes] = []
        evidence: list[RemovalEvidence] = []
        for entry in matches:
            if entry.state is BlockState.BUILDING:
                building.append(entry.block_hash)
            elif entry.ref_count > 0:
                deferred.append(entry.block_hash)
            else:
                tier = entry.tier
                evidence.append(state.drop(entry, reason, cleared[entry]))
                num_removed[tier] += 1
                removed.append(entry.block_hash)
        return RemovalReport(
            reason, num_removed, tuple(removed), tuple(deferred), tuple(building), tuple(evidence)
        )

    def _clear_bytes(self, entries: Sequence[CacheEntry]) -> dict[CacheEntry, bool]:
        """Delete the bytes of placed ``entries`` in bulk; per entry, whether the deletion verified.

        Memory slots are zeroed and read back with one operation per tier, files
        overwritten and unlinked in parallel: removing thousands of blocks costs a
        few tensor operations, not two per block. The entries stay indexed; the
        caller drops each with its outcome (:meth:`PoolState.drop`).
        """
        state = self._state
        cleared: dict[CacheEntry, bool] = {}
        for tier in (Tier.DEVICE, Tier.HOST):
            in_tier = sorted(
                (entry for entry in entries if entry.tier is tier), key=lambda entry: entry.slot
            )
            if in_tier:
                verified = state.memory[tier].zero_verified([entry.slot for entry in in_tier])
                cleared.update(zip(in_tier, verified, strict=True))
        files = [entry for entry in entries if entry.tier is Tier.DISK]
        if files:
            cleared.update(
                zip(
                    files,
                    state.disk.delete_many([entry.block_hash for entry in files]),
                    strict=True,
                )
            )
        return cleared
