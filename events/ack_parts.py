"""A command ack of any size: the node splits it into signed records that fit, the coordinator joins
them.

A node's evidence for one command lists every block it removed, per tier, and every data key
it destroyed: an erasure of a large subject, a namespace retire or a tenant-wide revocation
lists tens of thousands of hashes, far more than one record carries
(:data:`events.record_size.MAX_RECORD_BYTES`, and :data:`events.schema.MAX_HASHES_PER_EVENT`
per tier). :func:`ack_parts` cuts the evidence into ``CommandAck`` parts by encoded size and
count; all parts share a fresh ``ack_id``. :func:`merge_evidence` is the inverse the
coordinator applies once every part is in: one evidence entry per tier, as if the ack had
been a single record.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from events.record_size import MAX_RECORD_BYTES, envelope_bytes, split_to_fit
from events.schema import (
    MAX_ACK_PARTS,
    MAX_HASHES_PER_EVENT,
    CommandAck,
    EraseMethod,
    PostCheck,
    TierEvidence,
)
from events.tiers import Tier


@dataclass(frozen=True, slots=True)
class TierReport:
    """What one tier of a node did for a command, whole: a :class:`TierEvidence` without its per-record bounds."""

    tier: Tier
    block_hashes: list[str]
    method: EraseMethod
    post_check: PostCheck
    verified: bool
    key_ids: list[str] = field(default_factory=list)

    @property
    def removed(self) -> int:
        return len(self.block_hashes)


_Item = tuple[int, Literal["tier", "hash", "key"], str]
"""One unit of evidence a part may carry: (report index, what, value). Every report contributes a
``tier`` item first, so a tier that removed nothing still appears in some part."""


def ack_parts(
    command_id: uuid.UUID,
    node_id: str,
    epoch: int,
    reports: Sequence[TierReport],
    *,
    after_seq: int | None = None,
    max_bytes: int = MAX_RECORD_BYTES,
) -> list[CommandAck]:
    """The ack of ``reports`` as the fewest consecutive parts whose signed records fit ``max_bytes``.

    One part (no part fields, the encoding of an ack before parts existed) when it fits; else
    parts with a shared fresh ``ack_id``, each listing at most
    :data:`~events.schema.MAX_HASHES_PER_EVENT` hashes and key ids. ValueError when even
    :data:`~events.schema.MAX_ACK_PARTS` parts cannot hold the evidence. Every part carries
    ``after_seq`` (the node's fence, :class:`~events.schema.CommandAck`).
    """
    items: list[_Item] = []
    for index, report in enumerate(reports):
        items.append((index, "tier", report.tier))
        items.extend((index, "hash", block_hash) for block_hash in report.block_hashes)
        items.extend((index, "key", key_id) for key_id in report.key_ids)
    if len(items) <= MAX_HASHES_PER_EVENT:
        single = CommandAck(
            command_id=command_id,
            node_id=node_id,
            epoch=epoch,
            evidence=_evidence(reports, items),
            after_seq=after_seq,
        )
        if envelope_bytes(single) <= max_bytes:
            return [single]
    ack_id = uuid.uuid4()

    def size_of(run: Sequence[_Item]) -> int:
        # Measured with the longest part numbers any ack carries: the real ones are no longer.
        return envelope_bytes(
            CommandAck.model_construct(
                command_id=command_id,
                node_id=node_id,
                epoch=epoch,
                evidence=_evidence(reports, run),
                ack_id=ack_id,
                part=MAX_ACK_PARTS - 1,
                parts=MAX_ACK_PARTS,
                after_seq=after_seq,
            )
        )

    runs = split_to_fit(items, size_of, max_items=MAX_HASHES_PER_EVENT, max_bytes=max_bytes)
    if len(runs) > MAX_ACK_PARTS:
        raise ValueError(f"the ack needs {len(runs)} parts, more than {MAX_ACK_PARTS}")
    return [
        CommandAck(
            command_id=command_id,
            node_id=node_id,
            epoch=epoch,
            evidence=_evidence(reports, run),
            ack_id=ack_id,
            part=number,
            parts=len(runs),
            after_seq=after_seq,
        )
        for number, run in enumerate(runs)
    ]


def _evidence(reports: Sequence[TierReport], run: Iterable[_Item]) -> list[TierEvidence]:
    """The evidence entries of one part: per report the run touches, its slice of hashes and key
    ids."""
    hashes: dict[int, list[str]] = {}
    key_ids: dict[int, list[str]] = {}
    for index, kind, value in run:
        hashes.setdefault(index, [])
        key_ids.setdefault(index, [])
        if kind == "hash":
            hashes[index].append(value)
        elif kind == "key":
            key_ids[index].append(value)
    return [
        TierEvidence(
            tier=reports[index].tier,
            removed=len(hashes[index]),
            block_hashes=hashes[index],
            method=reports[index].method,
            post_check=reports[index].post_check,
            verified=reports[index].verified,
            key_ids=key_ids[index],
        )
        for index in hashes
    ]


def merge_evidence(parts: Iterable[Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """The evidence of a whole ack from its parts' evidence (``TierEvidence`` as JSON), in part order.

    One entry per tier, in the order tiers first appear: hashes and key ids concatenated (key
    ids once each), ``removed`` summed. A tier whose parts disagree on method or post-check
    is not a report of one erasure: the merged entry is not ``verified``.
    """
    merged: dict[str, dict[str, Any]] = {}
    key_ids_seen: dict[str, set[str]] = {}
    for evidence in parts:
        for item in evidence:
            entry = merged.get(item["tier"])
            if entry is None:
                merged[item["tier"]] = {
                    **item,
                    "block_hashes": list(item["block_hashes"]),
                    "key_ids": [],
                }
                entry, key_ids_seen[item["tier"]] = merged[item["tier"]], set()
            else:
                entry["block_hashes"].extend(item["block_hashes"])
                entry["removed"] += item["removed"]
            seen = key_ids_seen[item["tier"]]
            entry["key_ids"].extend(key_id for key_id in item["key_ids"] if key_id not in seen)
            seen.update(item["key_ids"])
            consistent = (entry["method"], entry["post_check"]) == (
                item["method"],
                item["post_check"],
            )
            entry["verified"] = entry["verified"] and item["verified"] and consistent
    return list(merged.values())
