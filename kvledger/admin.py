"""Operator commands that call the coordinator API: ``kvledger namespace retire NS``.

The coordinator URL comes from ``--coordinator-url`` or the ``coordinator_url`` of
``.kvledger/stack.json``; the token from ``--token`` or, when absent, a short-lived
``admin`` token signed with ``KVLEDGER_JWT_SECRET`` (or the stack's ``jwt_secret``),
the same HS256 secret the coordinator verifies with.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from urllib.parse import quote

import httpx

from gpu_node.auth import JWT_SECRET_ENV, issue_token
from kvledger.publish import stack_setting

TOKEN_TTL_S = 300


def _token(args: argparse.Namespace) -> str:
    if args.token:
        return args.token
    secret = os.environ.get(JWT_SECRET_ENV) or stack_setting("jwt_secret")
    if not secret:
        raise ValueError(f"pass --token or set {JWT_SECRET_ENV}")
    return issue_token(tenant="ops", sub="kvledger-cli", roles=["admin"], ttl_s=TOKEN_TTL_S, secret=secret)


def retire_namespace_cli(args: argparse.Namespace) -> int:
    """Start retiring a namespace; prints the namespace record (status ``draining`` or ``retired``)."""
    try:
        url = args.coordinator_url or stack_setting("coordinator_url")
        if not url:
            raise ValueError("pass --coordinator-url or run `kvledger up` in this directory")
        token = _token(args)
    except ValueError as exc:
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
