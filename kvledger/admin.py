"""Operator commands that call the coordinator API: ``kvledger namespace retire NS``.

The coordinator URL comes from ``--coordinator-url`` or the ``coordinator_url`` of
the stack file; the token from ``--token`` or, when absent, a short-lived
``platform-admin`` token signed with the stack's operator key (``kvledger up``
creates it). End users' secrets never sign operator tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from urllib.parse import quote

import httpx

from identity.roles import PLATFORM_ADMIN
from identity.tokens import issue_token
from kvledger.tokens import load_stack, operator_key_pem

TOKEN_TTL_S = 300


def retire_namespace_cli(args: argparse.Namespace) -> int:
    """Start retiring a namespace; prints the namespace record (status ``draining`` or ``retired``)."""
    try:
        stack = load_stack(args.stack)
        url = args.coordinator_url or stack.get("coordinator_url")
        if not url:
            raise ValueError("pass --coordinator-url or run `kvledger up` in this directory")
        token = args.token or issue_token(
            tenant="platform", sub="kvledger-cli", roles=[PLATFORM_ADMIN], ttl_s=TOKEN_TTL_S, private_key_pem=operator_key_pem(stack)
        )
    except (OSError, ValueError) as exc:
        print(f"kvledger namespace retire: error: {exc}", file=sys.stderr)
        return 2
    try:
        response = httpx.post(
            f"{url.rstrip('/')}/v1/namespaces/{quote(args.namespace, safe='')}/retire",
            headers={"Authorization": f"Bearer {token}"},
            timeout=30.0,
        )
    except httpx.HTTPError as exc:
        print(f"kvledger namespace retire: error: cannot reach {url}: {type(exc).__name__}", file=sys.stderr)
        return 1
    if response.is_success:
        print(json.dumps(response.json(), indent=2))
        return 0
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:500]
    print(f"kvledger namespace retire: error: HTTP {response.status_code}: {message}", file=sys.stderr)
    return 1
