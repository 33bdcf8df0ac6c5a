"""Paged KV over the block pool's device tier: the scheduler's
:class:`~gpu_node.engine.scheduler.BlockAllocator`.

A running sequence's block table lists device slots of two kinds:

* **cached blocks** it references (``CacheEntry`` with a lock ref held for the
  sequence's whole life, since attention reads them every step): prefix hits,
  read in place on the device (host and disk hits are promoted into device
  slots before the first step that needs them), and blocks the sequence built
  itself and committed;
* **own slots** from :meth:`BlockPool.allocate_device_slots`, where its new KV is
  written during prefill and decode. When a slot fills a block the sequence
  claimed for the cache (singleflight builder), it is committed in place
  (:meth:`BlockPool.commit_slot`): bookkeeping, no copy.

Governance is the pool's: a referenced block is never zeroed under a reader;
an invalidation tombstones it and its bytes are deleted when the last
sequence holding it releases it. A hit tombstoned before the sequence's first
step is not used (the tokens are recomputed), so nothing is served from a
block after its tombstone.

Everything here runs on the engine's model worker thread (the engine hands new
sequences over through its inbox), so it needs no lock of its own; the pool's
calls take the pool's lock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from events.tiers import Tier
from gpu_node.cache.kv_cache_manager import KVCacheManager, PrefixPlan
from gpu_node.engine.scheduler import Sequence
from gpu_node.metrics import MissReason, NodeMetrics
from gpu_node.pool.block_pool import BlockPool
from gpu_node.pool.block_records import BlockRestoreError
from gpu_node.pool.vocabulary import BlockState, CacheEntry


@dataclass
class SequenceKV:
    """What one sequence holds in the pool besides its block table."""

    plan: PrefixPlan
    held: list[CacheEntry] = field(
        default_factory=list
    )  # referenced cached blocks (hits and own commits)
    own_slots: dict[int, int] = field(default_factory=dict)  # block index → own device slot
    num_cached_tokens: int = 0  # served from cache by the admission that produced its first token

    @property
    def pending_claims(self) -> list[CacheEntry]:
        return [entry for entry in self.plan.claimed if entry.state is BlockState.BUILDING]


class PagedKV:
    def __init__(self, pool: BlockPool, manager: KVCacheManager, metrics: NodeMetrics) -> None:
        self.pool = pool
        self.manager = manager
        self.metrics = metrics
        self.block_size = pool.spec.block_size
        self._sequences: dict[str, SequenceKV] = {}
        self.woken: list[bytes] = []
        """Block hashes whose builds this worker finished (committed or abandoned): the loop wakes their waiters."""

    def register(self, seq: Sequence, plan: PrefixPlan) -> None:
        """Take over a plan's references: the sequence holds its hits from now until :meth:`free`."""
        assert seq.seq_id not in self._sequences, "sequence ids are unique"
        self._sequences[seq.seq_id] = SequenceKV(plan, held=list(plan.hit_entries))

    def of(self, seq: Sequence) -> SequenceKV:
        return self._sequences[seq.seq_id]

    def forget(self, seq: Sequence) -> None:
        """Drop a finished sequence's record (after :meth:`free`)."""
        kv = self._sequences.pop(seq.seq_id)
        assert not kv.held and not kv.own_slots, "free a sequence before forgetting it"
        kv.plan.released = True

    # --- BlockAllocator -----------------------------------------------------------------------

    def prepare_prefix(self, seq: Sequence) -> None:
        kv = self._sequences[seq.seq_id]
        assert not seq.block_table and not kv.own_slots, (
            "a sequence matches its prefix once per admission"
        )
        # The hits found at request admission while they are still held, else what is cached now
        # (after a preemption or a release, the sequence's own commits included).
        hits = self._resident_prefix(kv.held or self._rematch(kv.plan))
        kv.held = hits
        seq.block_table = [entry.slot for entry in hits]
        seq.num_computed_tokens = len(hits) * self.block_size
        if seq.num_output_tokens == 0:
            kv.num_cached_tokens = (
                seq.num_computed_tokens
            )  # reported with the first token, so the last match counts

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        num_needed = -(-num_tokens // self.block_size) - len(seq.block_table)
        if num_needed <= 0:
            return True
        slots = self.pool.allocate_device_slots(num_needed)
        if slots is None:
            return False
        kv = self._sequences[seq.seq_id]
        first = len(seq.block_table)
        for offset, slot in enumerate(slots):
            kv.own_slots[first + offset] = slot
        seq.block_table.extend(slots)
        return True

    def free(self, seq: Sequence) -> None:
        kv = self._sequences[seq.seq_id]
        self.pool.free_device_slots(list(kv.own_slots.values()))
        self.pool.dec_lock_ref(kv.held)
        for entry in kv.pending_claims:
            self.pool.fail_build(entry)
            self.woken.append(entry.block_hash)
        kv.plan.claimed = []
        kv.own_slots.clear()
        kv.held = []
        seq.block_table.clear()

    # --- commits --------------------------------------------------------------------------------

    def commit_computed(self, seq: Sequence) -> None:
        """Commit every claimed block whose tokens are now all computed, in place, and keep referencing it."""
        kv = self._sequences[seq.seq_id]
        for entry in kv.pending_claims:
            index = entry.key.index
            if (index + 1) * self.block_size > seq.num_computed_tokens:
                break
            slot = kv.own_slots[index]
            if self.manager.commit_slot(kv.plan, entry, slot):
                del kv.own_slots[index]
                kv.held.append(entry)
            self.woken.append(entry.block_hash)

    # --- internals ------------------------------------------------------------------------------

    def _rematch(self, plan: PrefixPlan) -> list[CacheEntry]:
        """A preempted sequence's cached prefix now: whatever is READY (its own commits included),
        referenced."""
        with self.pool.lock:
            hits = self.pool.longest_ready_prefix([key.block_hash for key in plan.keys])
            self.pool.inc_lock_ref(hits)
        return hits

    def _resident_prefix(self, hits: list[CacheEntry]) -> list[CacheEntry]:
        """The leading hits usable in place on the device; the rest are released (their tokens get
        recomputed).

        Host and disk hits are promoted first (as many as the device can take).
        A hit tombstoned since the lookup, or whose file is corrupt or cannot be
        decrypted (removed by the pool), ends the usable prefix.
        """
        usable = len(hits)
        while True:
            for index, entry in enumerate(hits[:usable]):
                if entry.tombstoned or entry.tier is None:
                    usable = index
                    self.metrics.misses.labels(MissReason.KV_RESTORE_FAILED.value).inc()
                    break
            lower = [entry for entry in hits[:usable] if entry.tier is not Tier.DEVICE]
            if not lower:
                break
            promote_started = time.perf_counter()
            try:
                self.pool.read_blocks(lower, promote=True)
            except BlockRestoreError:
                # the pool removed the failing block (tier None) or it was tombstoned: cut there and
                # retry
                assert any(entry.tombstoned or entry.tier is None for entry in hits[:usable]), (
                    "a failed read names a removed block"
                )
                continue
            finally:
                self.metrics.restore_latency.observe(time.perf_counter() - promote_started)
            for index, entry in enumerate(hits[:usable]):
                if entry.tier is not Tier.DEVICE:
                    usable = index  # no device room left for the rest
                    break
            break
        self.pool.dec_lock_ref(hits[usable:])
        return hits[:usable]
