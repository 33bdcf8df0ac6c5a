"""Operator roles (see docs/security.md, "Identities and roles").

Roles are only ever read from tokens of the *operator* issuer; an end user's
token may claim any of these names and still gets none of their powers.

* ``tenant-admin``, ``privacy-officer``, ``auditor`` act inside the one tenant
  their token's ``tenant`` claim names, never on another.
* ``platform-admin`` acts on every tenant and on what belongs to no tenant
  (namespaces, nodes, node snapshots). It fetches no data keys: only enrolled
  nodes do.
* ``router`` is a fleet router's own credential (``kvledger router``): it reads the
  ledger's live placements of every node and the enrolled node keys
  (``coordinator.api.routes.router``), nothing else — no tenant's ledger, erasure or key.
"""

from __future__ import annotations

TENANT_ADMIN = "tenant-admin"
PRIVACY_OFFICER = "privacy-officer"
AUDITOR = "auditor"
PLATFORM_ADMIN = "platform-admin"
ROUTER = "router"

TENANT_OPERATOR_ROLES = frozenset({TENANT_ADMIN, PRIVACY_OFFICER, AUDITOR})
"""Roles bound to the tenant of their token."""
OPERATOR_ROLES = TENANT_OPERATOR_ROLES | {PLATFORM_ADMIN, ROUTER}

LEDGER_READERS = TENANT_OPERATOR_ROLES | {PLATFORM_ADMIN}
"""Who may read a tenant's ledger, erasures, receipts, proofs and invalidations."""
ERASURE_REQUESTERS = frozenset({PRIVACY_OFFICER, PLATFORM_ADMIN})
"""Who may order an erasure; a tenant-admin or auditor may only follow it."""
PLATFORM_ADMINS = frozenset({PLATFORM_ADMIN})
ROUTER_READERS = frozenset({ROUTER, PLATFORM_ADMIN})
"""Who may read what a fleet router is built from: every node's live placements, liveness and enrolled keys."""
PRODUCER_KEY_ADMINS = frozenset({TENANT_ADMIN, PLATFORM_ADMIN})
"""Who may enroll, list and revoke customer-event producer keys: a tenant-admin for keys bound to its own tenant
only, a platform-admin for any tenants or for all of them."""
