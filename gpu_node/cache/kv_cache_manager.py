"""Request-level prefix cache manager (the vLLM ``kv_cache_manager.py`` layer).

Between the engine and the storage pool: finds the longest READY prefix of a
request's block keys and locks it, makes identical missing prefixes build once
(per-key singleflight with a bounded wait), commits newly computed blocks in place
(waking waiters as each block is committed, not when the builder finishes), and
explains misses. Explaining a miss needs memory the pool does not keep: a
*shadow index* (who could be served it + token-prefix hash → which namespace/key
stored it) and a bounded map of recently removed blocks with the reason they went
away. Both hold hashes only and are exposed only as aggregate counters.

A miss reason is readable by anyone who can read the counters, so it may only
compare the request with entries its caller could have been served: public ones,
its tenant's (for the auth scopes it presents) and its own. Whether *another*
tenant or user cached the same tokens never changes a reason: that would tell a
caller whether someone else sent a guessed prompt. Removed blocks are looked up by
the caller's own block hash, which only a block it could have been served has.
(The ``public`` scope is shared by design; its timing is the one residual channel,
docs/security.md.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gpu_node.cache.kv_cache_utils import compute_shadow_hashes
from gpu_node.metrics import MissReason, NodeMetrics
from gpu_node.pool.block_pool import BlockPool
from gpu_node.pool.vocabulary import (
    BlockState,
    CacheEntry,
    PoolEvent,
    RemovalReason,
    RemovedFromPool,
)
from prefix_keys.blocks import (
    TENANT_WIDE_AUTH_SCOPE,
    BlockKey,
    CacheProvenance,
    CacheScope,
    Principal,
)

log = logging.getLogger(__name__)

PoolEventSubscriber = Callable[[Sequence[PoolEvent]], None]
"""Receives each drained batch of pool events (:meth:`KVCacheManager.subscribe`); called on the event loop, must not block."""

_REMOVAL_TO_MISS = {
    RemovalReason.EVICTED: MissReason.EVICTED,
    RemovalReason.EXPIRED: MissReason.ENTRY_EXPIRED,
    RemovalReason.RESTORE_FAILED: MissReason.KV_RESTORE_FAILED,
    RemovalReason.INVALIDATED: MissReason.NO_ENTRY,
}


Audience = tuple
"""Who could be served a block: ``(PUBLIC,)``, ``(TENANT, tenant, auth scope names)`` or ``(USER,
tenant, subject)``."""


def _audience(provenance: CacheProvenance) -> Audience:
    """Mirrors the salt of :func:`prefix_keys.blocks.scope_salt`, less the policy versions."""
    if provenance.scope == CacheScope.PUBLIC:
        return (CacheScope.PUBLIC,)
    if provenance.scope == CacheScope.TENANT:
        return (
            CacheScope.TENANT,
            provenance.tenant_id,
            tuple(name for name, _ in provenance.auth_scopes),
        )
    return (CacheScope.USER, provenance.tenant_id, provenance.subject_id)


def _audiences_of(missing: BlockKey, principal: Principal) -> list[Audience]:
    """Audiences whose entries ``principal`` could have been served in place of ``missing``, most
    specific first."""
    audiences = [
        _audience(missing.provenance),
        (CacheScope.USER, principal.tenant_id, principal.subject_id),
        (CacheScope.TENANT, principal.tenant_id, (TENANT_WIDE_AUTH_SCOPE,)),
        (CacheScope.PUBLIC,),
    ]
    return list(dict.fromkeys(audiences))


class _BoundedMap(OrderedDict):
    """LRU-bounded dict: diagnostics must never grow without bound."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def put(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.capacity:
            self.popitem(last=False)


@dataclass
class PrefixPlan:
    """What one request gets from the cache and what it promised to build.

    ``hit_entries`` are locked (ref-counted) until the request's sequence is freed
    (``gpu_node.engine.paged_kv``) or, for a plan no sequence took over,
    :meth:`KVCacheManager.finish`; ``claimed`` are BUILDING entries this request leads and must
    commit or fail."""

    keys: list[BlockKey]
    hit_entries: list[CacheEntry] = field(default_factory=list)
    claimed: list[CacheEntry] = field(default_factory=list)
    shadow_hashes: list[bytes] = field(default_factory=list)
    miss_reason: MissReason | None = None
    build_wait_s: float = 0.0
    released: bool = False

    @property
    def num_hit_blocks(self) -> int:
        return len(self.hit_entries)


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        metrics: NodeMetrics,
        singleflight_wait_s: float = 30.0,
        diagnostics_capacity: int = 100_000,
    ) -> None:
        self.pool = pool
        self.metrics = metrics
        self.singleflight_wait_s = singleflight_wait_s
        self._subscribers: dict[str, PoolEventSubscriber] = {}
        self._inflight: dict[bytes, asyncio.Future] = {}
        self._shadow = _BoundedMap(diagnostics_capacity)
        self._recently_removed = _BoundedMap(diagnostics_capacity)
        self._num_waiters = 0

    async def acquire(
        self, keys: list[BlockKey], token_ids: Sequence[int], principal: Principal
    ) -> PrefixPlan:
        """Lock the longest READY prefix, waiting (bounded) for an in-flight build of the next block.

        ``principal`` (the caller) bounds what a miss is compared with (:meth:`_classify_miss`).
        """
        plan = PrefixPlan(keys=keys)
        if not keys:
            plan.miss_reason = MissReason.PREFIX_TOO_SHORT
            self.metrics.misses.labels(plan.miss_reason.value).inc()
            return plan
        hashes = [key.block_hash for key in keys]
        deadline = time.monotonic() + self.singleflight_wait_s
        while True:
            with self.pool.lock:
                hits = self.pool.longest_ready_prefix(hashes)
                if len(hits) == len(keys):
                    self.pool.inc_lock_ref(hits)
                    plan.hit_entries = hits
                    return plan
                future = self._inflight.get(hashes[len(hits)])
                if future is None or future.done() or time.monotonic() >= deadline:
                    self.pool.inc_lock_ref(hits)
                    plan.hit_entries = hits
                    self._claim_missing(plan, len(hits))
                    break
            plan.build_wait_s += await self._wait_for(future, deadline)
        plan.miss_reason = self._classify_miss(plan, token_ids, principal)
        self.metrics.misses.labels(plan.miss_reason.value).inc()
        return plan

    async def _wait_for(self, future: asyncio.Future, deadline: float) -> float:
        started = time.monotonic()
        self._num_waiters += 1
        self.metrics.singleflight_waiters.set(self._num_waiters)
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout=max(deadline - started, 0.0))
        except TimeoutError:
            pass  # bounded wait: the caller re-checks and falls back to computing itself
        finally:
            self._num_waiters -= 1
            self.metrics.singleflight_waiters.set(self._num_waiters)
        waited_s = time.monotonic() - started
        self.metrics.build_wait.observe(waited_s)
        return waited_s

    def _claim_missing(self, plan: PrefixPlan, first_missing: int) -> None:
        """Become the builder of every missing block nobody else is building."""
        loop = asyncio.get_running_loop()
        for key in plan.keys[first_missing:]:
            entry = self.pool.begin_build(key)
            if entry is None:
                continue
            plan.claimed.append(entry)
            self._inflight[key.block_hash] = loop.create_future()

    def _classify_miss(
        self, plan: PrefixPlan, token_ids: Sequence[int], principal: Principal
    ) -> MissReason:
        missing = plan.keys[plan.num_hit_blocks]
        plan.shadow_hashes = compute_shadow_hashes(token_ids, len(plan.keys), missing.block_size)
        removed = self._recently_removed.get(missing.block_hash)
        if removed is not None:
            return removed
        shadow_hash = plan.shadow_hashes[plan.num_hit_blocks]
        for audience in _audiences_of(missing, principal):
            seen = self._shadow.get((audience, shadow_hash))
            if seen is None:
                continue
            namespace, block_hash = seen
            if namespace != missing.provenance.namespace:
                return MissReason.MODEL_VERSION_MISMATCH
            if block_hash != missing.block_hash:
                return MissReason.AUTH_SCOPE_MISMATCH
            return MissReason.NO_ENTRY
        return MissReason.NO_ENTRY

    def commit_slot(self, plan: PrefixPlan, entry: CacheEntry, slot: int) -> bool:
        """Commit one claimed block whose KV the builder wrote into its own device ``slot`` (worker
        thread).

        False when the pool discarded it (tombstoned while building). The
        builder keeps the entry's one reference (:meth:`BlockPool.commit_slot`);
        waiters are woken by :meth:`wake` on the event loop.
        """
        if not self.pool.commit_slot(entry, slot):
            return False
        if plan.shadow_hashes:
            shadow_key = (_audience(entry.provenance), plan.shadow_hashes[entry.key.index])
            self._shadow.put(shadow_key, (entry.provenance.namespace, entry.block_hash))
        self.metrics.blocks_built.inc()
        return True

    def adopt_pulled(self, plan: PrefixPlan, committed: Sequence[CacheEntry]) -> int:
        """Make claimed blocks that were pulled from a peer and committed READY part of the plan's hit (event loop thread).

        ``committed`` are claimed entries at the plan's next indices, in order. Each
        leaves ``claimed`` (nothing is built into it any more); the run that is still
        READY — an invalidation may have tombstoned one since its commit — is
        referenced and extends ``hit_entries``, so the request computes only the
        rest. Waiters on these blocks are woken. Returns how many blocks were adopted.
        """
        adopted: list[CacheEntry] = []
        with self.pool.lock:
            contiguous = True
            for entry in committed:
                assert entry in plan.claimed, "only a plan's own claimed blocks are adopted"
                plan.claimed.remove(entry)
                next_index = plan.num_hit_blocks + len(adopted)
                contiguous = (
                    contiguous
                    and entry.key.index == next_index
                    and self.pool.get_ready(entry.block_hash) is entry
                )
                if contiguous:
                    adopted.append(entry)
            self.pool.inc_lock_ref(adopted)
            plan.hit_entries.extend(adopted)
        self.wake([entry.block_hash for entry in committed])
        return len(adopted)

    def wake(self, block_hashes: Sequence[bytes]) -> None:
        """Release the waiters of builds that ended (event loop thread): they look the prefix up
        again."""
        for block_hash in block_hashes:
            future = self._inflight.pop(block_hash, None)
            if future is not None and not future.done():
                future.set_result(None)

    def finish(self, plan: PrefixPlan) -> None:
        """Release locks, abandon builds and wake waiters of a plan no sequence took over (event loop thread). Idempotent."""
        if plan.released:
            return
        plan.released = True
        self.pool.dec_lock_ref(plan.hit_entries)
        for entry in plan.claimed:
            if entry.state == BlockState.BUILDING:
                self.pool.fail_build(entry)
        self.wake([entry.block_hash for entry in plan.claimed])
        self.drain_events()

    def subscribe(self, name: str, subscriber: PoolEventSubscriber) -> None:
        """Deliver every later batch of pool events to ``subscriber`` (see :meth:`drain_events` for the rules).

        ``name`` says what it is for (``"kv-events"``, ``"command-evidence"``) and labels its
        failures in ``kvledger_pool_event_subscriber_failures``; a name is taken once.
        """
        if not name:
            raise ValueError("a subscriber needs a name")
        if name in self._subscribers:
            raise ValueError(f"a pool-event subscriber named {name!r} is already subscribed")
        self._subscribers[name] = subscriber

    def unsubscribe(self, name: str) -> None:
        """Stop delivering to the subscriber ``name``; events drained later never reach it."""
        if self._subscribers.pop(name, None) is None:
            raise ValueError(f"no pool-event subscriber named {name!r}")

    def drain_events(self) -> tuple[PoolEvent, ...]:
        """Take the pool's events, remember removals for miss reasons, deliver them to every subscriber (event loop thread).

        Every subscriber receives the same batch, in the pool's order, in the order
        they subscribed; none depends on another having run. A subscriber that raises
        does not keep the batch from the others: the failure is logged (type only —
        events name blocks) and counted under its name, and the batch is not delivered
        to it again. That loses nothing silently for governance: the command
        evidence collector (:class:`gpu_node.governance.applier.InvalidationApplier`) only ever
        *adds* evidence, so a removal it missed leaves its command waiting and
        unacknowledged (a ``DeferredRemovalTimeout``, retried) — an ack is never sent
        without the evidence. The publisher's subscriber only queues the batch.
        """
        events = tuple(self.pool.take_events())
        for event in events:
            if isinstance(event, RemovedFromPool):
                reason = _REMOVAL_TO_MISS.get(event.reason)
                if reason is not None:
                    self._recently_removed.put(event.block_hash, reason)
        if events:
            for name, subscriber in tuple(self._subscribers.items()):
                try:
                    subscriber(events)
                except Exception as exc:  # noqa: BLE001 - one subscriber must not starve the others (rule above)
                    self.metrics.pool_event_subscriber_failures.labels(name).inc()
                    log.error(
                        "pool-event subscriber %r failed on %d events: %s",
                        name,
                        len(events),
                        type(exc).__name__,
                    )
        return events
