"""Operator commands that call the coordinator API: ``kvledger namespace retire NS``.

Where the coordinator is and which token to send: :mod:`kvledger.api`.
"""

from __future__ import annotations

import argparse
import json
from urllib.parse import quote

from identity.roles import PLATFORM_ADMIN
from kvledger.api import Coordinator


def retire_namespace_cli(args: argparse.Namespace) -> int:
    """Start retiring a namespace; prints the namespace record (status ``draining`` or ``retired``)."""
    coordinator = Coordinator(args, role=PLATFORM_ADMIN, tenant="platform")
    print(
        json.dumps(
            coordinator.json("POST", f"/v1/namespaces/{quote(args.namespace, safe='')}/retire"),
            indent=2,
        )
    )
    return 0
