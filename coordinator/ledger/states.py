"""The ledger's state vocabularies: one enum per concept, shared by code, the database and the API.

The values are what the ``CHECK`` constraints in ``coordinator.ledger.models`` allow and what the
JSON API shows, so they never change spelling: a new value needs a migration that widens
the constraint. Members are ``str``s, so rows read back as plain strings compare equal to them.
"""

from __future__ import annotations

from enum import StrEnum


class PlacementState(StrEnum):
    """Whether a copy of a block (or a node's snapshot) still exists."""

    LIVE = "live"
    DELETED = "deleted"


class InvalidationStatus(StrEnum):
    """Progress of one ``Invalidate`` command across its target nodes."""

    PENDING = "pending"
    COMPLETE = "complete"
    FAILED = "failed"
    """Some node acked with a post-check that did not verify; a later verified ack can still complete it."""


class TargetStatus(StrEnum):
    """What one expected node reported for one command."""

    PENDING = "pending"
    ACKED = "acked"
    FAILED = "failed"


class ErasureStatus(StrEnum):
    """Progress of one privacy erasure.

    ``PARTIAL``: some expected node acked, not all; ``FAILED``: a node reported a post-check that
    did not verify (a later verified ack can still lead to ``VERIFIED``); ``VERIFIED`` is final and
    has exactly one receipt."""

    PENDING = "pending"
    PARTIAL = "partial"
    VERIFIED = "verified"
    FAILED = "failed"


class NamespaceStatus(StrEnum):
    """Lifecycle of a cache namespace: served, being drained by its namespace-wide invalidation,
    gone."""

    ACTIVE = "active"
    DRAINING = "draining"
    RETIRED = "retired"


class NodeStatus(StrEnum):
    """Whether the ledger's view of a node is complete."""

    ACTIVE = "active"
    RECONCILING = "reconciling"
    """The coordinator missed some of the node's events and waits for its ``Inventory``."""
