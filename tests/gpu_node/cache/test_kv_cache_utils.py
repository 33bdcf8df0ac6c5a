"""Block identity: exact hashes, and every component of the key changes it."""

from __future__ import annotations

import dataclasses
import hashlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.schema import MAX_LIST_ITEMS
from gpu_node.cache.kv_cache_utils import compute_shadow_hashes
from prefix_keys.blocks import (
    CacheProvenance,
    CacheScope,
    DocumentRef,
    Principal,
    Segment,
    compute_block_keys,
    hash_block,
    namespace_root,
    num_cacheable_blocks,
    pack_token_ids,
    scope_salt,
)

BLOCK = 4
ALICE = Principal("acme", "alice", frozenset({"hr"}), {"hr": 3})
HANDBOOK = DocumentRef("handbook", 7, "hr")


def layout(
    public: int = 8, tenant: int = 8, user: int = 9, document: DocumentRef | None = HANDBOOK
) -> list[Segment]:
    """public system prompt, then a tenant document, then a user message."""
    segments = [Segment(0, public, CacheScope.PUBLIC)]
    segments.append(Segment(public, public + tenant, CacheScope.TENANT, document))
    segments.append(Segment(public + tenant, public + tenant + user, CacheScope.USER))
    return segments


def tokens(n: int = 25, base: int = 100) -> list[int]:
    return list(range(base, base + n))


def keys_for(
    principal: Principal = ALICE,
    token_ids: list[int] | None = None,
    segments: list[Segment] | None = None,
    **kwargs,
):
    token_ids = tokens() if token_ids is None else token_ids
    segments = layout() if segments is None else segments
    return compute_block_keys(
        "ns-test", token_ids, segments, principal, block_size=BLOCK, now=0.0, **kwargs
    )


def hashes(keys) -> list[str]:
    return [key.hex for key in keys]


def test_exact_hash_values_are_pinned():
    keys = keys_for()
    # 25 tokens: the last token is always recomputed, so 24 // 4 = 6 blocks.
    assert len(keys) == 6
    assert [key.hex[:16] for key in keys] == [
        "ffc0c12fb518a0a9",
        "ffef3b9664139645",
        "ba1bcec44170c119",
        "e48026f61fe52a2e",
        "f065690785b0cf93",
        "5f1781571753f766",
    ]
    assert namespace_root("ns-test").hex()[:16] == "2fd4e2c62b645982"


def _u32(n: int) -> bytes:
    return struct.pack("<I", n)


def _field(data: bytes) -> bytes:
    return _u32(len(data)) + data


def test_hashes_follow_the_documented_encoding():
    """Recompute blocks 0 and 2 from docs/design.md §2 with raw hashlib, independent of the
    implementation."""
    keys = keys_for()
    root = hashlib.sha256(b"kvledger/ns/v1\x00ns-test").digest()
    no_adapter_no_docs = _field(_field(b"") + _field(b""))
    block0 = hashlib.sha256(
        root + _field(b"") + _field(struct.pack("<4I", 100, 101, 102, 103)) + no_adapter_no_docs
    )
    assert keys[0].block_hash == block0.digest()
    # Tenant salt format T2: policy versions as little-endian u64 (any version 0..2^53-1 a token may
    # carry).
    salt = b"T2" + _field(b"acme") + _u32(1) + _field(b"hr") + struct.pack("<Q", 3)
    extra = _field(_field(b"") + _field(b"handbook@7"))
    block2 = hashlib.sha256(
        keys[1].block_hash + _field(salt) + _field(struct.pack("<4I", 108, 109, 110, 111)) + extra
    )
    assert keys[2].block_hash == block2.digest()


def test_canonical_encoding_is_length_prefixed_little_endian():
    assert pack_token_ids([1, 258]) == b"\x01\x00\x00\x00\x02\x01\x00\x00"
    parent = bytes(32)
    assert hash_block(parent, b"", pack_token_ids([1, 23]), b"") != hash_block(
        parent, b"", pack_token_ids([12, 3]), b""
    )
    # moving a byte between salt and extra must change the hash
    assert hash_block(parent, b"ab", b"", b"c") != hash_block(parent, b"a", b"", b"bc")


def test_scope_is_monotone_and_provenance_accumulates():
    keys = keys_for()
    assert [key.provenance.scope for key in keys] == [CacheScope.PUBLIC] * 2 + [
        CacheScope.TENANT
    ] * 2 + [CacheScope.USER] * 2
    assert keys[0].provenance.tenant_id is None and keys[0].provenance.auth_scopes == ()
    assert keys[2].provenance.tenant_id == "acme"
    assert keys[2].provenance.auth_scopes == (("hr", 3),)
    assert keys[2].provenance.documents == ("handbook@7",)
    assert keys[2].provenance.subject_id is None
    # user blocks keep the document and auth scope they were derived from
    assert keys[5].provenance.subject_id == "alice"
    assert keys[5].provenance.documents == ("handbook@7",)
    assert keys[5].provenance.auth_scopes == (("hr", 3),)
    assert [key.token_offset for key in keys] == [0, 4, 8, 12, 16, 20]
    assert [key.parent_hash for key in keys[1:]] == [key.block_hash for key in keys[:-1]]
    assert keys[0].parent_hash == namespace_root("ns-test")


def test_block_straddling_a_boundary_takes_the_stricter_scope():
    segments = [Segment(0, 6, CacheScope.PUBLIC), Segment(6, 13, CacheScope.USER)]
    keys = keys_for(token_ids=tokens(13), segments=segments)
    assert [key.provenance.scope for key in keys] == [
        CacheScope.PUBLIC,
        CacheScope.USER,
        CacheScope.USER,
    ]


@pytest.mark.parametrize(
    "change",
    [
        "namespace",
        "token",
        "tenant",
        "auth_scope",
        "policy_version",
        "subject",
        "document_version",
        "adapter",
    ],
)
def test_every_component_changes_the_affected_keys(change):
    base = keys_for()
    kwargs: dict = {}
    principal, token_ids, segments, namespace = ALICE, tokens(), layout(), "ns-test"
    if change == "namespace":
        namespace = "ns-other"
    elif change == "token":
        token_ids = tokens()
        token_ids[1] += 1
    elif change == "tenant":
        principal = dataclasses.replace(ALICE, tenant_id="globex")
    elif change == "auth_scope":
        segments = layout(document=DocumentRef("handbook", 7, "finance"))
        principal = dataclasses.replace(ALICE, scopes=frozenset({"finance"}))
    elif change == "policy_version":
        principal = dataclasses.replace(ALICE, policy_versions={"hr": 4})
    elif change == "subject":
        principal = dataclasses.replace(ALICE, subject_id="bob")
    elif change == "document_version":
        segments = layout(document=DocumentRef("handbook", 8, "hr"))
    elif change == "adapter":
        kwargs["adapter"] = "legal-lora@sha256:1"
    other = compute_block_keys(
        namespace, token_ids, segments, principal, block_size=BLOCK, now=0.0, **kwargs
    )
    changed = [a.block_hash != b.block_hash for a, b in zip(base, other, strict=True)]
    expected = {
        # public blocks depend only on namespace, tokens and adapter
        "namespace": [True] * 6,
        "token": [True] * 6,
        "adapter": [True] * 6,
        "tenant": [False, False, True, True, True, True],
        "auth_scope": [False, False, True, True, True, True],
        "policy_version": [False, False, True, True, True, True],
        "document_version": [False, False, True, True, True, True],
        "subject": [False, False, False, False, True, True],
    }[change]
    assert changed == expected


def test_public_prefix_shared_across_tenants_tenant_part_is_not():
    bob_at_globex = Principal("globex", "bob", frozenset({"hr"}), {"hr": 3})
    a, b = keys_for(), keys_for(principal=bob_at_globex)
    assert hashes(a)[:2] == hashes(b)[:2]
    assert set(hashes(a)[2:]).isdisjoint(hashes(b)[2:])


def test_two_subjects_never_share_user_blocks_but_share_tenant_blocks():
    carol = dataclasses.replace(ALICE, subject_id="carol")
    a, c = keys_for(), keys_for(principal=carol)
    assert hashes(a)[:4] == hashes(c)[:4]
    assert set(hashes(a)[4:]).isdisjoint(hashes(c)[4:])


def test_shadow_hashes_ignore_scope_and_namespace():
    token_ids = tokens()
    shadow = compute_shadow_hashes(token_ids, 6, BLOCK)
    assert len(shadow) == 6 and len(set(shadow)) == 6
    assert compute_shadow_hashes(token_ids, 3, BLOCK) == shadow[:3]


def test_segments_must_tile_the_prompt():
    with pytest.raises(ValueError, match="contiguous"):
        keys_for(segments=[Segment(0, 4, CacheScope.PUBLIC), Segment(5, 25, CacheScope.USER)])
    with pytest.raises(ValueError, match="cover"):
        keys_for(segments=[Segment(0, 24, CacheScope.PUBLIC)])
    with pytest.raises(ValueError):
        Segment(0, 4, CacheScope.USER, HANDBOOK)


def test_last_token_is_always_recomputed():
    assert num_cacheable_blocks(16, 16) == 0
    assert num_cacheable_blocks(17, 16) == 1
    assert num_cacheable_blocks(0, 16) == 0


def test_provenance_round_trips():
    provenance = keys_for()[5].provenance
    assert CacheProvenance.from_dict(provenance.to_dict()) == provenance


def test_every_block_records_its_creator_in_every_scope_without_changing_its_hash():
    creator = "ab" * 32
    keys = keys_for(creator_subject_id=creator)
    assert {key.provenance.scope for key in keys} == set(CacheScope)
    assert all(key.provenance.creator_subject_id == creator for key in keys)
    assert hashes(keys) == hashes(keys_for()), (
        "who created a block is provenance, never part of its key"
    )
    provenance = keys[0].provenance
    assert CacheProvenance.from_dict(provenance.to_dict()) == provenance
    written_before = {k: v for k, v in provenance.to_dict().items() if k != "creator_subject_id"}
    assert CacheProvenance.from_dict(written_before).creator_subject_id is None


@pytest.mark.parametrize("what", ["documents", "auth scopes"])
def test_a_block_with_more_documents_or_auth_scopes_than_a_kv_event_carries_is_refused(what):
    """Exactly MAX_LIST_ITEMS of them is a block the ledger can record; one more is an error, never a block cut short."""

    def prompt(count: int) -> tuple[Principal, list[int], list[Segment]]:
        segments = []
        for i in range(count):
            # one document under many auth scopes, or many documents under one
            document = (
                DocumentRef("doc", 1, f"scope-{i}")
                if what == "auth scopes"
                else DocumentRef(f"doc-{i}", 1, "hr")
            )
            segments.append(Segment(i * BLOCK, (i + 1) * BLOCK, CacheScope.TENANT, document))
        segments.append(Segment(count * BLOCK, count * BLOCK + 1, CacheScope.USER))
        return Principal("acme", "alice", frozenset(), {}), tokens(count * BLOCK + 1), segments

    provenance = keys_for(*prompt(MAX_LIST_ITEMS))[-1].provenance
    assert MAX_LIST_ITEMS == len(
        provenance.documents if what == "documents" else provenance.auth_scopes
    )
    with pytest.raises(
        ValueError, match=f"{MAX_LIST_ITEMS + 1} {what}; .* at most {MAX_LIST_ITEMS}"
    ):
        keys_for(*prompt(MAX_LIST_ITEMS + 1))


def test_segment_starting_exactly_at_a_block_boundary_sets_the_scope_of_the_blocks_after_it():
    """Regression: the fast path once reused the previous segment's salt and provenance for every
    block of a segment that began on a block boundary, making tenant document blocks public."""
    segments = layout(public=4, tenant=8, user=5)
    keys = compute_block_keys("ns", tokens(17), segments, ALICE, block_size=4)
    assert [key.provenance.scope for key in keys] == [
        CacheScope.PUBLIC,
        CacheScope.TENANT,
        CacheScope.TENANT,
        CacheScope.USER,
    ]
    assert [key.provenance.documents for key in keys] == [
        (),
        (HANDBOOK.tag,),
        (HANDBOOK.tag,),
        (HANDBOOK.tag,),
    ]
    other_tenant = compute_block_keys(
        "ns", tokens(17), segments, dataclasses.replace(ALICE, tenant_id="globex"), block_size=4
    )
    assert keys[0].block_hash == other_tenant[0].block_hash
    assert keys[1].block_hash != other_tenant[1].block_hash


def reference_keys(namespace, token_ids, segments, principal, block_size):
    """docs/design.md §2 computed the slow, obvious way: per block, scan every segment of the
    prefix."""
    parent = namespace_root(namespace)
    hashes = []
    for index in range(num_cacheable_blocks(len(token_ids), block_size)):
        start, end = index * block_size, (index + 1) * block_size
        prefix = [s for s in segments if s.start < end and s.end > s.start]
        scope = max((s.scope for s in prefix), default=CacheScope.PUBLIC)
        auth = {}
        for s in prefix:
            if s.auth_scope is not None:
                auth.setdefault(s.auth_scope, principal.policy_version(s.auth_scope))
        in_block = [s.document.tag for s in prefix if s.document is not None and s.end > start]
        salt = scope_salt(scope, principal, tuple(sorted(auth.items())))
        extra = _field(_field(b"") + _field("\x00".join(in_block).encode()))
        parent = hashlib.sha256(
            parent + _field(salt) + _field(pack_token_ids(token_ids[start:end])) + extra
        ).digest()
        hashes.append(parent)
    return hashes


segment_plan = st.lists(
    st.tuples(st.integers(0, 9), st.sampled_from(["public", "tenant", "doc-a", "doc-b", "user"])),
    min_size=1,
    max_size=8,
)


@settings(max_examples=400, deadline=None)
@given(plan=segment_plan, block_size=st.sampled_from([1, 2, 4, 16]))
def test_fast_path_equals_the_reference_definition(plan, block_size):
    segments, position = [], 0
    for length, kind in plan:
        document = {"doc-a": HANDBOOK, "doc-b": DocumentRef("payroll", 2, "finance")}.get(kind)
        scope = CacheScope.TENANT if document else CacheScope.parse(kind)
        segments.append(Segment(position, position + length, scope, document))
        position += length
    token_ids = tokens(position)
    keys = compute_block_keys("ns-prop", token_ids, segments, ALICE, block_size=block_size, now=0.0)
    assert [key.block_hash for key in keys] == reference_keys(
        "ns-prop", token_ids, segments, ALICE, block_size
    )
