"""The index's chains: each entry's runs and weights along its recorded parents, kept exact through
stores, removals, moves, invalidations, restarts and ledger re-reads, and a lookup over a recorded
chain equal to the count along the keys (a naive reference, over random event sequences)."""

from __future__ import annotations

from datetime import UTC, datetime

from helpers.ledger import block_hash, stored
from hypothesis import given, settings
from hypothesis import strategies as st

from events.schema import (
    BlockMoved,
    BlockRemoved,
    BlockStored,
    MovedBlock,
    NodeStarted,
    RemovedBlock,
    TenantPredicate,
)
from events.tiers import Tier
from router.index import RESTARTED, BlockTags, Placement, PrefixIndex, PrefixMatch, TierWeights

CUTOFF_S = datetime(2026, 11, 29, 13, 0, tzinfo=UTC).timestamp()
"""After every block ``helpers.ledger.stored`` makes (12:00)."""
ROOT = "namespace-root"
"""The parent every chain's first block names (a hash the index never holds, as a namespace root)."""


def key(label: str) -> bytes:
    return bytes.fromhex(block_hash(label))


def keys(*labels: str) -> list[bytes]:
    return [key(label) for label in labels]


def chain(prefix: str, count: int, start: int = 0) -> list[str]:
    return [f"{prefix}-{position}" for position in range(start, count)]


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

    def send(self, payload_type, **fields) -> str:
        self.seq += 1
        return self.index.apply(
            payload_type(node_id=self.node_id, epoch=self.epoch, seq=self.seq, **fields),
            now=float(self.seq),
        )

    def store(self, tier: str, *labels: str, parents: dict[str, str] | None = None, **tags) -> str:
        """Store ``labels``; each names the label before it as its parent (the first names
        ``ROOT``) unless ``parents`` says otherwise (``""``: no parent named)."""
        parents = parents or {}
        named = {
            label: parents[label] if label in parents else _previous(label) for label in labels
        }
        return self.send(
            BlockStored,
            blocks=[stored(label, tier, parent=named[label] or None, **tags) for label in labels],
        )

    def remove(self, tier: str, *labels: str) -> str:
        return self.send(
            BlockRemoved,
            blocks=[RemovedBlock(block_hash=block_hash(label), tier=tier) for label in labels],
            reason="evicted",
        )

    def move(self, label: str, from_tier: str, to_tier: str) -> str:
        return self.send(
            BlockMoved,
            blocks=[MovedBlock(block_hash=block_hash(label), from_tier=from_tier, to_tier=to_tier)],
        )

    def restart(self) -> str:
        self.epoch, self.seq = self.epoch + 1, -1
        return self.send(NodeStarted, namespace="ns-test")


def _previous(label: str) -> str:
    prefix, _, position = label.rpartition("-")
    return ROOT if position == "0" else f"{prefix}-{int(position) - 1}"


def test_a_stored_chain_is_looked_up_along_its_parents():
    index = PrefixIndex()
    a, b = Node(index, "a"), Node(index, "b")
    a.store("device", *chain("p", 5))
    b.store("device", "p-0", "p-1", "p-3", "p-4")  # a hole at p-2
    assert index.match(keys(*chain("p", 6))) == [
        PrefixMatch("b", 2, 2.0),
        PrefixMatch("a", 5, 5.0),
    ]
    assert index.match(keys("p-0", "p-1")) == [PrefixMatch("a", 2, 2.0), PrefixMatch("b", 2, 2.0)]
    assert index.num_walks == 0


def test_a_removal_in_the_middle_of_a_run_shortens_it_below_and_only_for_that_node():
    index = PrefixIndex()
    a, b = Node(index, "a"), Node(index, "b")
    for node in (a, b):
        node.store("device", *chain("p", 5))
    a.remove("device", "p-2")
    assert index.match(keys(*chain("p", 5))) == [PrefixMatch("a", 2, 2.0), PrefixMatch("b", 5, 5.0)]
    a.store("host", "p-2")  # the hole filled from another tier: a's run is whole again
    assert index.match(keys(*chain("p", 5))) == [
        PrefixMatch("a", 5, (4 + 4 + 3 + 4 + 4) / 4),
        PrefixMatch("b", 5, 5.0),
    ]
    assert index.num_walks == 0


def test_a_block_no_node_holds_breaks_the_chain_until_it_is_stored_again():
    index = PrefixIndex()
    a, b = Node(index, "a"), Node(index, "b")
    a.store("device", *chain("p", 5))
    b.store("disk", "p-3", "p-4")
    a.remove("device", "p-2")
    assert index.holders(key("p-2")) == {}
    assert index.match(keys(*chain("p", 5))) == [PrefixMatch("a", 2, 2.0)]
    # Without its parent, p-3 starts a chain: keys from there are a recorded chain too.
    assert index.match(keys("p-3", "p-4")) == [
        PrefixMatch("a", 2, 2.0),
        PrefixMatch("b", 2, 0.5),
    ]
    a.store("device", "p-2")  # its children are linked to it again
    assert index.match(keys(*chain("p", 5))) == [PrefixMatch("a", 5, 5.0)]
    assert index.match(keys("p-3", "p-4")) == [
        PrefixMatch("a", 2, 2.0),
        PrefixMatch("b", 2, 0.5),
    ]
    assert index.num_walks == 1  # p-3 names a parent the index holds again: counted along keys


def test_children_stored_before_their_parent_are_linked_when_it_arrives():
    index = PrefixIndex()
    a = Node(index, "a")
    a.store("device", "p-4", "p-2", "p-3")
    a.store("host", "p-1", "p-0")
    assert index.match(keys(*chain("p", 5))) == [PrefixMatch("a", 5, (3 + 3 + 4 + 4 + 4) / 4)]
    assert index.num_walks == 0


def test_a_parent_outside_a_run_ends_the_runs_of_the_children_it_links():
    index = PrefixIndex()
    m, n = Node(index, "m"), Node(index, "n")
    m.store("device", "p-0")
    n.store("device", "p-2", "p-3", "p-4")  # they start a chain until p-1 arrives
    assert index.match(keys("p-2", "p-3", "p-4")) == [PrefixMatch("n", 3, 3.0)]
    n.store("device", "p-1")  # n holds no p-0: no run of n reaches p-1, nor anything below it
    assert index.match(keys(*chain("p", 5))) == [PrefixMatch("m", 1, 1.0)]
    assert index.num_walks == 0


def test_a_parent_linked_below_a_run_ends_it_for_every_node():
    index = PrefixIndex()
    n0, n1 = Node(index, "n0"), Node(index, "n1")
    n0.store("device", "p-2", "p-3")  # p-2 starts a chain: p-1 is not held
    n1.store("device", "p-2")
    n1.store("device", "p-1")  # n0's run no longer starts at p-2, nor reaches p-3
    assert index.match(keys("p-1", "p-2", "p-3")) == [PrefixMatch("n1", 2, 2.0)]
    assert index.num_walks == 0


def test_a_move_between_tiers_reweights_the_rest_of_the_chain():
    index = PrefixIndex(TierWeights(device=4, host=2, disk=1))
    a, b = Node(index, "a"), Node(index, "b")
    a.store("device", *chain("p", 4))
    b.store("device", *chain("p", 2))
    a.move("p-1", "device", "disk")
    assert index.match(keys(*chain("p", 4))) == [
        PrefixMatch("b", 2, 2.0),
        PrefixMatch("a", 4, (4 + 1 + 4 + 4) / 4),
    ]
    a.move("p-1", "disk", "host")
    assert index.match(keys(*chain("p", 3))) == [
        PrefixMatch("b", 2, 2.0),
        PrefixMatch("a", 3, (4 + 2 + 4) / 4),
    ]
    assert index.num_walks == 0


def test_an_invalidation_in_the_middle_of_a_chain_ends_every_run_there():
    index = PrefixIndex()
    a, b = Node(index, "a"), Node(index, "b")
    for node in (a, b):
        node.store("device", "p-0", "p-1")
        node.store("device", "p-2", tenant_id="acme", scope="tenant")
        node.store("device", "p-3", "p-4")
    assert index.invalidate(TenantPredicate(tenant="acme"), CUTOFF_S) == 1
    assert index.match(keys(*chain("p", 5))) == [PrefixMatch("a", 2, 2.0), PrefixMatch("b", 2, 2.0)]
    assert index.match(keys("p-3", "p-4")) == [PrefixMatch("a", 2, 2.0), PrefixMatch("b", 2, 2.0)]
    assert index.num_walks == 0


def test_a_restart_keeps_only_the_disk_part_of_a_chain():
    index = PrefixIndex()
    a = Node(index, "a")
    a.store("disk", "p-0", "p-1")
    a.store("device", "p-2", "p-3")
    a.store("disk", "p-3")
    assert a.restart() == RESTARTED
    assert index.match(keys(*chain("p", 4))) == [PrefixMatch("a", 2, 0.5)]
    assert index.match(keys("p-3")) == [PrefixMatch("a", 1, 0.25)]
    assert index.num_walks == 0


def _placement(label: str, tier: Tier, *, parent: bool) -> Placement:
    tags = BlockTags("ns-test", None, None, (), (), 0.0)
    parent_hash = key(_previous(label)) if parent else None
    return Placement(key(label), tier, tags, parent_hash=parent_hash)


def test_a_ledger_read_keeps_the_chains_it_names_and_is_walked_without_them():
    index = PrefixIndex()
    a = Node(index, "a")
    a.store("device", *chain("p", 3))
    with_parents = [_placement(label, Tier.HOST, parent=True) for label in chain("p", 4)]
    assert index.replace_node("a", epoch=1, last_seq=1, placements=with_parents) is None
    assert index.match(keys(*chain("p", 4))) == [PrefixMatch("a", 4, 3.0)]
    assert index.num_walks == 0
    bare = PrefixIndex()
    Node(bare, "a")
    without = [_placement(label, Tier.HOST, parent=False) for label in chain("p", 4)]
    assert bare.replace_node("a", epoch=1, last_seq=0, placements=without) is None
    assert bare.match(keys(*chain("p", 4))) == [PrefixMatch("a", 4, 3.0)]
    assert bare.num_walks == 1
    Node(bare, "b").store("device", *chain("p", 4))  # the first parents named are recorded
    assert bare.match(keys(*chain("p", 4))) == [
        PrefixMatch("a", 4, 3.0),
        PrefixMatch("b", 4, 4.0),
    ]
    assert bare.num_walks == 1


def test_keys_off_the_recorded_chain_are_counted_along_the_keys():
    index = PrefixIndex()
    a = Node(index, "a")
    a.store("device", *chain("p", 3))
    a.store("device", "q-0", parents={"q-0": ""})
    assert index.match(keys("p-0", "q-0", "p-2")) == [PrefixMatch("a", 3, 3.0)]
    assert index.match(keys("p-1", "p-2")) == [PrefixMatch("a", 2, 2.0)]  # p-1 has a parent
    assert index.num_walks == 2


def test_parent_records_that_would_close_a_loop_are_not_kept():
    index = PrefixIndex()
    a = Node(index, "a")
    a.store("device", "x", "y", parents={"x": "", "y": "x"})
    a.store("device", "z", parents={"z": "y"})
    Node(index, "b").store("device", "x", parents={"x": "z"})  # x → z → y → x
    Node(index, "c").store("device", "w", parents={"w": "w"})  # its own parent
    assert index.match(keys("x", "y", "z")) == [
        PrefixMatch("b", 1, 1.0),
        PrefixMatch("a", 3, 3.0),
    ]
    assert index.match(keys("w")) == [PrefixMatch("c", 1, 1.0)]
    assert index.num_walks == 0


def test_an_evicted_parent_unlinks_its_children():
    index = PrefixIndex(max_blocks=3)
    a = Node(index, "a")
    a.store("device", *chain("p", 4))  # p-0 leaves for p-3
    assert index.holders(key("p-0")) == {}
    assert index.match(keys(*chain("p", 4))) == []
    assert index.match(keys(*chain("p", 4, start=1))) == [PrefixMatch("a", 3, 3.0)]
    assert index.num_walks == 0


# -- the property: a lookup equals the count along the keys ----------------------------------------

NODES = ("n0", "n1", "n2")
TIERS = ("device", "host", "disk")
TREE = {
    **{label: _previous(label) for label in chain("a", 6)},
    **{label: _previous(label) for label in chain("b", 6, start=3)},
    "b-3": "a-2",  # b forks off a after three blocks
}
"""Two chains sharing their first three blocks; the ``b`` blocks belong to tenant acme."""
LABELS = sorted(TREE)
PATHS = [
    [*chain("a", 6)],
    [*chain("a", 3), *chain("b", 6, start=3)],
]


def _tags(label: str) -> dict[str, str]:
    return {"tenant_id": "acme", "scope": "tenant"} if label.startswith("b") else {}


def reference(index: PrefixIndex, query: list[str]) -> list[PrefixMatch]:
    """Each node's run over ``query``: its blocks from the first one without a hole, weighted by
    the best tier holding each (what the index answers, counted naively)."""
    weights = {Tier.DEVICE: index.weights.device, Tier.HOST: index.weights.host}
    runs: dict[str, list[int]] = {}
    ended: set[str] = set()
    for position, label in enumerate(query):
        holders = index.holders(key(label))
        for node_id in list(runs) if position else list(holders):
            if node_id in ended:
                continue
            if node_id not in holders:
                ended.add(node_id)
                continue
            runs.setdefault(node_id, []).append(weights.get(holders[node_id], index.weights.disk))
    order = {node.node_id: node.index for node in index.nodes}
    matches = [
        PrefixMatch(node_id, len(run), sum(run) / index.weights.device)
        for node_id, run in runs.items()
    ]
    return sorted(matches, key=lambda match: (match.num_blocks, order[match.node_id]))


step = st.one_of(
    st.tuples(
        st.just("store"),
        st.sampled_from(NODES),
        st.sampled_from(TIERS),
        st.lists(st.sampled_from(LABELS), min_size=1, max_size=6, unique=True),
        st.booleans(),  # parents named
    ),
    st.tuples(
        st.just("remove"), st.sampled_from(NODES), st.sampled_from(TIERS), st.sampled_from(LABELS)
    ),
    st.tuples(
        st.just("move"),
        st.sampled_from(NODES),
        st.sampled_from(LABELS),
        st.sampled_from(TIERS),
        st.sampled_from(TIERS),
    ),
    st.tuples(st.just("invalidate")),
    st.tuples(st.just("restart"), st.sampled_from(NODES)),
    st.tuples(
        st.just("reread"),
        st.sampled_from(NODES),
        st.lists(st.tuples(st.sampled_from(LABELS), st.sampled_from(TIERS)), max_size=8),
        st.booleans(),
    ),
)


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(step, max_size=25),
    max_blocks=st.sampled_from([4, 1000]),
    queries=st.lists(st.lists(st.sampled_from(LABELS), min_size=1, max_size=8), max_size=4),
)
def test_lookups_equal_the_count_along_the_keys(steps, max_blocks, queries):
    index = PrefixIndex(max_blocks=max_blocks)
    nodes = {node_id: Node(index, node_id) for node_id in NODES}
    always_parents = True
    for kind, *args in steps:
        if kind == "store":
            node_id, tier, labels, named = args
            parents = {label: TREE[label] if named else "" for label in labels}
            always_parents &= named
            nodes[node_id].send(
                BlockStored,
                blocks=[
                    stored(label, tier, parent=parents[label] or None, **_tags(label))
                    for label in labels
                ],
            )
        elif kind == "remove":
            node_id, tier, label = args
            nodes[node_id].remove(tier, label)
        elif kind == "move":
            node_id, label, from_tier, to_tier = args
            if from_tier != to_tier:
                nodes[node_id].move(label, from_tier, to_tier)
        elif kind == "invalidate":
            index.invalidate(TenantPredicate(tenant="acme"), CUTOFF_S)
        elif kind == "restart":
            nodes[args[0]].restart()
        else:
            node_id, copies, named = args
            always_parents &= named
            node = nodes[node_id]
            placements = [
                Placement(
                    key(label),
                    Tier(tier),
                    BlockTags.of(stored(label, tier, **_tags(label))),
                    parent_hash=key(TREE[label]) if named else None,
                )
                for label, tier in copies
            ]
            index.replace_node(node_id, node.epoch, node.seq, placements)
        for path in PATHS:  # every stretch of a chain: one starts wherever a parent is missing
            for start in range(len(path)):
                for stop in range(start + 1, len(path) + 1):
                    query = path[start:stop]
                    num_walks = index.num_walks
                    assert index.match(keys(*query)) == reference(index, query)
                    if always_parents and start == 0:  # a recorded chain from its first block
                        assert index.num_walks == num_walks
    for query in queries:
        assert index.match(keys(*query)) == reference(index, query)
