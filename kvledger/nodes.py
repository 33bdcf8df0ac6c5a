"""``kvledger nodes key|enroll|revoke``: a node's own key and the coordinator's enrollment registry.

``kvledger nodes key --data-dir D`` prints the public key (PEM, on stdout) of the node
whose data dir is ``D`` — creating ``D/node_key.pem`` (mode 0600) as the node would at
its first start — and its key id (on stderr). ``kvledger nodes enroll --node-id N
--public-key FILE`` enrolls that public key for node ``N``; ``kvledger nodes revoke
--node-id N [--key-id K]`` revokes one key (or all of the node's). The database is
``--database-url``, else ``KVLEDGER_DATABASE_URL``, else the dev stack's
``.kvledger/stack.json``. A separate group from ``kvledger node``, which serves a node.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from gpu_node.keys.node_identity import NODE_KEY_FILE
from identity.signing import load_public_key_file
from kvledger.own_key import print_public_key
from kvledger.publish import stack_setting

DATABASE_URL_ENV = "KVLEDGER_DATABASE_URL"


def _database_url(args: argparse.Namespace) -> str:
    url = args.database_url or os.environ.get(DATABASE_URL_ENV) or stack_setting("database_url")
    if not url:
        raise ValueError(
            f"no database: pass --database-url, set {DATABASE_URL_ENV}, or run `kvledger up` here"
        )
    return url


async def enroll_node_key(database_url: str, node_id: str, public_key: Ed25519PublicKey) -> str:
    """Enroll ``public_key`` for ``node_id`` in the registry at ``database_url``; returns its key
    id."""
    from coordinator.keys.node_keys import enroll
    from coordinator.ledger.db import Database
    from coordinator.settings import DatabaseSettings

    database = Database(DatabaseSettings(url=database_url), pre_ping=False)
    try:
        async with database.session() as session, session.begin():
            return (await enroll(session, node_id, public_key)).key_id
    finally:
        await database.dispose()


async def revoke_node_keys(database_url: str, node_id: str, kid: str | None) -> list[str]:
    """Revoke ``node_id``'s key ``kid`` (all of its keys when None); returns the key ids revoked."""
    from coordinator.keys.node_keys import revoke
    from coordinator.ledger.db import Database
    from coordinator.settings import DatabaseSettings

    database = Database(DatabaseSettings(url=database_url), pre_ping=False)
    try:
        async with database.session() as session, session.begin():
            return await revoke(session, node_id, kid)
    finally:
        await database.dispose()


def key_cli(args: argparse.Namespace) -> int:
    return print_public_key(
        Path(args.key_file) if args.key_file else Path(args.data_dir) / NODE_KEY_FILE, "nodes key"
    )


def enroll_cli(args: argparse.Namespace) -> int:
    try:
        public_key = load_public_key_file(Path(args.public_key))
        kid = asyncio.run(enroll_node_key(_database_url(args), args.node_id, public_key))
    except (OSError, ValueError) as error:
        print(f"kvledger nodes enroll: error: {error}", file=sys.stderr)
        return 2
    print(f"enrolled key {kid} for node {args.node_id}")
    return 0


def revoke_cli(args: argparse.Namespace) -> int:
    try:
        revoked = asyncio.run(revoke_node_keys(_database_url(args), args.node_id, args.key_id))
    except ValueError as error:
        print(f"kvledger nodes revoke: error: {error}", file=sys.stderr)
        return 2
    if not revoked:
        print(f"kvledger nodes revoke: node {args.node_id} has no such live key", file=sys.stderr)
        return 1
    for kid in revoked:
        print(f"revoked key {kid} of node {args.node_id}")
    return 0
