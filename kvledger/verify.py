"""``kvledger verify-receipt RECEIPT --public-key KEYS [--checkpoint CHECKPOINT] [--json]``: offline
receipt verification.

Reads the documents exactly as the coordinator serves them (``GET
/v1/erasures/{id}/receipt``, ``GET /v1/receipts/keys``, ``GET /v1/audit/checkpoint``)
from files, so an auditor can verify with no network and no trust in the machine
that served them — only in the key document and checkpoint they obtained.

Exit status: 0 every check passed; 1 a check failed; 2 verification could not
run (no key document, a file unreadable or not strict JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from coordinator.audit.verifier import verify_served_receipt


def _strict_object_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """Refuse duplicate keys: RFC 8785 input must be I-JSON, and a reader must not see one value while we check another."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _load(path: str) -> Any:
    """The JSON document in ``path``; ValueError naming the file when it cannot be read as strict
    JSON."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        return json.loads(
            text, object_pairs_hook=_strict_object_pairs, parse_constant=_refuse_constant
        )
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"{path}: {error}") from None


def cli(args: argparse.Namespace) -> int:
    if not args.public_key:
        print(
            "cannot verify without the receipt keys: pass --public-key FILE holding GET /v1/receipts/keys",
            file=sys.stderr,
        )
        return 2
    try:
        receipt = _load(args.receipt)
        keys = _load(args.public_key)
        checkpoint = _load(args.checkpoint) if args.checkpoint else None
    except ValueError as error:
        print(f"cannot verify: {error}", file=sys.stderr)
        return 2
    result = verify_served_receipt(receipt, keys, checkpoint)
    if args.json:
        checks = [
            {"name": check.name, "ok": check.ok, "message": check.message}
            for check in result.checks
        ]
        print(
            json.dumps(
                {"ok": result.ok, "checks": checks, "warnings": list(result.warnings)},
                indent=2,
                ensure_ascii=False,
            )
        )
        return 0 if result.ok else 1
    for check in result.checks:
        print(f"{'✓' if check.ok else '✗'} {check.name}: {check.message}")
    for warning in result.warnings:
        print(f"! {warning}")
    print("receipt verified" if result.ok else "receipt NOT verified")
    return 0 if result.ok else 1
