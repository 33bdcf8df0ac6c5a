"""Which pool blocks a command names: a wire predicate → a provenance match (and its index key).

Pure translation of ``events.schema`` predicates onto ``prefix_keys.blocks.CacheProvenance``: the
one place the node decides what a document, policy, subject, namespace or tenant command covers.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING

from events import schema
from gpu_node.pool.vocabulary import IndexKey
from prefix_keys.blocks import CacheProvenance

if TYPE_CHECKING:
    pass


def block_predicate(
    predicate: schema.Predicate, keyed_before: datetime | None, subject_key: bytes
) -> Callable[[CacheProvenance], bool]:
    """Which blocks an ``Invalidate`` names: provenance matches ``predicate`` (and was keyed before
    ``keyed_before``).

    The handler removes with ``keyed_before=None``: every matching block that
    exists when it applies the command, by the pool's order, whatever anyone's
    clock says. Only its guard against builds claimed later (an erasure's) needs a
    time: the moment of application on the clock the node's own ``created_at``
    values come from (the pool's wall clock) — never the command's cutoff, the
    coordinator's database time, which a node clock ahead of it would compare
    against to spare blocks built before the request, and one behind it to remove
    blocks built after the command was applied (docs/design.md §5, "Cutoffs").
    Subjects are compared as the keyed digest the command carries (commands never
    hold a raw subject id); the node digests its own blocks' subjects with the
    shared key, once per (tenant, subject). A subject predicate also matches every
    block of any scope whose ``creator_subject_id`` is that digest: an erasure covers
    the public and tenant blocks the subject's requests created (a shared block is
    then recomputed by its next caller).
    """
    keyed_before_s = None if keyed_before is None else keyed_before.timestamp()
    match predicate:
        case schema.DocumentPredicate(tenant=tenant, doc_id=doc_id, below_version=below):

            def matches(provenance: CacheProvenance) -> bool:
                if provenance.tenant_id != tenant:
                    return False
                for tag in provenance.documents:
                    tag_doc, _, version = tag.rpartition("@")
                    if tag_doc == doc_id and int(version) < below:
                        return True
                return False

        case schema.PolicyPredicate(tenant=tenant, auth_scope=auth_scope, below_version=below):

            def matches(provenance: CacheProvenance) -> bool:
                return provenance.tenant_id == tenant and any(
                    scope == auth_scope and version < below
                    for scope, version in provenance.auth_scopes
                )

        case schema.SubjectPredicate(tenant=tenant, subject_id=digest):
            digests: dict[str, str] = {}

            def matches(provenance: CacheProvenance) -> bool:
                if provenance.creator_subject_id == digest:
                    return True
                subject = provenance.subject_id
                if provenance.tenant_id != tenant or subject is None:
                    return False
                if subject not in digests:
                    digests[subject] = schema.subject_digest(subject_key, tenant, subject)
                return digests[subject] == digest

        case schema.NamespacePredicate(ns=namespace):

            def matches(provenance: CacheProvenance) -> bool:
                return provenance.namespace == namespace

        case schema.TenantPredicate(tenant=tenant):

            def matches(provenance: CacheProvenance) -> bool:
                return provenance.tenant_id == tenant

        case _:
            raise AssertionError(f"no block predicate for {type(predicate).__name__}")

    if keyed_before_s is None:
        return matches

    def keyed_in_time(provenance: CacheProvenance) -> bool:
        return provenance.created_at < keyed_before_s and matches(provenance)

    return keyed_in_time


def predicate_index_key(predicate: schema.Predicate) -> IndexKey | None:
    """The pool's provenance index key whose entries include every block :func:`block_predicate` can
    match.

    Only narrows the scan (:meth:`BlockPool.remove_where`); the block predicate
    still decides each candidate. A subject predicate has none (``None``: the whole
    pool): it matches the blocks the subject created in every scope, public ones
    (filed under no tenant) included, and the user blocks of records that predate
    ``creator_subject_id``; erasures are rare and the check per block is one compare.
    """
    match predicate:
        case schema.DocumentPredicate(tenant=tenant, doc_id=doc_id):
            return ("document", tenant, doc_id)
        case schema.PolicyPredicate(tenant=tenant, auth_scope=auth_scope):
            return ("policy", tenant, auth_scope)
        case schema.SubjectPredicate():
            return None
        case schema.TenantPredicate(tenant=tenant):
            return ("tenant", tenant)
        case schema.NamespacePredicate(ns=namespace):
            return ("namespace", namespace)
        case _:
            raise AssertionError(f"no index key for {type(predicate).__name__}")


# --------------------------------------------------------------------------- snapshots
