"""Governed removal alone: what is removed now, deferred to the last reader or discarded at commit,
with evidence."""

from __future__ import annotations

import pytest
import torch
from helpers.pool import FakeClock, block_hash, building, make_state, placed, put, scoped_key

from events.tiers import Tier
from gpu_node.pool.removal import PoolRemover
from gpu_node.pool.vocabulary import (
    METHOD_OVERWRITE_UNLINK,
    METHOD_ZERO_FILL,
    BlockState,
    RemovalEvidence,
    RemovalReason,
    RemovedFromPool,
)
from prefix_keys.blocks import CacheScope

DEVICE, HOST, DISK = Tier.DEVICE, Tier.HOST, Tier.DISK
INVALIDATED = RemovalReason.INVALIDATED


def handbook(i: int, version: int = 1):
    return scoped_key(i, CacheScope.TENANT, documents=(f"handbook@v{version}",))


def cites_handbook(provenance) -> bool:
    return any(tag.startswith("handbook@") for tag in provenance.documents)


def test_unreferenced_matches_go_now_held_ones_later_and_builds_at_commit(tmp_path):
    state = make_state(tmp_path, device=3, host=1, disk=1)
    put(state, 0, key=handbook(0))
    put(state, 1, HOST, key=handbook(1))
    put(state, 2, DISK, key=handbook(2))
    held = put(state, 3, key=handbook(3), ref_count=1)
    claimed = building(state, 4, key=handbook(4))
    put(state, 5)  # public, cites nothing
    report = PoolRemover(state).remove_where(cites_handbook, INVALIDATED)
    assert report.removed == (block_hash(0), block_hash(1), block_hash(2))
    assert report.num_removed == {DEVICE: 1, HOST: 1, DISK: 1}
    assert (report.deferred, report.discarded_building) == ((block_hash(3),), (block_hash(4),))
    assert [
        (item.block_hash, item.tier, item.method, item.verified) for item in report.evidence
    ] == [
        (block_hash(0), DEVICE, METHOD_ZERO_FILL, True),
        (block_hash(1), HOST, METHOD_ZERO_FILL, True),
        (block_hash(2), DISK, METHOD_OVERWRITE_UNLINK, True),
    ]
    assert report.all_verified
    assert [event.block_hash for event in state.events] == list(report.removed)
    assert all(
        isinstance(event, RemovedFromPool) and event.reason is INVALIDATED for event in state.events
    )
    assert (
        torch.count_nonzero(state.memory[HOST].table) == 0
        and not state.disk.path(block_hash(2)).exists()
    )
    assert placed(state) == {3: (DEVICE, 1), 5: (DEVICE, 2)}
    assert (held.state, held.tombstoned, claimed.tombstoned) == (BlockState.EVICTING, True, True)


def test_a_narrowed_removal_visits_only_the_candidates_and_still_applies_the_predicate(tmp_path):
    state = make_state(tmp_path, device=4)
    for i in range(3):
        put(state, i, key=handbook(i, version=1 + i % 2))
    put(state, 3, key=scoped_key(3, CacheScope.TENANT, documents=("faq@v1",)))
    report = PoolRemover(state).remove_where(
        lambda provenance: "handbook@v2" in provenance.documents,
        INVALIDATED,
        ("document", "acme", "handbook"),
    )
    assert report.removed == (block_hash(1),)
    assert sorted(placed(state)) == [0, 2, 3]


def test_remove_many_reports_a_deleted_block_once_and_a_held_one_for_every_request(tmp_path):
    state = make_state(tmp_path, device=3)
    put(state, 0, key=handbook(0))
    put(state, 1, key=handbook(1), ref_count=1)
    first, second = PoolRemover(state).remove_many(
        [(cites_handbook, None), (cites_handbook, ("tenant", "acme"))], INVALIDATED
    )
    assert (first.removed, first.deferred) == ((block_hash(0),), (block_hash(1),))
    assert (second.removed, second.deferred) == ((), (block_hash(1),))
    assert [event.block_hash for event in state.events] == [block_hash(0)]


def test_bulk_removal_evidence_matches_the_one_by_one_drop(tmp_path):
    state = make_state(tmp_path, device=2)
    put(state, 0, key=handbook(0))
    (report,) = PoolRemover(state).remove_many([(cites_handbook, None)], INVALIDATED)
    assert report.evidence == (
        RemovalEvidence(block_hash(0), DEVICE, METHOD_ZERO_FILL, False, True),
    )
    assert state.memory[DEVICE].free == [0, 1] and state.num_entries[DEVICE] == 0


def test_unknown_index_keys_are_refused(tmp_path):
    remover = PoolRemover(make_state(tmp_path))
    with pytest.raises(ValueError, match="unknown index key"):
        remover.remove_where(cites_handbook, INVALIDATED, ("subject", "alice"))
    with pytest.raises(ValueError, match="unknown index key"):
        remover.remove_where(cites_handbook, INVALIDATED, ())


def test_build_guards_expire_and_are_pruned_when_the_next_one_is_registered(tmp_path):
    clock = FakeClock(100.0)
    state = make_state(tmp_path, clock=clock)
    remover = PoolRemover(state)
    remover.guard_builds(cites_handbook, 5.0)
    assert state.build_guards == [(cites_handbook, 105.0)]
    clock.now = 106.0

    def cites_faq(provenance) -> bool:
        return False

    remover.guard_builds(cites_faq, 1.0)
    assert state.build_guards == [(cites_faq, 107.0)]
    with pytest.raises(ValueError, match="positive"):
        remover.guard_builds(cites_faq, 0.0)
