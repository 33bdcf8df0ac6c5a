"""``kvledger dead-letters list|replay``: inspect and replay refused records through the coordinator
API.

* ``list [--topic T] [--reason TEXT] [--since WHEN] [--limit N] [--json]``:
  ``GET /v1/dead-letters`` with a ``platform-admin`` token. One line per dead letter: its
  id, source topic, partition and offset, when it was dead-lettered, size and SHA-256 of
  the record's bytes, whether the letter is trusted (signed by the coordinator) and held
  whole, and the reason. The record's content is never printed (the API does not return
  it), and every field that came from a record is printed escaped (``events.logs.escape_control``):
  a reason quoting a hostile key name cannot move the cursor, recolour or forge a line.
  ``--since`` is an ISO 8601 time with a zone or an age such as ``30m``, ``6h``, ``2d``.
* ``replay ID``: ``POST /v1/dead-letters/{ID}/replay`` re-publishes the record to its
  source topic once; it is validated again like any record (docs/operations.md, "Dead letters").
  The coordinator refuses letters it did not sign and letters that refer to their record
  by reference (its bytes are not held); the error says which.

Tokens and URL: :mod:`kvledger.api`.
"""

from __future__ import annotations

import argparse
import json
import re
from datetime import UTC, datetime, timedelta
from urllib.parse import quote

from events.logs import escape_control
from identity.roles import PLATFORM_ADMIN
from kvledger.api import Coordinator

_AGE = re.compile(r"^([1-9][0-9]*)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def since_time(value: str, now: datetime | None = None) -> str:
    """``--since`` as the ISO time the API takes; ValueError (a usage error) when it is neither
    form."""
    age = _AGE.fullmatch(value)
    if age is not None:
        moment = (now or datetime.now(UTC)) - timedelta(seconds=int(age[1]) * _UNIT_S[age[2]])
        return moment.isoformat()
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(
            f"--since {value!r}: an ISO 8601 time with a zone or an age like 30m, 6h, 2d"
        ) from None
    if moment.tzinfo is None:
        raise ValueError(f"--since {value!r}: give the time zone (e.g. 2026-12-01T10:00:00Z)")
    return moment.isoformat()


def list_cli(args: argparse.Namespace) -> int:
    params: dict[str, str | int] = {"limit": args.limit}
    if args.topic:
        params["topic"] = args.topic
    if args.reason:
        params["reason"] = args.reason
    if args.since:
        params["since"] = since_time(args.since)
    answer = Coordinator(args, role=PLATFORM_ADMIN, tenant="platform").json(
        "GET", "/v1/dead-letters", params=params
    )
    if args.json:
        print(
            json.dumps(answer, indent=2)
        )  # ASCII: no raw C1, bidi or line-separator character reaches the terminal
        return 0
    for letter in answer["dead_letters"]:
        print(escape_control(_line(letter)))
    print(
        f"{len(answer['dead_letters'])} dead letter(s)"
        + (" (more match: narrow with --since/--topic/--reason)" if answer["truncated"] else "")
    )
    return 0


def _line(letter: dict) -> str:
    """One dead letter of the listing; the caller escapes it (planted letters choose every field)."""
    held = "by-reference" if letter.get("by_reference") else "whole"
    trusted = "trusted" if letter.get("trusted") else f"UNTRUSTED({letter.get('signature')})"
    return (
        f"{letter['id']:<12} {letter['topic']}[{letter['partition']}]@{letter['offset']}  {letter['dead_lettered_at']}"
        f"  {letter['num_value_bytes']} B sha256:{str(letter['value_sha256'] or '-')[:16]}  {trusted} {held}  {letter['reason']}"
    )


def replay_cli(args: argparse.Namespace) -> int:
    path = f"/v1/dead-letters/{quote(args.dead_letter_id, safe='')}/replay"
    replayed = Coordinator(args, role=PLATFORM_ADMIN, tenant="platform").json("POST", path)
    if args.json:
        print(json.dumps(replayed, indent=2))
    else:
        line = f"dead letter {replayed['id']} replayed to {replayed['topic']}[{replayed['partition']}]@{replayed['offset']}"
        print(escape_control(line))
    return 0
