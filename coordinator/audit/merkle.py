"""RFC 6962 / RFC 9162 Merkle tree hashing, inclusion proofs and consistency proofs.

The erasure audit log is an append-only list of leaves; its tree head (size + root)
is signed and published. These functions are what lets a third party check, with
nothing but hashes, that (a) one receipt is a leaf of a published tree and (b) a
later tree extends an earlier one without rewriting any leaf. The hashing is
exactly RFC 6962 §2.1 (leaf = SHA-256(0x00 ‖ data), node = SHA-256(0x01 ‖ l ‖ r),
unbalanced trees split at the largest power of two below n) so that any CT
verifier, not only ours, can check our proofs.

Storage-agnostic on purpose: every generator takes the tree size and a *leaf
source* — either a sequence of 32-byte leaf hashes or a callable ``index → leaf
hash`` — so the log can live in a list (tests), Postgres or anything else. A
tree of size ``n`` is always the first ``n`` leaves of the source, which is how a
head of an older size is recomputed from a longer log.

Cost: proof generation recomputes the subtree roots it needs from leaf hashes,
O(n) hashes per proof. An erasure log grows by one leaf per erasure, so this is
milliseconds for realistic sizes; a store that outgrows it can cache the roots of
complete subtrees without changing these functions' results.

Generators raise ValueError for impossible requests (index out of range, bad
hash length): that is a caller bug. Verifiers never raise for bad input; they
return False, because their input comes from an untrusted document.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

HASH_SIZE = 32
LEAF_PREFIX = b"\x00"
NODE_PREFIX = b"\x01"
EMPTY_ROOT = hashlib.sha256(b"").digest()
"""MTH({}) — the root of the empty tree (RFC 6962 §2.1)."""

LeafSource = Sequence[bytes] | Callable[[int], bytes]
"""Leaf hashes by index: a sequence of them, or a function fetching one."""


def leaf_hash(data: bytes) -> bytes:
    """SHA-256(0x00 ‖ data); the prefix keeps a leaf from ever equalling an interior node."""
    return hashlib.sha256(LEAF_PREFIX + bytes(data)).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """SHA-256(0x01 ‖ left ‖ right)."""
    return hashlib.sha256(NODE_PREFIX + left + right).digest()


def _split(n: int) -> int:
    """The largest power of two strictly below ``n`` (n ≥ 2): where RFC 6962 splits a tree."""
    return 1 << ((n - 1).bit_length() - 1)


def _fetcher(leaves: LeafSource) -> Callable[[int], bytes]:
    get = leaves if callable(leaves) else leaves.__getitem__

    def fetch(index: int) -> bytes:
        value = get(index)
        if not isinstance(value, (bytes, bytearray)) or len(value) != HASH_SIZE:
            raise ValueError(f"leaf hash {index} is not {HASH_SIZE} bytes")
        return bytes(value)

    return fetch


def _subtree_root(start: int, end: int, fetch: Callable[[int], bytes]) -> bytes:
    """MTH(D[start:end]) for a non-empty range."""
    if end - start == 1:
        return fetch(start)
    middle = start + _split(end - start)
    return node_hash(_subtree_root(start, middle, fetch), _subtree_root(middle, end, fetch))


def _check_size(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


def root_hash(tree_size: int, leaves: LeafSource) -> bytes:
    """MTH of the first ``tree_size`` leaves (``EMPTY_ROOT`` for size 0)."""
    _check_size("tree_size", tree_size)
    if tree_size == 0:
        return EMPTY_ROOT
    return _subtree_root(0, tree_size, _fetcher(leaves))


def inclusion_proof(leaf_index: int, tree_size: int, leaves: LeafSource) -> list[bytes]:
    """PATH(leaf_index, D[tree_size]) of RFC 6962 §2.1.1, ordered leaf-side first."""
    _check_size("leaf_index", leaf_index)
    _check_size("tree_size", tree_size)
    if leaf_index >= tree_size:
        raise ValueError(f"leaf_index {leaf_index} is not in a tree of size {tree_size}")
    fetch = _fetcher(leaves)
    siblings: list[bytes] = []
    start, end = 0, tree_size
    while end - start > 1:
        middle = start + _split(end - start)
        if leaf_index < middle:
            siblings.append(_subtree_root(middle, end, fetch))
            end = middle
        else:
            siblings.append(_subtree_root(start, middle, fetch))
            start = middle
    siblings.reverse()
    return siblings


def consistency_proof(old_size: int, new_size: int, leaves: LeafSource) -> list[bytes]:
    """PROOF(old_size, D[new_size]) of RFC 6962 §2.1.2.

    Empty when the sizes are equal or ``old_size`` is 0: every tree trivially
    extends itself and the empty tree.
    """
    _check_size("old_size", old_size)
    _check_size("new_size", new_size)
    if old_size > new_size:
        raise ValueError(f"old_size {old_size} is larger than new_size {new_size}")
    if old_size == 0 or old_size == new_size:
        return []
    fetch = _fetcher(leaves)
    siblings: list[bytes] = []
    start, end, m = 0, new_size, old_size
    old_tree_is_whole_subtree = (
        True  # RFC 6962's flag b: the old tree is a complete left subtree so far
    )
    while m != end - start:
        k = _split(end - start)
        if m <= k:
            siblings.append(_subtree_root(start + k, end, fetch))
            end = start + k
        else:
            siblings.append(_subtree_root(start, start + k, fetch))
            start += k
            m -= k
            old_tree_is_whole_subtree = False
    proof = [] if old_tree_is_whole_subtree else [_subtree_root(start, end, fetch)]
    proof.extend(reversed(siblings))
    return proof


def _is_hash(value: object) -> bool:
    return isinstance(value, (bytes, bytearray)) and len(value) == HASH_SIZE


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def verify_inclusion(
    leaf: bytes, leaf_index: int, tree_size: int, proof: Sequence[bytes], root: bytes
) -> bool:
    """True iff ``leaf`` (a leaf *hash*) is leaf ``leaf_index`` of the tree with ``root``.

    RFC 9162 §2.1.3.2, step by step. The final ``sn == 0`` test is what rejects a
    proof of the wrong length for the claimed size and index. A root does not
    commit to its tree size — a proof about leaves in the left complete subtree
    also verifies for other sizes that split at the same power of two — so the
    size must come from a *signed* tree head, never from the proof's sender alone.
    """
    if not (_is_hash(leaf) and _is_hash(root) and _is_size(leaf_index) and _is_size(tree_size)):
        return False
    if not isinstance(proof, (list, tuple)) or not all(_is_hash(p) for p in proof):
        return False
    if leaf_index >= tree_size:
        return False
    fn, sn, r = leaf_index, tree_size - 1, bytes(leaf)
    for p in proof:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            r = node_hash(bytes(p), r)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            r = node_hash(r, bytes(p))
        fn >>= 1
        sn >>= 1
    return sn == 0 and r == bytes(root)


def verify_consistency(
    old_size: int, new_size: int, old_root: bytes, new_root: bytes, proof: Sequence[bytes]
) -> bool:
    """True iff the tree (new_size, new_root) extends (old_size, old_root) without changing a leaf.

    RFC 9162 §2.1.4.2 for 0 < old_size < new_size. Equal sizes need an empty
    proof and equal roots; old_size 0 needs an empty proof and the empty root.
    """
    if not (
        _is_size(old_size) and _is_size(new_size) and _is_hash(old_root) and _is_hash(new_root)
    ):
        return False
    if not isinstance(proof, (list, tuple)) or not all(_is_hash(p) for p in proof):
        return False
    old_root, new_root = bytes(old_root), bytes(new_root)
    if old_size > new_size:
        return False
    if old_size == new_size:
        return not proof and old_root == new_root
    if old_size == 0:
        return not proof and old_root == EMPTY_ROOT
    if not proof:
        return False
    path = [bytes(p) for p in proof]
    if old_size & (old_size - 1) == 0:
        path.insert(0, old_root)
    fn, sn = old_size - 1, new_size - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    return sn == 0 and fr == old_root and sr == new_root
