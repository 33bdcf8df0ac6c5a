"""VersionRegistry and the Invalidate → block predicate mapping: exact matches and non-matches."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from events import schema
from gpu_node.governance.predicates import block_predicate
from prefix_keys.blocks import (
    TENANT_WIDE_AUTH_SCOPE,
    CacheProvenance,
    CacheScope,
    DocumentRef,
    Principal,
)
from prefix_keys.prompt import ChatMessage
from prefix_keys.versions import Staleness, VersionRegistry

KEY = b"unit-test-subject-key-0123456789"
CUTOFF = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
BEFORE = (CUTOFF - timedelta(seconds=1)).timestamp()
AFTER = (CUTOFF + timedelta(seconds=1)).timestamp()


def provenance(
    *,
    tenant: str | None = "acme",
    scope: CacheScope = CacheScope.TENANT,
    auth_scopes=(("hr", 1),),
    subject: str | None = None,
    documents=("handbook@3",),
    namespace: str = "ns-a",
    created_at: float = BEFORE,
) -> CacheProvenance:
    return CacheProvenance(
        namespace, tenant, scope, tuple(auth_scopes), subject, tuple(documents), created_at
    )


_decisions = iter(CUTOFF + timedelta(seconds=n) for n in range(10**6))


def next_decision() -> datetime:
    """A decision time after every earlier one: commands applied in decision order."""
    return next(_decisions)


def matches(predicate, block: CacheProvenance, cutoff: datetime = CUTOFF) -> bool:
    return block_predicate(predicate, cutoff, KEY)(block)


# --------------------------------------------------------------------------- predicates


def test_document_predicate_matches_older_versions_of_that_document_in_that_tenant_only():
    predicate = schema.DocumentPredicate(tenant="acme", doc_id="handbook", below_version=4)
    assert matches(predicate, provenance(documents=("handbook@3",)))
    assert matches(predicate, provenance(documents=("intro@9", "handbook@0")))
    assert not matches(predicate, provenance(documents=("handbook@4",)))  # current version survives
    assert not matches(predicate, provenance(documents=("handbook@5",)))
    assert not matches(
        predicate, provenance(documents=("handbook2@1",))
    )  # no prefix matching on ids
    assert not matches(predicate, provenance(documents=("x-handbook@1",)))
    assert not matches(predicate, provenance(tenant="globex", documents=("handbook@3",)))
    assert not matches(
        predicate, provenance(tenant=None, scope=CacheScope.PUBLIC, auth_scopes=(), documents=())
    )


def test_document_ids_may_contain_at_signs():
    predicate = schema.DocumentPredicate(tenant="acme", doc_id="mail@acme.com", below_version=2)
    assert matches(predicate, provenance(documents=("mail@acme.com@1",)))
    assert not matches(predicate, provenance(documents=("mail@acme.com@2",)))


def test_deleted_document_matches_every_version():
    predicate = schema.DocumentPredicate(
        tenant="acme", doc_id="handbook", below_version=schema.ANY_VERSION
    )
    assert matches(predicate, provenance(documents=("handbook@123456789",)))


def test_policy_predicate_matches_blocks_built_under_an_older_policy_version_of_that_scope():
    predicate = schema.PolicyPredicate(tenant="acme", auth_scope="hr", below_version=2)
    assert matches(predicate, provenance(auth_scopes=(("hr", 1),)))
    assert matches(predicate, provenance(auth_scopes=(("finance", 7), ("hr", 0))))
    assert not matches(predicate, provenance(auth_scopes=(("hr", 2),)))
    assert not matches(predicate, provenance(auth_scopes=(("finance", 1),)))
    assert not matches(predicate, provenance(tenant="globex", auth_scopes=(("hr", 1),)))
    tenant_wide = schema.PolicyPredicate(
        tenant="acme", auth_scope=TENANT_WIDE_AUTH_SCOPE, below_version=3
    )
    assert matches(
        tenant_wide, provenance(auth_scopes=((TENANT_WIDE_AUTH_SCOPE, 2),), documents=())
    )
    assert not matches(tenant_wide, provenance(auth_scopes=(("hr", 2),)))


def test_subject_predicate_compares_keyed_digests_within_the_tenant():
    digest = schema.subject_digest(KEY, "acme", "alice")
    predicate = schema.SubjectPredicate(tenant="acme", subject_id=digest)
    alice = provenance(scope=CacheScope.USER, subject="alice")
    assert matches(predicate, alice)
    assert not matches(predicate, provenance(scope=CacheScope.USER, subject="bob"))
    assert not matches(
        predicate, provenance(tenant="globex", scope=CacheScope.USER, subject="alice")
    )
    assert not matches(predicate, provenance())  # tenant block: no subject
    other_key = schema.SubjectPredicate(
        tenant="acme", subject_id=schema.subject_digest(b"another-key-0123456789", "acme", "alice")
    )
    assert not matches(other_key, alice)


def test_namespace_and_tenant_predicates():
    assert matches(
        schema.NamespacePredicate(ns="ns-a"),
        provenance(tenant=None, scope=CacheScope.PUBLIC, auth_scopes=(), documents=()),
    )
    assert not matches(schema.NamespacePredicate(ns="ns-b"), provenance())
    assert matches(
        schema.TenantPredicate(tenant="acme"), provenance(scope=CacheScope.USER, subject="alice")
    )
    assert not matches(schema.TenantPredicate(tenant="acme"), provenance(tenant="globex"))
    assert not matches(
        schema.TenantPredicate(tenant="acme"),
        provenance(tenant=None, scope=CacheScope.PUBLIC, auth_scopes=(), documents=()),
    )


@pytest.mark.parametrize(
    "predicate",
    [
        schema.DocumentPredicate(tenant="acme", doc_id="handbook", below_version=4),
        schema.PolicyPredicate(tenant="acme", auth_scope="hr", below_version=2),
        schema.NamespacePredicate(ns="ns-a"),
        schema.TenantPredicate(tenant="acme"),
    ],
)
def test_blocks_created_at_or_after_the_cutoff_survive(predicate):
    assert matches(predicate, provenance(created_at=BEFORE))
    assert not matches(predicate, provenance(created_at=CUTOFF.timestamp()))
    assert not matches(predicate, provenance(created_at=AFTER))


# --------------------------------------------------------------------------- registry


ALICE = Principal(
    "acme", "alice", frozenset({"hr", "finance"}), {"hr": 2}, default_policy_version=1
)


def doc(doc_id: str, version: int, auth_scope: str = "hr") -> ChatMessage:
    return ChatMessage("user", "text", CacheScope.TENANT, DocumentRef(doc_id, version, auth_scope))


def test_registry_tracks_the_latest_decision_not_the_maximum():
    registry = VersionRegistry()
    assert registry.document_version("acme", "handbook") is None
    registry.apply(
        schema.DocumentPredicate(tenant="acme", doc_id="handbook", below_version=5), next_decision()
    )
    registry.apply(
        schema.DocumentPredicate(tenant="acme", doc_id="handbook", below_version=3), next_decision()
    )
    assert registry.document_version("acme", "handbook") == 3
    assert registry.document_version("globex", "handbook") is None
    registry.apply(
        schema.PolicyPredicate(tenant="acme", auth_scope="hr", below_version=2), next_decision()
    )
    assert registry.policy_version("acme", "hr") == 2
    assert registry.policy_version("acme", "finance") is None
    registry.apply(schema.SubjectPredicate(tenant="acme", subject_id="ab" * 32), next_decision())
    registry.apply(schema.TenantPredicate(tenant="acme"), next_decision())
    assert not registry.is_retired("ns-a")
    registry.apply(schema.NamespacePredicate(ns="ns-a"), next_decision())
    assert registry.is_retired("ns-a") and not registry.is_retired("ns-b")


def test_an_older_decision_arriving_later_never_moves_the_registry_back():
    """A re-sent command (or the governance state) can arrive after a newer decision about the same
    document."""
    registry = VersionRegistry()
    handbook = schema.DocumentPredicate(tenant="acme", doc_id="handbook", below_version=4)
    registry.apply(
        schema.DocumentPredicate(tenant="acme", doc_id="handbook", below_version=5),
        CUTOFF + timedelta(seconds=2),
    )
    registry.apply(handbook, CUTOFF + timedelta(seconds=1))
    assert registry.document_version("acme", "handbook") == 5
    registry.apply(
        schema.PolicyPredicate(tenant="acme", auth_scope="hr", below_version=3),
        CUTOFF + timedelta(seconds=2),
    )
    registry.apply(schema.PolicyPredicate(tenant="acme", auth_scope="hr", below_version=2), CUTOFF)
    assert registry.policy_version("acme", "hr") == 3
    deleted = schema.DocumentPredicate(
        tenant="acme", doc_id="handbook", below_version=schema.ANY_VERSION
    )
    registry.apply(deleted, CUTOFF + timedelta(seconds=3))
    registry.apply(
        handbook, CUTOFF + timedelta(seconds=4)
    )  # re-created after the deletion: a newer decision
    assert registry.document_version("acme", "handbook") == 4


def test_a_resent_command_does_not_move_versions_back():
    """The coordinator re-sends v6 (its own cutoff) to a node that applied v6 then v7 but whose v6 ack was not in yet
    (found by the soak: v6 tokens were served again)."""
    registry = VersionRegistry()
    for decided_at, version in ((CUTOFF, 6), (CUTOFF + timedelta(seconds=1), 7), (CUTOFF, 6)):
        registry.apply(
            schema.PolicyPredicate(tenant="acme", auth_scope="hr", below_version=version),
            decided_at,
        )
        registry.apply(
            schema.DocumentPredicate(tenant="acme", doc_id="handbook", below_version=version),
            decided_at,
        )
    assert (
        registry.policy_version("acme", "hr"),
        registry.document_version("acme", "handbook"),
    ) == (7, 7)


def test_check_refuses_superseded_documents_of_the_callers_tenant_only():
    registry = VersionRegistry()
    registry.apply(
        schema.DocumentPredicate(tenant="acme", doc_id="handbook", below_version=4), next_decision()
    )
    registry.apply(
        schema.DocumentPredicate(tenant="globex", doc_id="memo", below_version=9), next_decision()
    )
    system = ChatMessage("system", "s", CacheScope.PUBLIC)
    assert registry.check(ALICE, [system, doc("handbook", 3)]) == Staleness(
        "document", 1, "handbook", 3, 4
    )
    assert registry.check(ALICE, [system, doc("handbook", 4)]) is None
    assert (
        registry.check(ALICE, [doc("handbook", 5)]) is None
    )  # newer than known: the command is on its way
    assert (
        registry.check(ALICE, [doc("memo", 1)]) is None
    )  # another tenant's document of the same id


def test_deleted_document_is_stale_at_every_version():
    registry = VersionRegistry()
    registry.apply(
        schema.DocumentPredicate(
            tenant="acme", doc_id="handbook", below_version=schema.ANY_VERSION
        ),
        next_decision(),
    )
    assert registry.check(ALICE, [doc("handbook", 10**9)]).kind == "document"


def test_check_refuses_tokens_under_superseded_policy_versions_before_looking_at_documents():
    registry = VersionRegistry()
    registry.apply(
        schema.DocumentPredicate(tenant="acme", doc_id="handbook", below_version=4), next_decision()
    )
    registry.apply(
        schema.PolicyPredicate(tenant="acme", auth_scope="finance", below_version=2),
        next_decision(),
    )
    # finance comes from the default pv (1) < 2; reported even though message 0 names a stale
    # document
    assert registry.check(ALICE, [doc("handbook", 3), doc("ledger", 1, "finance")]) == Staleness(
        "policy", 1, "finance", 1, 2
    )
    assert registry.check(ALICE, [doc("handbook", 4)]) is None  # hr pv 2 is untouched
    registry.apply(
        schema.PolicyPredicate(tenant="acme", auth_scope="hr", below_version=2), next_decision()
    )
    assert registry.check(ALICE, [doc("handbook", 4)]) is None  # pv 2 == current
    registry.apply(
        schema.PolicyPredicate(tenant="acme", auth_scope="hr", below_version=3), next_decision()
    )
    assert registry.check(ALICE, [doc("handbook", 4)]) == Staleness("policy", 0, "hr", 2, 3)


def test_tenant_wide_messages_use_the_tenant_wide_policy_version():
    registry = VersionRegistry()
    registry.apply(
        schema.PolicyPredicate(tenant="acme", auth_scope=TENANT_WIDE_AUTH_SCOPE, below_version=2),
        next_decision(),
    )
    tenant_note = ChatMessage("user", "note", CacheScope.TENANT)
    user_note = ChatMessage("user", "mine", CacheScope.USER)
    assert registry.check(ALICE, [tenant_note]) == Staleness(
        "policy", 0, TENANT_WIDE_AUTH_SCOPE, 1, 2
    )
    assert registry.check(ALICE, [user_note, ChatMessage("system", "s", CacheScope.PUBLIC)]) is None
    fresh = Principal("acme", "alice", frozenset({"hr"}), {TENANT_WIDE_AUTH_SCOPE: 2})
    assert registry.check(fresh, [tenant_note]) is None
    other_tenant = Principal("globex", "bob", frozenset(), {}, default_policy_version=0)
    assert registry.check(other_tenant, [tenant_note]) is None
