"""Offline verification of a served receipt: what ``kvledger verify-receipt`` runs.

Its own module because a verifier must be small enough to read and re-implement: it needs only
the receipt, the coordinator's published keys and a tree head obtained independently, and it
shares nothing with the coordinator but the canonical encoding and the leaf hashing of
``coordinator.audit.receipts`` and the proof checks of ``coordinator.audit.merkle``. It never
raises for a bad document: every problem is a failed :class:`Check` with a message.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from coordinator.audit import merkle
from coordinator.audit.receipts import (
    AUDIT_FIELDS,
    LOWER_HEX,
    OPTIONAL_RECEIPT_FIELDS,
    RECEIPT_FIELDS,
    RECEIPT_SCHEMA,
    SCOPE_COVERAGE_KEYS,
    SIGNATURE_ALGORITHM,
    TREE_HEAD_FIELDS,
    canonical_json,
    key_id_for,
    tree_head_message,
)


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    message: str


@dataclass(frozen=True)
class VerificationResult:
    """Every check made, in order; ``ok`` only when there were checks and all passed."""

    checks: tuple[Check, ...]
    warnings: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(check.ok for check in self.checks)


class _Invalid(Exception):
    """A check's failure reason; caught by :func:`_run` and never raised out of this module."""


@dataclass(frozen=True)
class _TreeHead:
    tree_size: int
    root: bytes
    timestamp: str
    key_id: str
    signature: str


def _run(checks: list[Check], name: str, check: Callable[[], str]) -> bool:
    try:
        checks.append(Check(name, True, check()))
        return True
    except _Invalid as failure:
        checks.append(Check(name, False, str(failure)))
        return False


def _node_keys_text(value: Any) -> str:
    """The receipt's ``node_keys`` as ``node (key id), …``; _Invalid unless a list of {node_id,
    key_id}."""
    if not isinstance(value, list):
        raise _Invalid("node_keys is not a JSON array")
    named = []
    for entry in value:
        entry = _object(entry, "a node_keys entry", ("node_id", "key_id"))
        if not isinstance(entry["node_id"], str) or not isinstance(entry["key_id"], str):
            raise _Invalid("a node_keys entry's node_id and key_id must be strings")
        named.append(f"{entry['node_id']} (key {entry['key_id']})")
    return ", ".join(named) if named else "no node key"


def _require(value: Any, message: str) -> Any:
    if value is None:
        raise _Invalid(message)
    return value


def _object(
    value: Any, what: str, fields: tuple[str, ...] | None = None, optional: tuple[str, ...] = ()
) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _Invalid(f"{what} is not a JSON object")
    if fields is not None:
        missing = [f for f in fields if f not in value]
        unknown = sorted(set(value) - set(fields) - set(optional))
        if missing:
            raise _Invalid(f"{what} lacks {', '.join(missing)}")
        if unknown:
            raise _Invalid(f"{what} has fields nothing signs or proves: {', '.join(unknown)}")
    return value


def _size(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _Invalid(f"{what} is not a non-negative integer")
    return value


def _hash(value: Any, what: str) -> bytes:
    if (
        not isinstance(value, str)
        or len(value) != 2 * merkle.HASH_SIZE
        or not LOWER_HEX.match(value)
    ):
        raise _Invalid(f"{what} is not {merkle.HASH_SIZE} bytes of lower-case hex")
    return bytes.fromhex(value)


def _canonical(value: Any, what: str) -> bytes:
    try:
        return canonical_json(value)
    except ValueError as error:
        raise _Invalid(f"{what} cannot be canonicalized (RFC 8785): {error}") from None


def _verify_signature(
    keys: Mapping[str, Ed25519PublicKey], key_id: Any, value: Any, message: bytes, what: str
) -> str:
    if not isinstance(key_id, str) or key_id not in keys:
        raise _Invalid(f"{what} names key {key_id!r}, which is not in the key document")
    try:
        signature = base64.b64decode(value, validate=True) if isinstance(value, str) else b""
    except ValueError:  # binascii.Error, or non-ASCII text
        signature = b""
    if len(signature) != 64:
        raise _Invalid(f"{what} signature is not base64 of a 64-byte Ed25519 signature")
    try:
        keys[key_id].verify(signature, message)
    except InvalidSignature:
        raise _Invalid(f"{what} signature does not verify under key {key_id}") from None
    return f"valid Ed25519 signature by key {key_id}"


def _parse_keys(document: Any) -> tuple[dict[str, Ed25519PublicKey], list[str]]:
    """Usable keys, and a reason for every entry that is not usable."""
    if not isinstance(document, Mapping) or not isinstance(document.get("keys"), list):
        return {}, ['the key document is not {"keys": [...]}']
    keys: dict[str, Ed25519PublicKey] = {}
    problems: list[str] = []
    for position, entry in enumerate(document["keys"]):
        if not isinstance(entry, Mapping):
            problems.append(f"key #{position} is not an object")
            continue
        if entry.get("algorithm") != SIGNATURE_ALGORITHM:
            problems.append(
                f"key #{position} algorithm is {entry.get('algorithm')!r}, not {SIGNATURE_ALGORITHM}"
            )
            continue
        try:
            raw = (
                base64.b64decode(entry.get("public_key"), validate=True)
                if isinstance(entry.get("public_key"), str)
                else b""
            )
        except ValueError:  # binascii.Error, or non-ASCII text
            raw = b""
        if len(raw) != 32:
            problems.append(f"key #{position} public_key is not base64 of 32 bytes")
            continue
        if entry.get("key_id") != key_id_for(raw):
            problems.append(
                f"key #{position} key_id {entry.get('key_id')!r} is not derived from its public key ({key_id_for(raw)})"
            )
            continue
        try:
            keys[key_id_for(raw)] = Ed25519PublicKey.from_public_bytes(raw)
        except ValueError:
            problems.append(f"key #{position} public_key is not a valid Ed25519 key")
    return keys, problems


def _parse_tree_head(value: Any, what: str) -> _TreeHead:
    head = _object(value, what, TREE_HEAD_FIELDS)
    timestamp = head["timestamp"]
    if not isinstance(timestamp, str):
        raise _Invalid(f"{what} timestamp is not a string")
    return _TreeHead(
        tree_size=_size(head["tree_size"], f"{what} tree_size"),
        root=_hash(head["root_hash"], f"{what} root_hash"),
        timestamp=timestamp,
        key_id=head["key_id"],
        signature=head["signature"],
    )


def _verify_tree_head(keys: Mapping[str, Ed25519PublicKey], head: _TreeHead, what: str) -> str:
    if not isinstance(head.key_id, str):
        raise _Invalid(f"{what} key_id is not a string")
    try:
        message = tree_head_message(head.tree_size, head.root.hex(), head.timestamp, head.key_id)
    except ValueError as error:
        raise _Invalid(f"{what} cannot be canonicalized (RFC 8785): {error}") from None
    return (
        _verify_signature(keys, head.key_id, head.signature, message, what)
        + f" over size {head.tree_size}"
    )


def verify_served_receipt(
    document: Any,
    keys_document: Any,
    checkpoint: Any = None,
) -> VerificationResult:
    """Check a receipt as served, offline, against the key document and optionally a checkpoint.

    Checks, in order: ``keys``; ``receipt_format`` (schema and fields — also what stops
    some other signed object, such as a tree head payload, from posing as a receipt);
    ``receipt_signature``; ``tree_head_at_issue_signature``; ``tree_head_signature``;
    ``inclusion`` (the leaf re-derived from the receipt and its signature is in
    ``tree_head``, at an index inside ``tree_head_at_issue``); ``consistency``
    (``tree_head`` extends ``tree_head_at_issue``); with a checkpoint,
    ``checkpoint_signature`` and ``checkpoint_matches`` (it *is* ``tree_head``).
    A check that needs a part which failed to parse fails too, saying which.
    Without a checkpoint a warning says the log proofs are only self-consistent.
    """
    served = _ServedReceipt(document, keys_document, checkpoint)
    checks: list[Check] = []
    for name, check in served.checks():
        _run(checks, name, check)
    warnings: tuple[str, ...] = ()
    if checkpoint is None:
        warnings = (
            "no checkpoint given: the log proofs are checked only against the tree head served with the receipt; "
            "pass a checkpoint fetched independently (GET /v1/audit/checkpoint) to detect a rewritten or forked log",
        )
    return VerificationResult(tuple(checks), warnings)


class _ServedReceipt:
    """One verification of :func:`verify_served_receipt`: each check is a method, and the parts a
    check parses (receipt, signature, leaf, tree heads) are kept for the checks after it, so a
    later check can say which earlier part it could not use."""

    def __init__(self, document: Any, keys_document: Any, checkpoint: Any) -> None:
        self._document = document
        self._checkpoint = checkpoint
        self._keys, self._key_problems = _parse_keys(keys_document)
        self._receipt: Mapping[str, Any] | None = None
        self._signature: Mapping[str, Any] = {}
        self._leaf: bytes | None = None
        self._heads: dict[str, _TreeHead] = {}
        self._checkpoint_head: _TreeHead | None = None

    def checks(self) -> list[tuple[str, Callable[[], str]]]:
        """The checks in the order they run (and are reported)."""
        ordered: list[tuple[str, Callable[[], str]]] = [
            ("keys", self._keys_check),
            ("receipt_format", self._receipt_format),
            ("receipt_signature", self._receipt_signature),
            ("scope_coverage", self._scope_coverage),
            ("tree_head_at_issue_signature", lambda: self._tree_head("tree_head_at_issue")),
            ("tree_head_signature", lambda: self._tree_head("tree_head")),
            ("inclusion", self._inclusion),
            ("consistency", self._consistency),
        ]
        if self._checkpoint is not None:
            ordered += [
                ("checkpoint_signature", self._checkpoint_signature),
                ("checkpoint_matches", self._checkpoint_matches),
            ]
        return ordered

    def _keys_check(self) -> str:
        if self._key_problems:
            raise _Invalid("; ".join(self._key_problems))
        if not self._keys:
            raise _Invalid("the key document lists no keys")
        return f"{len(self._keys)} key(s), each key_id derived from its public key"

    def _receipt_format(self) -> str:
        top = _object(self._document, "the receipt document", ("receipt", "signature", "audit"))
        receipt = _object(top["receipt"], "receipt", RECEIPT_FIELDS, OPTIONAL_RECEIPT_FIELDS)
        if receipt["schema"] != RECEIPT_SCHEMA:
            raise _Invalid(f"receipt schema is {receipt['schema']!r}, not {RECEIPT_SCHEMA}")
        signature = _object(top["signature"], "signature", ("key_id", "algorithm", "value"))
        if signature["algorithm"] != SIGNATURE_ALGORITHM:
            raise _Invalid(
                f"signature algorithm is {signature['algorithm']!r}, not {SIGNATURE_ALGORITHM}"
            )
        self._leaf = merkle.leaf_hash(
            _canonical({"receipt": receipt, "signature": signature}, "receipt")
        )
        self._receipt, self._signature = receipt, signature
        return (
            f"{RECEIPT_SCHEMA} receipt {receipt['receipt_id']} for erasure {receipt['erasure_id']};"
            f" evidence signed by {_node_keys_text(receipt['node_keys'])}"
        )

    def _receipt_signature(self) -> str:
        receipt = _require(self._receipt, "not checked: receipt_format failed")
        signature = self._signature
        return _verify_signature(
            self._keys,
            signature["key_id"],
            signature["value"],
            _canonical(receipt, "receipt"),
            "receipt",
        )

    def _scope_coverage(self) -> str:
        """The erased blocks per cache scope, checked to add up to the block commitment's count."""
        receipt = _require(self._receipt, "not checked: receipt_format failed")
        if "blocks_by_scope" not in receipt:
            return "not stated: a receipt issued before per-scope coverage (its erasure matched user-scope blocks only)"
        counts = _object(receipt["blocks_by_scope"], "blocks_by_scope", SCOPE_COVERAGE_KEYS)
        numbers = {
            scope: _size(counts[scope], f"blocks_by_scope.{scope}") for scope in SCOPE_COVERAGE_KEYS
        }
        commitment = _object(receipt["block_commitment"], "block_commitment")
        committed = _size(commitment.get("count"), "block_commitment.count")
        if sum(numbers.values()) != committed:
            raise _Invalid(
                f"blocks_by_scope adds up to {sum(numbers.values())}, but the block commitment counts {committed}"
            )
        return "erased blocks by scope: " + ", ".join(
            f"{scope} {count}" for scope, count in numbers.items()
        )

    def _audit(self) -> Mapping[str, Any]:
        top = _object(self._document, "the receipt document")
        return _object(top.get("audit"), "audit", AUDIT_FIELDS)

    def _tree_head(self, name: str) -> str:
        head = _parse_tree_head(self._audit()[name], name)
        self._heads[name] = head
        return _verify_tree_head(self._keys, head, name)

    def _head(self, name: str) -> _TreeHead:
        return _require(self._heads.get(name), f"not checked: {name} is invalid")

    def _inclusion(self) -> str:
        leaf = _require(self._leaf, "not checked: receipt_format failed")
        at_issue = self._head("tree_head_at_issue")
        head = self._head("tree_head")
        index = _size(self._audit()["leaf_index"], "leaf_index")
        if index >= at_issue.tree_size:
            raise _Invalid(
                f"leaf_index {index} is outside the tree head at issue (size {at_issue.tree_size})"
            )
        proof = _proof(self._audit()["inclusion_proof"], "inclusion_proof")
        if not merkle.verify_inclusion(leaf, index, head.tree_size, proof, head.root):
            raise _Invalid(
                f"the receipt is not leaf {index} of the tree of size {head.tree_size} with root {head.root.hex()}: "
                "receipt, signature or proof was altered, or the log was rewritten"
            )
        return f"receipt is leaf {index} of the tree of size {head.tree_size}"

    def _consistency(self) -> str:
        at_issue = self._head("tree_head_at_issue")
        head = self._head("tree_head")
        proof = _proof(self._audit()["consistency_proof"], "consistency_proof")
        if not merkle.verify_consistency(
            at_issue.tree_size, head.tree_size, at_issue.root, head.root, proof
        ):
            raise _Invalid(
                f"the tree of size {head.tree_size} does not extend the tree head at issue (size {at_issue.tree_size}): "
                "the log was rewritten after the receipt was issued, or the proof is wrong"
            )
        return f"tree of size {head.tree_size} extends the tree head at issue (size {at_issue.tree_size})"

    def _checkpoint_signature(self) -> str:
        self._checkpoint_head = _parse_tree_head(self._checkpoint, "checkpoint")
        return _verify_tree_head(self._keys, self._checkpoint_head, "checkpoint")

    def _checkpoint_matches(self) -> str:
        wanted = _require(self._checkpoint_head, "not checked: the checkpoint is invalid")
        head = self._head("tree_head")
        at_issue = self._head("tree_head_at_issue")
        if wanted.tree_size == head.tree_size:
            if wanted.root != head.root:
                raise _Invalid(
                    f"the checkpoint and the receipt's tree head both have size {head.tree_size} but different roots: "
                    "the log shown with this receipt is not the one that was checkpointed (rewritten or forked)"
                )
            return f"the receipt's tree head is the checkpoint (size {wanted.tree_size})"
        if wanted.tree_size < at_issue.tree_size:
            raise _Invalid(
                f"the checkpoint (size {wanted.tree_size}) is older than this receipt's tree head at issue "
                f"(size {at_issue.tree_size}); fetch a newer checkpoint (GET /v1/audit/checkpoint) and verify again"
            )
        erasure = self._receipt["erasure_id"] if self._receipt is not None else "{id}"
        raise _Invalid(
            f"the checkpoint is for tree size {wanted.tree_size} but the receipt was served with a tree head of size "
            f"{head.tree_size}; fetch the receipt with ?tree_size={wanted.tree_size} "
            f"(GET /v1/erasures/{erasure}/receipt?tree_size={wanted.tree_size}) and verify again"
        )


def _proof(value: Any, what: str) -> list[bytes]:
    if not isinstance(value, list):
        raise _Invalid(f"{what} is not a list")
    return [_hash(element, f"{what} element {position}") for position, element in enumerate(value)]
