"""``kvledger token``: print a signed JWT for local use (dev stack, demos, curl).

Signs with the Ed25519 private key given by ``--private-key`` (for nodes that
verify EdDSA) or else with ``KVLEDGER_JWT_SECRET`` (HS256), the same secret the
node reads when its settings carry no key.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from gpu_node.auth import JWT_SECRET_ENV, issue_token


def cli(args: argparse.Namespace) -> int:
    scopes = [scope.strip() for scope in args.scopes.split(",") if scope.strip()]
    secret = os.environ.get(JWT_SECRET_ENV) or None
    if not args.private_key and secret is None:
        print(f"kvledger token: error: set {JWT_SECRET_ENV} or pass --private-key PEM", file=sys.stderr)
        return 2
    try:
        private_key_pem = Path(args.private_key).read_bytes() if args.private_key else None
        token = issue_token(
            tenant=args.tenant,
            sub=args.sub,
            scopes=scopes,
            pv=args.pv,
            roles=args.role,
            ttl_s=args.ttl_s,
            secret=None if private_key_pem is not None else secret,
            private_key_pem=private_key_pem,
        )
    except (OSError, ValueError) as exc:
        print(f"kvledger token: error: {exc}", file=sys.stderr)
        return 2
    print(token)
    return 0
