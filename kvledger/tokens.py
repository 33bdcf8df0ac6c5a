"""``kvledger token``: print a signed JWT for local use (dev stack, demos, curl).

Two kinds of token, from two different keys (see docs/security.md, "Identities and roles"):

* end users (no ``--role``): HS256 with ``KVLEDGER_JWT_SECRET`` or the stack's
  ``jwt_secret``, or EdDSA with ``--private-key`` for nodes that verify a public key;
* operators (``--role tenant-admin|privacy-officer|auditor|platform-admin``): EdDSA
  with the stack's operator key (``operator_private_key_file`` in ``stack.json``) or
  ``--private-key``.

Any other role is refused: no command mints node credentials from a person's key.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from identity.roles import OPERATOR_ROLES
from identity.tokens import JWT_SECRET_ENV, issue_token

STACK_FILE = Path(".kvledger") / "stack.json"


def load_stack(path: str | None) -> dict[str, Any]:
    """The dev stack's ``stack.json``: ``path`` (the file or its directory) or
    ``.kvledger/stack.json``; {} if absent.

    ValueError if a given path has none, or the file is unreadable.
    """
    stack_file = STACK_FILE if path is None else Path(path)
    if stack_file.is_dir():
        stack_file = stack_file / "stack.json"
    try:
        stack = json.loads(stack_file.read_text())
    except FileNotFoundError:
        if path is None:
            return {}
        raise ValueError(f"no stack file at {stack_file}") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {stack_file}: {exc}") from None
    if not isinstance(stack, dict):
        raise ValueError(f"{stack_file} is not a stack file")
    return stack


def operator_key_pem(stack: dict[str, Any]) -> bytes:
    """The stack's operator private key (PEM). ValueError when the stack has none."""
    key_file = stack.get("operator_private_key_file")
    if not isinstance(key_file, str) or not key_file:
        raise ValueError("no operator key: run `kvledger up` in this directory or pass --stack")
    return Path(key_file).read_bytes()


def mint(args: argparse.Namespace) -> str:
    """The token the parsed ``kvledger token`` arguments ask for. ValueError says what is wrong."""
    refused = sorted(set(args.role) - OPERATOR_ROLES)
    if refused:
        raise ValueError(
            f"role {', '.join(refused)} is not an operator role ({', '.join(sorted(OPERATOR_ROLES))}); "
            "no command mints node credentials from a user or operator key"
        )
    scopes = [scope.strip() for scope in args.scopes.split(",") if scope.strip()]
    private_key_pem = Path(args.private_key).read_bytes() if args.private_key else None
    stack = load_stack(args.stack)
    if args.role:
        return issue_token(
            tenant=args.tenant,
            sub=args.sub,
            roles=args.role,
            ttl_s=args.ttl_s,
            private_key_pem=private_key_pem or operator_key_pem(stack),
        )
    secret = None
    if private_key_pem is None:
        secret = os.environ.get(JWT_SECRET_ENV) or stack.get("jwt_secret")
        if not secret:
            raise ValueError(
                f"set {JWT_SECRET_ENV}, run `kvledger up` here, or pass --stack or --private-key"
            )
    return issue_token(
        tenant=args.tenant,
        sub=args.sub,
        scopes=scopes,
        pv=args.pv,
        ttl_s=args.ttl_s,
        secret=secret,
        private_key_pem=private_key_pem,
    )


def cli(args: argparse.Namespace) -> int:
    try:
        token = mint(args)
    except (OSError, ValueError) as exc:
        print(f"kvledger token: error: {exc}", file=sys.stderr)
        return 2
    print(token)
    return 0
