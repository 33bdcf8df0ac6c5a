"""The router's block index: updates from kv-events, gaps, ledger re-reads, decisions and lookups,
exactly."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from helpers.ledger import block_hash, stored

from events.schema import (
    BlockMoved,
    BlockRemoved,
    BlockStored,
    DocumentPredicate,
    Inventory,
    MovedBlock,
    NamespacePredicate,
    NodeHeartbeat,
    NodeStarted,
    Placement,
    PolicyPredicate,
    RemovedBlock,
    SnapshotWritten,
    SubjectPredicate,
    TenantPredicate,
)
from events.tiers import Tier
from router import index as index_module
from router.index import (
    APPLIED,
    DUPLICATE,
    GAP,
    RESTARTED,
    STALE,
    BlockTags,
    PrefixIndex,
    PrefixMatch,
    TierWeights,
)
from router.index import Placement as LedgerPlacement

CUTOFF_S = datetime(2026, 11, 29, 13, 0, tzinfo=UTC).timestamp()
"""After every block ``helpers.ledger.stored`` makes (12:00)."""


def key(label: str) -> bytes:
    return bytes.fromhex(block_hash(label))


class Node:
    """One node's kv-event stream: NodeStarted at seq 0, then consecutive seqs."""

    def __init__(self, index: PrefixIndex, node_id: str, epoch: int = 1) -> None:
        self.index, self.node_id, self.epoch, self.seq = index, node_id, epoch, 0
        assert (
            index.apply(
                NodeStarted(node_id=node_id, epoch=epoch, seq=0, namespace="ns-test"), now=0.0
            )
            == RESTARTED
        )

    def send(self, payload_type, *, seq: int | None = None, **fields) -> str:
        self.seq = self.seq + 1 if seq is None else seq
        return self.index.apply(
            payload_type(node_id=self.node_id, epoch=self.epoch, seq=self.seq, **fields),
            now=float(self.seq),
        )

    def store(self, tier: str, *labels: str, seq: int | None = None, **provenance) -> str:
        return self.send(
            BlockStored, seq=seq, blocks=[stored(label, tier, **provenance) for label in labels]
        )


def chain(prefix: str, count: int) -> list[str]:
    return [f"{prefix}-{position}" for position in range(count)]


@pytest.fixture
def index() -> PrefixIndex:
    return PrefixIndex()


def test_the_run_of_each_node_starts_at_the_first_key_and_stops_at_its_first_hole(index):
    a, b = Node(index, "a"), Node(index, "b")
    a.store("device", *chain("p", 5))
    b.store("device", *chain("p", 2), "p-3", "p-4")  # a hole at p-2
    keys = [key(label) for label in chain("p", 6)]
    assert index.match(keys) == [PrefixMatch("b", 2, 2.0), PrefixMatch("a", 5, 5.0)]
    assert index.match([key("other"), *keys]) == []  # a run starts at the caller's first key


def test_runs_are_weighted_by_the_tier_each_block_is_read_from():
    index = PrefixIndex(TierWeights(device=4, host=2, disk=1))
    a, b = Node(index, "a"), Node(index, "b")
    a.store("device", "p-0")
    a.store("host", "p-1")
    a.store("disk", "p-2")
    b.store("disk", "p-0", "p-1", "p-2")
    b.store("device", "p-0")  # held twice: counted by its best tier
    matches = {m.node_id: m for m in index.match([key(label) for label in chain("p", 3)])}
    assert matches["a"] == PrefixMatch("a", 3, (4 + 2 + 1) / 4)
    assert matches["b"] == PrefixMatch("b", 3, (4 + 1 + 1) / 4)
    assert index.holders(key("p-0")) == {"a": Tier.DEVICE, "b": Tier.DEVICE}
    assert index.num_blocks() == {
        "a": {Tier.DEVICE: 1, Tier.HOST: 1, Tier.DISK: 1},
        "b": {Tier.DEVICE: 1, Tier.HOST: 0, Tier.DISK: 3},
    }


def test_many_nodes_leave_a_run_at_different_places(index):
    nodes = [Node(index, f"n{number}") for number in range(8)]
    for number, node in enumerate(nodes):
        node.store("device", *chain("p", number + 1))
    matches = index.match([key(label) for label in chain("p", 30)])
    assert sorted((m.node_id, m.num_blocks, m.weighted_blocks) for m in matches) == [
        (f"n{n}", n + 1, float(n + 1)) for n in range(8)
    ]


def test_removals_and_moves_update_the_run(index):
    a = Node(index, "a")
    a.store("device", *chain("p", 3))
    assert (
        a.send(
            BlockMoved,
            blocks=[MovedBlock(block_hash=block_hash("p-1"), from_tier="device", to_tier="disk")],
        )
        == APPLIED
    )
    assert index.match([key(label) for label in chain("p", 3)]) == [
        PrefixMatch("a", 3, (4 + 1 + 4) / 4)
    ]
    assert (
        a.send(
            BlockRemoved,
            blocks=[RemovedBlock(block_hash=block_hash("p-1"), tier="disk")],
            reason="evicted",
        )
        == APPLIED
    )
    assert index.match([key(label) for label in chain("p", 3)]) == [PrefixMatch("a", 1, 1.0)]
    assert index.holders(key("p-1")) == {}
    assert len(index) == 2


def test_snapshots_never_count_for_serving(index):
    a = Node(index, "a")
    assert a.send(SnapshotWritten, snapshot_id="s1", block_hashes=[block_hash("p-0")]) == APPLIED
    assert index.match([key("p-0")]) == []


def test_duplicates_and_older_epochs_are_skipped(index):
    a = Node(index, "a")
    a.store("device", "p-0")
    assert (
        a.send(
            BlockRemoved,
            seq=1,
            blocks=[RemovedBlock(block_hash=block_hash("p-0"), tier="device")],
            reason="evicted",
        )
        == DUPLICATE
    )
    stale = BlockStored(node_id="a", epoch=0, seq=9, blocks=[stored("old", "device")])
    assert index.apply(stale, now=2.0) == STALE
    assert index.holders(key("p-0")) == {"a": Tier.DEVICE}
    assert index.holders(key("old")) == {}
    assert index.node("a").reread_reason is None


def test_a_seq_hole_is_applied_and_marks_the_node_for_a_reread(index):
    a = Node(index, "a")
    assert a.store("device", "p-0", seq=2) == GAP
    assert index.holders(key("p-0")) == {"a": Tier.DEVICE}
    assert index.node("a").reread_reason == "seq 2 of epoch 1 follows 0 of epoch 1"


def test_a_new_epoch_without_node_started_is_a_gap(index):
    a = Node(index, "a")
    a.epoch = 2
    assert a.store("device", "p-0", seq=1) == GAP
    assert "epoch 2" in index.node("a").reread_reason


def test_a_node_the_index_never_read_is_a_gap(index):
    assert (
        index.apply(
            BlockStored(node_id="new", epoch=1, seq=5, blocks=[stored("p-0", "device")]), now=1.0
        )
        == GAP
    )
    assert index.node("new").reread_reason == "first record of a node the index never read"


def test_a_heartbeat_naming_an_unseen_seq_is_a_gap(index):
    Node(index, "a")
    assert index.apply(NodeHeartbeat(node_id="a", epoch=1, seq=0), now=5.0) == APPLIED
    assert index.node("a").last_seen == 5.0
    assert index.node("a").reread_reason is None
    assert index.apply(NodeHeartbeat(node_id="a", epoch=1, seq=3), now=6.0) == GAP
    assert index.node("a").reread_reason == "heartbeat names seq 3; the last received is 0"


def test_a_restart_drops_device_and_host_copies_and_keeps_disk(index):
    a = Node(index, "a")
    a.store("device", "d")
    a.store("host", "h")
    a.store("disk", "k")
    a.epoch, a.seq = 2, -1
    assert a.send(NodeStarted, namespace="ns-test") == RESTARTED
    assert [index.holders(key(label)) for label in ("d", "h", "k")] == [{}, {}, {"a": Tier.DISK}]
    assert index.node("a").reread_reason is None


def test_a_complete_inventory_replaces_the_node_copies(index):
    a = Node(index, "a")
    a.store("device", "gone")
    request_id = uuid.uuid4()
    first = dict(request_id=request_id, chunks=2, blocks=[stored("x", "device")])
    assert (
        a.send(
            Inventory,
            chunk=0,
            placements=[Placement(block_hash=block_hash("x"), tier="host")],
            **first,
        )
        == APPLIED
    )
    assert index.holders(key("gone")) == {"a": Tier.DEVICE}  # not before the last chunk
    second = dict(request_id=request_id, chunks=2, blocks=[stored("y", "device")])
    placements = [
        Placement(block_hash=block_hash("y"), tier="disk"),
        Placement(block_hash=block_hash("y"), tier="snapshot", snapshot_id="s"),
    ]
    assert a.send(Inventory, chunk=1, placements=placements, **second) == APPLIED
    assert [index.holders(key(label)) for label in ("gone", "x", "y")] == [
        {},
        {"a": Tier.HOST},
        {"a": Tier.DISK},
    ]


def _tags(**fields) -> BlockTags:
    defaults = dict(
        namespace="ns-test",
        tenant_id=None,
        subject_id=None,
        documents=(),
        auth_scopes=(),
        created_at=0.0,
    )
    return BlockTags(**(defaults | fields))


def test_a_ledger_read_replaces_the_node_and_replays_what_came_after_it(index):
    a = Node(index, "a")
    a.store("device", "p-0")  # seq 1
    a.store("device", "p-1", seq=3)  # a gap (seq 2 lost)
    a.send(
        BlockRemoved,
        blocks=[RemovedBlock(block_hash=block_hash("p-0"), tier="device")],
        reason="evicted",
    )  # seq 4
    assert index.node("a").reread_reason is not None
    # The ledger holds seqs up to 2: p-0 and the lost record's p-9; seqs 3 and 4 are replayed on
    # top.
    ledger = [
        LedgerPlacement(key("p-0"), Tier.DEVICE, _tags()),
        LedgerPlacement(key("p-9"), Tier.HOST, _tags()),
    ]
    assert index.replace_node("a", epoch=1, last_seq=2, placements=ledger) is None
    assert [index.holders(key(label)) for label in ("p-0", "p-1", "p-9")] == [
        {},
        {"a": Tier.DEVICE},
        {"a": Tier.HOST},
    ]
    assert (index.node("a").epoch, index.node("a").last_seq) == (1, 4)


def test_a_ledger_read_older_than_the_kept_records_stays_marked(index, monkeypatch):
    monkeypatch.setattr(index_module, "RECENT_EVENTS", 2)
    index = PrefixIndex()
    a = Node(index, "a")
    for label in ("p-0", "p-1", "p-2"):
        a.store("device", label)
    assert (
        index.replace_node("a", epoch=1, last_seq=0, placements=[])
        == "seq 2 of epoch 1 follows 0 of epoch 1"
    )


def test_an_invalidation_drops_the_matching_blocks_from_every_node_at_once(index):
    a, b = Node(index, "a"), Node(index, "b")
    v1 = dict(tenant_id="acme", scope="tenant", documents=["handbook@1"], auth_scopes=[("hr", 1)])
    v2 = dict(tenant_id="acme", scope="tenant", documents=["handbook@2"], auth_scopes=[("hr", 1)])
    for node in (a, b):
        node.store("device", "v1", **v1)
        node.store("device", "v2", **v2)
        node.store("device", "globex", tenant_id="globex", scope="tenant", documents=["handbook@1"])
    assert (
        index.invalidate(
            DocumentPredicate(tenant="acme", doc_id="handbook", below_version=2), CUTOFF_S
        )
        == 1
    )
    assert [index.holders(key(label)) for label in ("v1", "v2", "globex")] == [
        {},
        {"a": Tier.DEVICE, "b": Tier.DEVICE},
    ] + [{"a": Tier.DEVICE, "b": Tier.DEVICE}]
    assert index.num_blocks()["a"][Tier.DEVICE] == 2


def test_a_decision_spares_blocks_created_after_its_cutoff(index):
    Node(index, "a").store("device", "p-0", tenant_id="acme", scope="tenant")
    assert index.invalidate(TenantPredicate(tenant="acme"), cutoff_s=0.0) == 0
    assert index.invalidate(TenantPredicate(tenant="acme"), CUTOFF_S) == 1


def test_policy_namespace_and_subject_decisions(index):
    a = Node(index, "a")
    a.store("device", "old-policy", tenant_id="acme", scope="tenant", auth_scopes=[("hr", 1)])
    a.store("device", "new-policy", tenant_id="acme", scope="tenant", auth_scopes=[("hr", 2)])
    a.store("device", "other-ns", namespace="ns-other")
    a.store("device", "user", tenant_id="acme", scope="user", subject_id="ab" * 32)
    a.send(
        BlockStored,
        blocks=[stored("created", "device").model_copy(update={"creator_subject_id": "ab" * 32})],
    )
    assert (
        index.invalidate(PolicyPredicate(tenant="acme", auth_scope="hr", below_version=2), CUTOFF_S)
        == 1
    )
    assert index.invalidate(SubjectPredicate(tenant="acme", subject_id="ab" * 32), CUTOFF_S) == 2
    assert index.invalidate(NamespacePredicate(ns="ns-other"), CUTOFF_S) == 1
    assert [
        label
        for label in ("old-policy", "new-policy", "other-ns", "user", "created")
        if index.holders(key(label))
    ] == ["new-policy"]


def test_the_index_forgets_its_oldest_blocks_past_its_bound():
    index = PrefixIndex(max_blocks=2)
    Node(index, "a").store("device", "p-0", "p-1", "p-2")
    assert [bool(index.holders(key(label))) for label in ("p-0", "p-1", "p-2")] == [
        False,
        True,
        True,
    ]
    assert index.num_evicted == 1
    assert index.num_blocks()["a"][Tier.DEVICE] == 2
