"""``kvledger producers key|enroll|list|revoke``: customer-event producer keys (docs/security.md,
"Signed customer events").

* ``key --key-file F`` prints the public key (PEM, stdout) of the producer key in ``F``, creating
  it (mode 0600) first if missing, and its key id (stderr) — what ``kvledger publish
  --producer-key F`` signs with.
* ``enroll --public-key FILE --name N (--tenant T ... | --all-tenants)`` enrolls it at the
  coordinator (``POST /v1/producer-keys``): with one ``--tenant`` as that tenant's tenant-admin,
  otherwise (several tenants, or all) as platform-admin.
* ``list [--tenant T]`` and ``revoke KEY_ID [--tenant T]``: as T's tenant-admin with ``--tenant``,
  else as platform-admin.

Tokens and URL: :mod:`kvledger.api`; ``--token`` replaces the minted token (its roles decide).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from identity.roles import PLATFORM_ADMIN, TENANT_ADMIN
from identity.signing import load_public_key_file, public_key_pem
from kvledger.api import Coordinator
from kvledger.own_key import print_public_key

DIRECT_ENROLLMENT = "database"
"""``enrolled_by`` of a key enrolled straight into the database (``kvledger up``, benchmarks), not
through the API."""
PLATFORM_TENANT = "platform"
"""The ``tenant`` claim of the platform-admin tokens these commands mint (a platform-admin acts on
every tenant)."""


async def enroll_producer_key(
    database_url: str, public_key: Ed25519PublicKey, tenants: list[str] | None, name: str
) -> str:
    """Enroll ``public_key`` for ``tenants`` (None: all) straight into the registry at
    ``database_url``; its key id.

    For ``kvledger up`` and the benchmarks, which own their database; operators use the API
    (``enroll``)."""
    from coordinator.keys.producer_keys import enroll
    from coordinator.ledger.db import Database
    from coordinator.settings import DatabaseSettings

    database = Database(DatabaseSettings(url=database_url), pre_ping=False)
    try:
        async with database.session() as session, session.begin():
            return (
                await enroll(session, public_key, tenants, name=name, enrolled_by=DIRECT_ENROLLMENT)
            ).key_id
    finally:
        await database.dispose()


def _coordinator(args: argparse.Namespace, tenant: str | None) -> Coordinator:
    """As ``tenant``'s tenant-admin, or as platform-admin when no single tenant is named."""
    if tenant is None:
        return Coordinator(args, role=PLATFORM_ADMIN, tenant=PLATFORM_TENANT)
    return Coordinator(args, role=TENANT_ADMIN, tenant=tenant)


def key_cli(args: argparse.Namespace) -> int:
    return print_public_key(Path(args.key_file), "producers key")


def enroll_cli(args: argparse.Namespace) -> int:
    if bool(args.tenant) == args.all_tenants:
        print(
            "kvledger producers enroll: error: give --tenant (repeatable) or --all-tenants",
            file=sys.stderr,
        )
        return 2
    try:
        public_key = load_public_key_file(Path(args.public_key))
    except (OSError, ValueError) as error:
        print(f"kvledger producers enroll: error: {error}", file=sys.stderr)
        return 2
    body: dict = {"public_key_pem": public_key_pem(public_key).decode(), "name": args.name}
    if args.all_tenants:
        body["all_tenants"] = True
    else:
        body["tenants"] = args.tenant
    single = args.tenant[0] if args.tenant and len(args.tenant) == 1 else None
    enrolled = _coordinator(args, single).json("POST", "/v1/producer-keys", json=body)
    bound = "all tenants" if enrolled["all_tenants"] else ", ".join(enrolled["tenants"])
    print(f"enrolled producer key {enrolled['key_id']} ({enrolled['name']}) for {bound}")
    return 0


def list_cli(args: argparse.Namespace) -> int:
    params = {} if args.tenant is None else {"tenant": args.tenant}
    keys = _coordinator(args, args.tenant).json("GET", "/v1/producer-keys", params=params)[
        "producer_keys"
    ]
    if args.json:
        print(json.dumps(keys, indent=2, ensure_ascii=False))
        return 0
    for key in keys:
        bound = "all tenants" if key["all_tenants"] else ",".join(key["tenants"])
        state = "live" if key["revoked_at"] is None else f"revoked {key['revoked_at']}"
        print(f"{key['key_id']}  {key['name']:<24} {bound:<32} {state}")
    return 0


def revoke_cli(args: argparse.Namespace) -> int:
    _coordinator(args, args.tenant).json("POST", f"/v1/producer-keys/{args.key_id}/revoke")
    print(f"revoked producer key {args.key_id}")
    return 0
