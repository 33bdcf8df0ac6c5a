"""How operator commands reach the coordinator API: where it is, which token, and what a refusal says.

The URL comes from ``--coordinator-url`` or the ``coordinator_url`` of the stack file;
the token from ``--token`` or, when absent, a short-lived operator token for the one
role the command needs, signed with the stack's operator key (``kvledger up`` creates
it). End users' secrets never sign operator tokens. Failures are left to ``kvledger``'s
``main()`` to print as one line: a refusal as :class:`~kvledger.errors.CliError` carrying
the coordinator's error message (exit 1), an unreachable coordinator as httpx's transport error.
"""

from __future__ import annotations

import argparse
from typing import Any

import httpx

from identity.tokens import issue_token
from kvledger.errors import EXIT_FAILURE, CliError
from kvledger.tokens import load_stack, operator_key_pem

TOKEN_TTL_S = 300
REQUEST_TIMEOUT_S = 30.0


class Coordinator:
    """The coordinator API as one operator role sees it."""

    def __init__(self, args: argparse.Namespace, *, role: str, tenant: str) -> None:
        stack = load_stack(args.stack)
        url = args.coordinator_url or stack.get("coordinator_url")
        if not url:
            raise CliError(
                "pass --coordinator-url or run `kvledger up` in this directory (or pass --stack)"
            )
        self.url = url.rstrip("/")
        self.token = args.token or issue_token(
            tenant=tenant,
            sub="kvledger-cli",
            roles=[role],
            ttl_s=TOKEN_TTL_S,
            private_key_pem=operator_key_pem(stack),
        )

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """The successful response to ``method path``; CliError with the coordinator's message
        otherwise."""
        headers = {"Authorization": f"Bearer {self.token}"} | kwargs.pop("headers", {})
        response = httpx.request(
            method, f"{self.url}{path}", headers=headers, timeout=REQUEST_TIMEOUT_S, **kwargs
        )
        if not response.is_success:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:500]
            raise CliError(
                f"HTTP {response.status_code} from {method} {path}: {message}", EXIT_FAILURE
            )
        return response

    def json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self.request(method, path, **kwargs).json()
