"""Model-based test of the storage pool: random
insert/hit/release/evict/expire/demote/promote/invalidate.

Invariants held after every step:
* the ledger rebuilt from ``take_events()`` alone equals where the pool holds
  bytes (every change of bytes produced exactly one event);
* no READY entry without complete KV: every placed block's bytes equal what
  was committed for it, in whatever tier it sits;
* a referenced block's slot is never freed or overwritten (the bytes of held
  entries stay intact, even when tombstoned), and every free slot is zero;
* entry counts and bytes per tier are exact (disk: real file sizes).
"""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from pathlib import Path

import hypothesis.strategies as st
import torch
from helpers.pool import NS, SPEC, FakeClock, block_hash, block_key, make_kv
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from events.tiers import STORAGE_TIERS, Tier
from gpu_node.keys.crypto import LocalKeyStore
from gpu_node.pool.block_pool import BlockPool
from gpu_node.pool.block_records import BlockRestoreError, decode_block_record
from gpu_node.pool.vocabulary import (
    BlockState,
    MovedInPool,
    PoolConfig,
    RemovalReason,
    RemovedFromPool,
    StoredInPool,
    provenance_index_keys,
)
from prefix_keys.blocks import BlockKey, CacheProvenance, CacheScope

NUM_KEYS = 9
SUBJECTS = ("alice", "bob")
TTL_S = {CacheScope.PUBLIC: 50.0, CacheScope.TENANT: 30.0, CacheScope.USER: None}


HASH_INDEX = {block_hash(i): i for i in range(NUM_KEYS)}


def make_key(i: int) -> BlockKey:
    """Block i has a fixed scope (public, tenant with a document, user) and subject, so its hash is
    stable."""
    scope = (CacheScope.PUBLIC, CacheScope.TENANT, CacheScope.USER)[i % 3]
    provenance = CacheProvenance(
        namespace=NS,
        tenant_id=None if scope == CacheScope.PUBLIC else "acme",
        scope=scope,
        auth_scopes=(("hr", 1),) if scope == CacheScope.TENANT else (),
        subject_id=SUBJECTS[i % 2] if scope == CacheScope.USER else None,
        documents=("handbook@1",) if scope == CacheScope.TENANT else (),
        created_at=0.0,
    )
    return block_key(i, provenance)


indices = st.integers(0, NUM_KEYS - 1)


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="kvpool-"))
        self.clock = FakeClock()
        self.keys = LocalKeyStore(self.root / "keys.json")
        config = PoolConfig(
            NS,
            num_device_blocks=2,
            num_host_blocks=2,
            max_disk_blocks=2,
            disk_dir=self.root / "disk",
            ttl_s=TTL_S,
        )
        self.pool = BlockPool(
            SPEC, config, self.keys, clock=self.clock, wall_clock=lambda: self.clock() + 1e6
        )
        self.ledger: dict[bytes, Tier] = {}
        self.held: list = []
        self.building: list = []
        # Where each held entry's bytes were when its reader last read them: the pool must not move
        # them.
        self.location: dict[int, tuple[Tier | None, int | None]] = {}
        # Disk blocks sealed under a key destroyed since: the only blocks allowed to fail restoring.
        self.unreadable: set[bytes] = set()

    def teardown(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    # --- rules --------------------------------------------------------------------------------

    @rule(i=indices, fail=st.booleans())
    def insert(self, i: int, fail: bool) -> None:
        entry = self.pool.begin_build(make_key(i))
        if entry is None:
            assert self.pool.state_of(block_hash(i)) is not None
            return
        if fail:
            self.pool.fail_build(entry)
            assert entry.state is BlockState.FAILED
        elif self.pool.commit_build(entry, make_kv(i)):
            assert entry.state is BlockState.READY and entry.tier is Tier.DEVICE
        else:
            assert entry.state is BlockState.FAILED  # every device slot referenced

    @rule(i=indices)
    def begin_build(self, i: int) -> None:
        entry = self.pool.begin_build(make_key(i))
        if entry is not None:
            self.building.append(entry)

    @precondition(lambda self: self.building)
    @rule(data=st.data(), fail=st.booleans())
    def finish_build(self, data, fail: bool) -> None:
        entry = self.building.pop(data.draw(st.integers(0, len(self.building) - 1)))
        if fail:
            self.pool.fail_build(entry)
            return
        tombstoned = entry.tombstoned
        committed = self.pool.commit_build(entry, make_kv(HASH_INDEX[entry.block_hash]))
        assert not (tombstoned and committed), "a block invalidated while building became READY"
        assert entry.state is (BlockState.READY if committed else BlockState.FAILED)

    @rule(i=indices, promote=st.booleans())
    def hit(self, i: int, promote: bool) -> None:
        with self.pool.lock:
            entry = self.pool.get_ready(block_hash(i))
            if entry is None:
                return
            self.pool.inc_lock_ref([entry])
        self.held.append(entry)
        try:
            kv = self.pool.read_blocks([entry], promote=promote)
        except BlockRestoreError:
            assert entry.block_hash in self.unreadable
            assert self.pool.state_of(entry.block_hash) is None
        else:
            assert torch.equal(kv[0], make_kv(i))
        self.location[id(entry)] = (entry.tier, entry.slot)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data) -> None:
        entry = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.pool.dec_lock_ref([entry])

    @rule(i=indices, tier=st.sampled_from([Tier.HOST, Tier.DISK]))
    def demote(self, i: int, tier: Tier) -> None:
        entry = self.pool.get_ready(block_hash(i))
        before = None if entry is None else entry.tier
        moved = self.pool.demote(block_hash(i), tier)
        if moved:
            assert entry.tier is tier and before is not tier
        elif entry is not None and entry.ref_count > 0:
            assert entry.tier is before

    @rule(dt=st.floats(0.0, 15.0))
    def advance_and_expire(self, dt: float) -> None:
        self.clock.now += dt
        self.pool.expire()

    @rule(what=st.sampled_from(["alice", "bob", "handbook@1", "public"]))
    def invalidate(self, what: str) -> None:
        def matches(provenance: CacheProvenance) -> bool:
            if what == "public":
                return provenance.scope == CacheScope.PUBLIC
            return provenance.subject_id == what or what in provenance.documents

        # The documents and "public" removals go through the index (tenant None holds the public
        # blocks).
        candidates = {
            "handbook@1": ("document", "acme", "handbook"),
            "public": ("tenant", None),
        }.get(what)
        report = self.pool.remove_where(matches, RemovalReason.INVALIDATED, candidates=candidates)
        assert report.all_verified
        assert len(report.evidence) == len(report.removed) == sum(report.num_removed.values())
        for block in report.removed + report.deferred:
            assert self.pool.get_ready(block) is None
        for entry in self.building:
            if matches(entry.provenance):
                assert entry.tombstoned and entry.block_hash in report.discarded_building

    @rule(subject=st.sampled_from(SUBJECTS))
    def destroy_key(self, subject: str) -> None:
        key_id = self.keys.current_key_id("acme", subject)
        if key_id is None or not self.keys.destroy(key_id):
            return
        for block, tier in self.ledger.items():
            if tier is Tier.DISK and make_key(HASH_INDEX[block]).provenance.subject_id == subject:
                self.unreadable.add(block)

    # --- invariants ----------------------------------------------------------------------------

    def _placed(self) -> list:
        """Entries whose bytes the pool holds (READY, or EVICTING while still referenced)."""
        return [entry for entry in self.pool.state.entries.values() if entry.tier is not None]

    def _apply_events(self) -> None:
        for event in self.pool.take_events():
            if isinstance(event, StoredInPool):
                assert event.key.block_hash not in self.ledger, "stored twice without removal"
                assert event.tier is Tier.DEVICE
                self.ledger[event.key.block_hash] = event.tier
            elif isinstance(event, MovedInPool):
                assert self.ledger[event.block_hash] is event.from_tier
                self.ledger[event.block_hash] = event.to_tier
            else:
                assert isinstance(event, RemovedFromPool)
                assert self.ledger.pop(event.block_hash) is event.tier
                assert event.evidence is not None and event.evidence.verified
                self.unreadable.discard(event.block_hash)

    @invariant()
    def events_account_for_every_byte(self) -> None:
        self._apply_events()
        assert self.ledger == {entry.block_hash: entry.tier for entry in self._placed()}

    @invariant()
    def byte_accounting_is_exact(self) -> None:
        self._apply_events()
        stats = self.pool.stats()
        counts = Counter(self.ledger.values())
        assert stats.num_entries == {tier: counts.get(tier, 0) for tier in STORAGE_TIERS}
        files = {path.name: path.stat().st_size for path in (self.root / "disk").iterdir()}
        assert sorted(files) == sorted(
            f"{block.hex()}.kvb" for block, tier in self.ledger.items() if tier is Tier.DISK
        )
        assert stats.tier_bytes == {
            Tier.DEVICE: counts.get(Tier.DEVICE, 0) * SPEC.block_bytes,
            Tier.HOST: counts.get(Tier.HOST, 0) * SPEC.block_bytes,
            Tier.DISK: sum(files.values()),
        }
        assert (
            counts.get(Tier.DEVICE, 0) <= 2
            and counts.get(Tier.HOST, 0) <= 2
            and counts.get(Tier.DISK, 0) <= 2
        )
        assert stats.num_building == sum(
            entry.state is BlockState.BUILDING for entry in self.pool.state.entries.values()
        )

    @invariant()
    def every_placed_block_holds_exactly_its_committed_kv(self) -> None:
        used = {Tier.DEVICE: set(), Tier.HOST: set()}
        for entry in self._placed():
            assert entry.state in (BlockState.READY, BlockState.EVICTING)
            assert (entry.state is BlockState.EVICTING) == entry.tombstoned
            assert entry.state is BlockState.READY or entry.ref_count > 0, (
                "an unreferenced tombstoned block kept its bytes"
            )
            expected = make_kv(HASH_INDEX[entry.block_hash])
            if entry.tier is Tier.DISK:
                if entry.block_hash in self.unreadable:
                    continue
                data = (self.root / "disk" / f"{entry.block_hash.hex()}.kvb").read_bytes()
                payload = decode_block_record(data, self.keys).payload
                assert payload == expected.numpy().tobytes()
            else:
                assert entry.slot not in used[entry.tier], "two entries share a slot"
                used[entry.tier].add(entry.slot)
                assert torch.equal(self.pool.state.memory[entry.tier].table[entry.slot], expected)
        for tier, slots in used.items():
            for slot in range(self.pool.state.memory[tier].table.shape[0]):
                if slot not in slots:
                    assert torch.count_nonzero(self.pool.state.memory[tier].table[slot]) == 0, (
                        f"free {tier} slot {slot} not zeroed"
                    )

    @invariant()
    def references_match_the_readers(self) -> None:
        held = Counter(id(entry) for entry in self.held)
        for entry in self.pool.state.entries.values():
            assert entry.ref_count == held.get(id(entry), 0)
        for entry in self.held:
            assert entry.ref_count == held[id(entry)]
            assert (entry.tier, entry.slot) == self.location[id(entry)], (
                "the pool moved or freed a referenced block"
            )

    @invariant()
    def provenance_index_files_exactly_the_entries(self) -> None:
        expected: dict = {}
        for block, entry in self.pool.state.entries.items():
            for key in provenance_index_keys(entry.provenance):
                expected.setdefault(key, {})[block] = entry
        assert {key: list(bucket.items()) for key, bucket in self.pool.state.index.items()} == {
            key: list(bucket.items()) for key, bucket in expected.items()
        }

    @invariant()
    def lookups_return_only_ready_blocks(self) -> None:
        for entry in self.pool.ready_entries():
            assert entry.state is BlockState.READY and not entry.tombstoned
        prefix = self.pool.longest_ready_prefix([block_hash(i) for i in range(NUM_KEYS)])
        assert all(entry.state is BlockState.READY for entry in prefix)


PoolMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPoolStateMachine = PoolMachine.TestCase
