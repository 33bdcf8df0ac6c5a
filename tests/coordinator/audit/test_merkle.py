"""RFC 6962 Merkle tree: published vectors, a from-the-definition reference, and tamper rejection.

The reference below is written straight from RFC 6962 §2.1 over slices of raw leaf
data, independently of ``coordinator.audit.merkle``'s index arithmetic, so the two can
only agree if both follow the RFC.
"""

from __future__ import annotations

import hashlib

import pytest

from coordinator.audit.merkle import (
    EMPTY_ROOT,
    consistency_proof,
    inclusion_proof,
    leaf_hash,
    node_hash,
    root_hash,
    verify_consistency,
    verify_inclusion,
)

# Certificate Transparency's reference leaves and roots for sizes 1..8 (merkle_tree_test).
CT_LEAVES = [
    bytes.fromhex(h)
    for h in (
        "",
        "00",
        "10",
        "2021",
        "3031",
        "40414243",
        "5051525354555657",
        "606162636465666768696a6b6c6d6e6f",
    )
]
CT_ROOTS = [
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
]
CT_INCLUSION = [
    (
        0,
        8,
        [
            "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
        ],
    ),
    (
        5,
        8,
        [
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
        ],
    ),
]
CT_CONSISTENCY = [
    (
        2,
        8,
        [
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
        ],
    ),
    (
        6,
        8,
        [
            "0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
        ],
    ),
]

MAX = 9
DATA = [f"receipt-{i}".encode() for i in range(MAX)]
HASHES = [leaf_hash(d) for d in DATA]


# --- the reference: RFC 6962 §2.1 transcribed over lists of raw data ------------------------


def _sha(b: bytes) -> bytes:
    return hashlib.sha256(b).digest()


def _k(n: int) -> int:
    k = 1
    while k * 2 < n:
        k *= 2
    return k


def ref_mth(d: list[bytes]) -> bytes:
    if not d:
        return _sha(b"")
    if len(d) == 1:
        return _sha(b"\x00" + d[0])
    k = _k(len(d))
    return _sha(b"\x01" + ref_mth(d[:k]) + ref_mth(d[k:]))


def ref_path(m: int, d: list[bytes]) -> list[bytes]:
    if len(d) == 1:
        return []
    k = _k(len(d))
    if m < k:
        return ref_path(m, d[:k]) + [ref_mth(d[k:])]
    return ref_path(m - k, d[k:]) + [ref_mth(d[:k])]


def ref_subproof(m: int, d: list[bytes], b: bool) -> list[bytes]:
    if m == len(d):
        return [] if b else [ref_mth(d)]
    k = _k(len(d))
    if m <= k:
        return ref_subproof(m, d[:k], b) + [ref_mth(d[k:])]
    return ref_subproof(m - k, d[k:], False) + [ref_mth(d[:k])]


def flips(value: bytes):
    """Every single-bit variant of ``value``."""
    for i in range(len(value) * 8):
        mutated = bytearray(value)
        mutated[i // 8] ^= 1 << (i % 8)
        yield bytes(mutated)


# --- published vectors -------------------------------------------------------------------


def test_ct_reference_roots():
    hashes = [leaf_hash(d) for d in CT_LEAVES]
    assert (
        root_hash(0, hashes)
        == EMPTY_ROOT
        == bytes.fromhex("e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855")
    )
    for n in range(1, 9):
        assert root_hash(n, hashes).hex() == CT_ROOTS[n - 1]


@pytest.mark.parametrize("index, size, expected", CT_INCLUSION)
def test_ct_inclusion_vectors(index, size, expected):
    hashes = [leaf_hash(d) for d in CT_LEAVES]
    proof = inclusion_proof(index, size, hashes)
    assert [p.hex() for p in proof] == expected
    assert verify_inclusion(hashes[index], index, size, proof, bytes.fromhex(CT_ROOTS[size - 1]))


@pytest.mark.parametrize("old, new, expected", CT_CONSISTENCY)
def test_ct_consistency_vectors(old, new, expected):
    hashes = [leaf_hash(d) for d in CT_LEAVES]
    proof = consistency_proof(old, new, hashes)
    assert [p.hex() for p in proof] == expected
    assert verify_consistency(
        old, new, bytes.fromhex(CT_ROOTS[old - 1]), bytes.fromhex(CT_ROOTS[new - 1]), proof
    )


# --- every tree up to 9 leaves against the reference -----------------------------------------


def test_hash_prefixes():
    assert leaf_hash(b"x") == _sha(b"\x00x")
    assert node_hash(b"a" * 32, b"b" * 32) == _sha(b"\x01" + b"a" * 32 + b"b" * 32)


@pytest.mark.parametrize("n", range(1, MAX + 1))
def test_root_matches_definition(n):
    assert root_hash(n, HASHES) == ref_mth(DATA[:n])
    # The callable form of the leaf source gives the same tree as the sequence form.
    assert root_hash(n, HASHES.__getitem__) == ref_mth(DATA[:n])


@pytest.mark.parametrize("n", range(1, MAX + 1))
def test_every_inclusion_proof(n):
    root = ref_mth(DATA[:n])
    for m in range(n):
        proof = inclusion_proof(m, n, HASHES)
        assert proof == ref_path(m, DATA[:n])
        assert verify_inclusion(HASHES[m], m, n, proof, root)


@pytest.mark.parametrize("n", range(1, MAX + 1))
def test_every_consistency_proof(n):
    new_root = ref_mth(DATA[:n])
    for m in range(1, n + 1):
        proof = consistency_proof(m, n, HASHES)
        assert proof == ref_subproof(m, DATA[:n], True)
        assert verify_consistency(m, n, ref_mth(DATA[:m]), new_root, proof)


# --- any single-bit change fails -------------------------------------------------------------

SIZE_BITS = range(6)  # enough to move any index or size ≤ 9 to every neighbour value, and beyond


def same_left_subtree(covered: int, n: int, other: int) -> bool:
    """Whether a proof about the first ``covered`` leaves of an ``n``-tree also fits an ``other``-tree.

    An RFC 6962 root does not commit to the tree size: when the leaves a proof is
    about lie inside the left complete subtree, and ``other`` splits at the same
    power of two, the right subtree is one opaque hash in both shapes, so the same
    proof and root verify for both sizes. That is why the size is bound to the root
    by the *signed* tree head (tested in test_receipts), never by the proof alone.
    """
    if n < 2 or other < 2 or other == n:
        return False
    split = 1 << ((n - 1).bit_length() - 1)
    return covered <= split and split == 1 << ((other - 1).bit_length() - 1)


@pytest.mark.parametrize("n", range(1, MAX + 1))
def test_inclusion_rejects_every_bit_flip(n):
    root = root_hash(n, HASHES)
    for m in range(n):
        proof = inclusion_proof(m, n, HASHES)
        assert not any(verify_inclusion(bad, m, n, proof, root) for bad in flips(HASHES[m]))
        assert not any(verify_inclusion(HASHES[m], m, n, proof, bad) for bad in flips(root))
        for i, element in enumerate(proof):
            for bad in flips(element):
                assert not verify_inclusion(
                    HASHES[m], m, n, proof[:i] + [bad] + proof[i + 1 :], root
                )
        for bit in SIZE_BITS:
            assert not verify_inclusion(HASHES[m], m ^ (1 << bit), n, proof, root), (m, n, bit)
            other = n ^ (1 << bit)
            assert verify_inclusion(HASHES[m], m, other, proof, root) == same_left_subtree(
                m + 1, n, other
            ), (m, n, other)


@pytest.mark.parametrize("n", range(1, MAX + 1))
def test_consistency_rejects_every_bit_flip(n):
    new_root = root_hash(n, HASHES)
    for m in range(1, n + 1):
        old_root = root_hash(m, HASHES)
        proof = consistency_proof(m, n, HASHES)
        assert not any(verify_consistency(m, n, bad, new_root, proof) for bad in flips(old_root))
        assert not any(verify_consistency(m, n, old_root, bad, proof) for bad in flips(new_root))
        for i, element in enumerate(proof):
            for bad in flips(element):
                assert not verify_consistency(
                    m, n, old_root, new_root, proof[:i] + [bad] + proof[i + 1 :]
                )
        for bit in SIZE_BITS:
            assert not verify_consistency(m ^ (1 << bit), n, old_root, new_root, proof), (m, n, bit)
            other = n ^ (1 << bit)
            assert verify_consistency(m, other, old_root, new_root, proof) == same_left_subtree(
                m, n, other
            ), (m, n, other)


def test_rewritten_leaf_breaks_consistency_with_old_head():
    old_root = root_hash(5, HASHES)
    rewritten = list(HASHES)
    rewritten[2] = leaf_hash(b"rewritten")
    proof = consistency_proof(5, 9, rewritten)
    assert not verify_consistency(5, 9, old_root, root_hash(9, rewritten), proof)


def test_truncated_or_extended_proofs_fail():
    root = root_hash(7, HASHES)
    proof = inclusion_proof(3, 7, HASHES)
    assert not verify_inclusion(HASHES[3], 3, 7, proof[:-1], root)
    assert not verify_inclusion(HASHES[3], 3, 7, proof + [b"\xab" * 32], root)
    cproof = consistency_proof(3, 7, HASHES)
    old = root_hash(3, HASHES)
    assert not verify_consistency(3, 7, old, root, cproof[:-1])
    assert not verify_consistency(3, 7, old, root, cproof + [b"\xcd" * 32])
    assert not verify_consistency(3, 7, old, root, [])


def test_degenerate_consistency_cases():
    four, five = root_hash(4, HASHES), root_hash(5, HASHES)
    assert verify_consistency(4, 4, four, four, [])
    assert not verify_consistency(4, 4, four, five, [])
    assert not verify_consistency(4, 4, four, four, [four])
    assert verify_consistency(0, 5, EMPTY_ROOT, five, [])
    assert not verify_consistency(0, 5, four, five, [])
    assert not verify_consistency(5, 4, five, four, consistency_proof(4, 5, HASHES))
    assert consistency_proof(0, 5, HASHES) == [] == consistency_proof(5, 5, HASHES)


@pytest.mark.parametrize(
    "args",
    [
        (b"\x00" * 31, 0, 2, [HASHES[1]], b"\x00" * 32),  # short leaf
        (HASHES[0], 0, 2, [b"\x00" * 31], b"\x00" * 32),  # short proof element
        (HASHES[0], 0, 2, "not a list", b"\x00" * 32),
        (HASHES[0], -1, 2, [HASHES[1]], b"\x00" * 32),
        (HASHES[0], True, 2, [HASHES[1]], b"\x00" * 32),
        (HASHES[0], 0, "2", [HASHES[1]], b"\x00" * 32),
        (None, 0, 2, [HASHES[1]], None),
    ],
)
def test_verifiers_return_false_for_malformed_input(args):
    assert verify_inclusion(*args) is False
    leaf, _, _, proof, root = args
    assert verify_consistency(1, 2, leaf, root, proof) is False


def test_generators_reject_impossible_requests():
    with pytest.raises(ValueError):
        inclusion_proof(3, 3, HASHES)
    with pytest.raises(ValueError):
        inclusion_proof(-1, 3, HASHES)
    with pytest.raises(ValueError):
        consistency_proof(4, 3, HASHES)
    with pytest.raises(ValueError):
        root_hash(2, [b"short", HASHES[1]])
    with pytest.raises(ValueError):
        root_hash(True, HASHES)
