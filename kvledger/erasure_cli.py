"""``kvledger erasure request|status|receipt``: a privacy officer's erasures through the coordinator
API.

* ``request --tenant T --subject S --reason R [--request-id ID]``: ``POST /v1/erasures``
  with a ``privacy-officer`` token of T; a retry with the same ``--request-id`` answers
  with the same erasure and starts nothing. The subject id goes in the request body only
  and is never printed.
* ``status ID --tenant T``: ``GET /v1/erasures/{id}`` with an ``auditor`` token of T
  (reading needs no more): the status and, per node × tier, what was removed and what
  the ledger still shows live.
* ``receipt ID --tenant T [--output DIR]``: ``GET /v1/erasures/{id}/receipt``; with
  ``--output`` also the receipt keys and the audit checkpoint, written as the three
  files ``kvledger verify-receipt`` checks offline, and the command that checks them.

Tokens and URL: :mod:`kvledger.api`.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import quote

from events.logs import escape_control
from identity.roles import AUDITOR, PRIVACY_OFFICER
from kvledger.api import Coordinator


def _print_json(document: Any) -> None:
    print(json.dumps(document, indent=2, ensure_ascii=False))


def request_cli(args: argparse.Namespace) -> int:
    body = {"tenant_id": args.tenant, "subject_id": args.subject, "reason": args.reason}
    if args.request_id:
        body["request_id"] = args.request_id
    started = Coordinator(args, role=PRIVACY_OFFICER, tenant=args.tenant).json(
        "POST", "/v1/erasures", json=body
    )
    if args.json:
        _print_json(started)
    else:
        print(f"erasure {started['id']} {started['status']}")
        print(
            f"follow it: kvledger erasure status {started['id']} --tenant {shlex.quote(args.tenant)}"
        )
    return 0


def status_cli(args: argparse.Namespace) -> int:
    erasure = Coordinator(args, role=AUDITOR, tenant=args.tenant).json(
        "GET", f"/v1/erasures/{quote(args.erasure_id, safe='')}"
    )
    if args.json:
        _print_json(erasure)
        return 0
    # The reason and node ids come from records and nodes: printed escaped
    # (events.logs.escape_control).
    print(
        escape_control(
            f"erasure {erasure['id']} ({erasure['tenant_id']}, reason {erasure['reason']}): {erasure['status']}"
        )
    )
    print(
        f"requested {erasure['requested_at']}   verified {erasure['verified_at'] or '-'}   receipt {erasure['receipt_id'] or '-'}"
    )
    for node in erasure["nodes"]:
        tiers = "   ".join(
            f"{tier}: removed {state['removed']}, live {state['live']}"
            + (
                ""
                if state["verified"] is None
                else f", {'verified' if state['verified'] else 'NOT verified'}"
            )
            for tier, state in node["tiers"].items()
        )
        print(escape_control(f"  {node['node_id']:<12} {node['status']:<12} {tiers}"))
    return 0


def receipt_cli(args: argparse.Namespace) -> int:
    coordinator = Coordinator(args, role=AUDITOR, tenant=args.tenant)
    receipt = coordinator.json("GET", f"/v1/erasures/{quote(args.erasure_id, safe='')}/receipt")
    if not args.output:
        _print_json(receipt)
        return 0
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    documents = {
        "receipt.json": receipt,
        "keys.json": coordinator.json("GET", "/v1/receipts/keys"),
        "checkpoint.json": coordinator.json("GET", "/v1/audit/checkpoint"),
    }
    for name, document in documents.items():
        (output / name).write_text(
            json.dumps(document, indent=2, ensure_ascii=False), encoding="utf-8"
        )
    files = {name: shlex.quote(str(output / name)) for name in documents}
    print(f"wrote {', '.join(files.values())}")
    print(
        f"check offline: kvledger verify-receipt {files['receipt.json']} --public-key {files['keys.json']} --checkpoint {files['checkpoint.json']}"
    )
    return 0
