"""Signed erasure receipts, signed tree heads of the audit log, and their offline verification.

A person's erasure ends with a *receipt*: a small JSON document holding only ids,
hashes and counts (never the subject in clear), signed with the coordinator's
Ed25519 key and appended as a leaf to an RFC 6962 Merkle audit log whose signed
tree heads (STHs) are published. The signature says who issued the receipt; the
log proofs say it has not been altered or withdrawn since, relative to a tree
head the verifier obtained independently (``GET /v1/audit/checkpoint``).

This module is pure: no I/O, no storage. The log is handed in as leaf hashes
(a sequence or an ``index → leaf hash`` callable, see ``coordinator.audit.merkle``), so
the same functions serve an in-memory list in tests and Postgres in production.
Documents are plain ``dict``s in exactly the shape the HTTP endpoints serve, so
what is signed here is byte-for-byte what a client re-canonicalizes to verify.

Every signed or hashed byte string is RFC 8785 canonical JSON: a verifier in any
language re-derives the same bytes from the parsed document, whatever whitespace
or key order a proxy or pretty-printer introduced on the way.

Builders and signers raise ValueError for bad caller input. The verifier never
raises for a bad document: every problem is a failed :class:`Check` with a message.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import re
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import rfc8785
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import SecretStr

from coordinator.audit import merkle
from events.tiers import Tier

RECEIPT_SCHEMA = "kvledger.erasure-receipt/v1"
SIGNATURE_ALGORITHM = "Ed25519"
BLOCK_COMMITMENT_ALGORITHM = "rfc6962-sha256/sorted-unique-block-hashes"

TIERS = tuple(tier.value for tier in Tier)
"""Every place the ledger tracks (``events.tiers.Tier``), in receipt order."""

METHODS: dict[str, str] = {
    "clear": "NIST SP 800-88 Rev. 1 Clear: the memory slots holding the blocks were overwritten and read back as zero.",
    "purge-crypto-erase": (
        "NIST SP 800-88 Rev. 1 Purge by cryptographic erase: the data keys that sealed the blocks "
        "(AES-256-GCM at rest) were destroyed, so every sealed copy on disk or in a snapshot is unreadable."
    ),
    "clear-unlink": (
        "A plaintext file was overwritten with zeros through the file system and unlinked. At most NIST "
        "SP 800-88 Clear, never Purge: on flash or copy-on-write storage the overwrite may miss physical copies."
    ),
}
"""The sanitization methods a receipt may name, with what each one means."""

METHOD_FOR_NODE_ERASE_METHOD: dict[str, str] = {
    "overwrite": "clear",
    "crypto_erase": "purge-crypto-erase",
    "unlink": "clear-unlink",
}
"""Node evidence (``events.schema.EraseMethod``) → receipt method.

Nodes report what they did; the receipt names it in NIST 800-88 terms. ``unlink``
is deliberately *not* called Purge: a file system overwrite does not reach every
physical copy on flash media, and claiming Purge for it in a signed document would
overstate the erasure. A subject's data never takes that path in practice — user
scope is always sealed on disk and in snapshots, so it is crypto-erased.
"""

STANDARD_CAVEATS: tuple[str, ...] = (
    "This receipt covers the cache tiers the kvledger ledger tracks (device, host, disk, snapshot) on the nodes "
    "it lists; it cannot prove that no copy exists elsewhere (backups, swap, crash dumps, logs, hardware caches).",
    "Generated text already returned to clients, and anything derived from it, is outside the scope of this receipt.",
    "Counts, methods and evidence digests are what the nodes reported and the coordinator checked; the receipt "
    "attests to those reports, not to an independent inspection of the hardware.",
    "Cryptographic erase is effective only if the destroyed data keys were never copied outside the key store.",
    "subject_hash is a keyed digest: it cannot be linked to a person without the deployment's subject key.",
    "The audit log proofs show this receipt has not been altered or withdrawn relative to the tree head you "
    "verify against; compare that tree head with one obtained independently to rule out a forked log.",
)
"""Caveats every receipt carries: what a receipt cannot prove, stated inside the signed body."""

_LOWER_HEX = re.compile(r"^(?:[0-9a-f]{2})+$")
_SUBJECT_HASH = re.compile(r"^[0-9a-f]{64}$")
_NODE_KEY_ID = re.compile(r"^[0-9a-f]{32}$")
_MAX_ID_CHARS = 512
_RECEIPT_FIELDS = (
    "schema",
    "receipt_id",
    "erasure_id",
    "tenant_id",
    "subject_hash",
    "requested_at",
    "verified_at",
    "tiers",
    "block_commitment",
    "key_ids_destroyed",
    "node_keys",
    "caveats",
)
SCOPE_COVERAGE_CAVEAT = (
    "blocks_by_scope counts the erased blocks by cache scope. Public and tenant blocks are shared: the erasure "
    "removed every copy this subject's requests created, in any scope; a copy another subject created (this "
    "subject may have reused it, or sent the same text later) is that subject's and is not covered."
)
"""The caveat of a receipt that states ``blocks_by_scope``: what per-scope coverage does and does not mean."""
_OPTIONAL_RECEIPT_FIELDS = ("blocks_by_scope",)
"""Fields a receipt may lack: receipts issued before them stay valid (the signature covers whatever the body holds)."""
SCOPE_COVERAGE_KEYS = ("public", "tenant", "user", "unrecorded")
"""``blocks_by_scope``: erased blocks per cache scope, and ``unrecorded`` ones the ledger held no provenance for."""
_STH_FIELDS = ("tree_size", "root_hash", "timestamp", "key_id", "signature")
_AUDIT_FIELDS = ("leaf_index", "tree_head_at_issue", "tree_head", "inclusion_proof", "consistency_proof")


# ---------------------------------------------------------------------------
# Encodings
# ---------------------------------------------------------------------------


def canonical_json(value: Any) -> bytes:
    """RFC 8785 (JCS) bytes of a JSON value: the only form that is ever hashed or signed.

    ValueError for values JSON cannot carry canonically (NaN, integers beyond 2^53,
    non-string keys, bytes).
    """
    return rfc8785.dumps(value)


def rfc3339(moment: datetime) -> str:
    """``YYYY-MM-DDTHH:MM:SS.mmmZ`` in UTC. Naive datetimes are refused: their zone is a guess."""
    if not isinstance(moment, datetime) or moment.tzinfo is None or moment.utcoffset() is None:
        raise ValueError(f"expected a timezone-aware datetime, got {moment!r}")
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def key_id_for(raw_public_key: bytes) -> str:
    """First 16 bytes of SHA-256(raw 32-byte public key), hex: derived, so a label cannot lie about its key."""
    return hashlib.sha256(raw_public_key).digest()[:16].hex()


def evidence_digest(evidence: Any) -> str:
    """SHA-256 hex of the canonical JSON of a node's evidence.

    The receipt commits to the evidence without carrying it: whoever holds the
    evidence (the ledger, an auditor given access) can recompute the digest.
    """
    try:
        return hashlib.sha256(canonical_json(evidence)).hexdigest()
    except ValueError as error:
        raise ValueError(f"evidence is not canonicalizable JSON: {error}") from None


def block_commitment(block_hashes: Iterable[str]) -> dict[str, Any]:
    """Merkle root over the distinct erased block hashes, sorted bytewise, plus their count.

    Leaf data is each block hash's raw bytes. A root rather than the list keeps the
    receipt small and reveals nothing about the blocks, yet anyone given the list
    (or one hash and an inclusion proof) can check it against the receipt.
    """
    raw = set()
    for block_hash in block_hashes:
        if not isinstance(block_hash, str) or not _LOWER_HEX.match(block_hash) or not 16 <= len(block_hash) // 2 <= 64:
            raise ValueError(f"block hash must be lower-case hex of 16..64 bytes, got {block_hash!r}")
        raw.add(bytes.fromhex(block_hash))
    leaves = [merkle.leaf_hash(value) for value in sorted(raw)]
    return {
        "algorithm": BLOCK_COMMITMENT_ALGORITHM,
        "count": len(leaves),
        "root": merkle.root_hash(len(leaves), leaves).hex(),
    }


# ---------------------------------------------------------------------------
# Keys
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ReceiptPublicKey:
    """A verification key as the key document lists it; also how retired keys stay listed after rotation."""

    raw: bytes
    created_at: str

    def __post_init__(self) -> None:
        if len(self.raw) != 32:
            raise ValueError("an Ed25519 public key is 32 bytes")

    @property
    def key_id(self) -> str:
        return key_id_for(self.raw)

    def document_entry(self) -> dict[str, str]:
        return {
            "key_id": self.key_id,
            "algorithm": SIGNATURE_ALGORITHM,
            "public_key": base64.b64encode(self.raw).decode("ascii"),
            "created_at": self.created_at,
        }


class ReceiptSigner:
    """The coordinator's Ed25519 receipt key.

    Production loads it from a PEM held in settings (a ``SecretStr``) so that every
    coordinator replica signs with the same key and receipts survive restarts. A
    generated key is for tests and throw-away stacks: receipts it signed verify
    only while its public key is still listed in the key document, so the storage
    layer must persist (key_id, public key, created_at) the first time it is used.
    """

    def __init__(self, private_key: Ed25519PrivateKey, created_at: datetime | None = None) -> None:
        if not isinstance(private_key, Ed25519PrivateKey):
            raise ValueError("receipt keys are Ed25519")
        self._private_key = private_key
        raw = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.public_key = ReceiptPublicKey(raw, rfc3339(created_at or datetime.now(UTC)))

    @classmethod
    def from_pem(cls, pem: SecretStr | str | bytes, created_at: datetime | None = None) -> ReceiptSigner:
        """Load an unencrypted PKCS#8 Ed25519 private key. Errors never echo the key material."""
        if isinstance(pem, SecretStr):
            pem = pem.get_secret_value()
        data = pem.encode() if isinstance(pem, str) else pem
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError):
            raise ValueError("receipt signing key is not an unencrypted PEM private key") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"receipt signing key must be Ed25519, got {type(key).__name__}")
        return cls(key, created_at)

    @classmethod
    def generate(cls, created_at: datetime | None = None) -> ReceiptSigner:
        return cls(Ed25519PrivateKey.generate(), created_at)

    @property
    def key_id(self) -> str:
        return self.public_key.key_id

    def sign(self, message: bytes) -> str:
        """Base64 (RFC 4648, padded) of the Ed25519 signature over ``message``."""
        return base64.b64encode(self._private_key.sign(message)).decode("ascii")


def public_key_document(keys: Iterable[ReceiptSigner | ReceiptPublicKey]) -> dict[str, list[dict[str, str]]]:
    """The body of ``GET /v1/receipts/keys``: every key whose receipts must still verify, current and retired."""
    entries: list[dict[str, str]] = []
    seen: set[str] = set()
    for key in keys:
        public = key.public_key if isinstance(key, ReceiptSigner) else key
        if public.key_id in seen:
            raise ValueError(f"key {public.key_id} listed twice")
        seen.add(public.key_id)
        entries.append(public.document_entry())
    return {"keys": entries}


# ---------------------------------------------------------------------------
# Receipts
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TierErasure:
    """What one node did in one tier for an erasure. Only the digest of ``evidence`` enters the receipt."""

    node_id: str
    tier: str
    count: int
    method: str
    evidence: Any = field(repr=False)


def receipt_method(node_erase_method: str) -> str:
    """The receipt's NIST 800-88 term for a node's ``EraseMethod`` (see ``METHOD_FOR_NODE_ERASE_METHOD``)."""
    try:
        return METHOD_FOR_NODE_ERASE_METHOD[node_erase_method]
    except KeyError:
        raise ValueError(f"unknown node erase method {node_erase_method!r}") from None


def _identifier(name: str, value: Any) -> str:
    if isinstance(value, uuid.UUID):
        value = str(value)
    if not isinstance(value, str) or not value or len(value) > _MAX_ID_CHARS:
        raise ValueError(f"{name} must be a non-empty string of at most {_MAX_ID_CHARS} characters")
    return value


def _node_key_id(value: Any) -> str:
    if not isinstance(value, str) or not _NODE_KEY_ID.match(value):
        raise ValueError("a node key id is 32 lowercase hex characters")
    return value


def _tier_entry(entry: TierErasure) -> dict[str, Any]:
    if entry.tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}, got {entry.tier!r}")
    if entry.method not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {entry.method!r}")
    if not isinstance(entry.count, int) or isinstance(entry.count, bool) or entry.count < 0:
        raise ValueError(f"count must be a non-negative integer, got {entry.count!r}")
    return {
        "node_id": _identifier("node_id", entry.node_id),
        "tier": entry.tier,
        "count": entry.count,
        "method": entry.method,
        "evidence_digest": evidence_digest(entry.evidence),
    }


def build_receipt(
    *,
    receipt_id: str,
    erasure_id: str,
    tenant_id: str,
    subject_hash: str,
    requested_at: datetime,
    verified_at: datetime,
    tiers: Iterable[TierErasure],
    block_hashes: Iterable[str],
    key_ids_destroyed: Iterable[str],
    node_keys: Iterable[tuple[str, str]],
    caveats: Iterable[str] = (),
    blocks_by_scope: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The unsigned receipt body (schema ``kvledger.erasure-receipt/v1``).

    Only ids, hashes and counts: ``subject_hash`` must already be the keyed digest
    (``events.schema.subject_digest``) — it is checked to be 64 hex characters so a
    subject id in clear cannot slip in by mistake. Entries, block hashes and key ids
    are sorted, so two replicas building the same erasure sign the same bytes.
    ``node_keys`` are the (node id, key id) pairs of the enrolled node keys that signed
    the acks the receipt relies on (``docs/security.md``). ``caveats`` are appended to
    :data:`STANDARD_CAVEATS`. ``blocks_by_scope`` counts the distinct erased blocks per
    :data:`SCOPE_COVERAGE_KEYS` entry; the counts must add up to the block commitment's.
    """
    if not isinstance(subject_hash, str) or not _SUBJECT_HASH.match(subject_hash):
        raise ValueError("subject_hash must be the 64-hex-character keyed subject digest, never the subject id")
    requested, verified = rfc3339(requested_at), rfc3339(verified_at)
    if verified_at < requested_at:
        raise ValueError("verified_at is before requested_at")
    entries = [_tier_entry(entry) for entry in tiers]
    entries.sort(key=lambda e: (e["node_id"], TIERS.index(e["tier"])))
    for previous, current in itertools.pairwise(entries):
        if (previous["node_id"], previous["tier"]) == (current["node_id"], current["tier"]):
            raise ValueError(f"two entries for node {current['node_id']!r} tier {current['tier']!r}")
    destroyed = sorted({_identifier("key id", key_id) for key_id in key_ids_destroyed})
    signers = [
        {"node_id": node_id, "key_id": key_id}
        for node_id, key_id in sorted({(_identifier("node_id", n), _node_key_id(k)) for n, k in node_keys})
    ]
    extra = [_identifier("caveat", caveat) for caveat in caveats]
    commitment = block_commitment(block_hashes)
    coverage = {}
    if blocks_by_scope is not None:
        coverage = {"blocks_by_scope": _scope_coverage(blocks_by_scope, commitment["count"])}
        extra.insert(0, SCOPE_COVERAGE_CAVEAT)
    return {
        "schema": RECEIPT_SCHEMA,
        "receipt_id": _identifier("receipt_id", receipt_id),
        "erasure_id": _identifier("erasure_id", erasure_id),
        "tenant_id": _identifier("tenant_id", tenant_id),
        "subject_hash": subject_hash,
        "requested_at": requested,
        "verified_at": verified,
        "tiers": entries,
        "block_commitment": commitment,
        "key_ids_destroyed": destroyed,
        "node_keys": signers,
        "caveats": [*STANDARD_CAVEATS, *extra],
        **coverage,
    }


def _scope_coverage(counts: Mapping[str, int], num_blocks: int) -> dict[str, int]:
    if set(counts) != set(SCOPE_COVERAGE_KEYS):
        raise ValueError(f"blocks_by_scope must have exactly the keys {SCOPE_COVERAGE_KEYS}")
    for scope, count in counts.items():
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"blocks_by_scope[{scope!r}] must be a non-negative integer, got {count!r}")
    if sum(counts.values()) != num_blocks:
        raise ValueError(f"blocks_by_scope adds up to {sum(counts.values())}, but {num_blocks} distinct blocks were erased")
    return {scope: counts[scope] for scope in SCOPE_COVERAGE_KEYS}


def sign_receipt(body: Mapping[str, Any], signer: ReceiptSigner) -> dict[str, Any]:
    """``{"receipt": body, "signature": {key_id, algorithm, value}}``; the signature covers canonical(body)."""
    if not isinstance(body, Mapping) or body.get("schema") != RECEIPT_SCHEMA:
        raise ValueError(f"not a {RECEIPT_SCHEMA} body")
    body = dict(body)
    return {
        "receipt": body,
        "signature": {"key_id": signer.key_id, "algorithm": SIGNATURE_ALGORITHM, "value": signer.sign(canonical_json(body))},
    }


def audit_leaf_data(signed: Mapping[str, Any]) -> bytes:
    """The audit log leaf for a signed receipt: canonical JSON of exactly ``{receipt, signature}``.

    Anything else a served document carries (the ``audit`` proofs) is left out, so the
    verifier can re-derive the leaf from the document it was given.
    """
    return canonical_json({"receipt": signed["receipt"], "signature": signed["signature"]})


def audit_leaf_hash(signed: Mapping[str, Any]) -> bytes:
    return merkle.leaf_hash(audit_leaf_data(signed))


# ---------------------------------------------------------------------------
# Tree heads and serving
# ---------------------------------------------------------------------------


def _tree_head_message(tree_size: int, root_hash_hex: str, timestamp: str, key_id: str) -> bytes:
    return canonical_json({"tree_size": tree_size, "root_hash": root_hash_hex, "timestamp": timestamp, "key_id": key_id})


def sign_tree_head(tree_size: int, root_hash: bytes, timestamp: datetime, signer: ReceiptSigner) -> dict[str, Any]:
    """A signed tree head, the body of ``GET /v1/audit/checkpoint``.

    The signature covers canonical JSON of ``{tree_size, root_hash, timestamp, key_id}``.
    It is what binds the size to the root: an RFC 6962 root alone does not commit
    to the number of leaves.
    """
    if not isinstance(tree_size, int) or isinstance(tree_size, bool) or tree_size < 0:
        raise ValueError(f"tree_size must be a non-negative integer, got {tree_size!r}")
    if not isinstance(root_hash, (bytes, bytearray)) or len(root_hash) != merkle.HASH_SIZE:
        raise ValueError(f"root_hash must be {merkle.HASH_SIZE} bytes")
    root_hex, stamp = bytes(root_hash).hex(), rfc3339(timestamp)
    return {
        "tree_size": tree_size,
        "root_hash": root_hex,
        "timestamp": stamp,
        "key_id": signer.key_id,
        "signature": signer.sign(_tree_head_message(tree_size, root_hex, stamp, signer.key_id)),
    }


def serve_receipt(
    signed: Mapping[str, Any],
    leaf_index: int,
    sth_at_issue: Mapping[str, Any],
    sth_now: Mapping[str, Any],
    leaf_hash_at: merkle.LeafSource,
) -> dict[str, Any]:
    """The body of ``GET /v1/erasures/{id}/receipt``: the signed receipt plus the proofs to check it offline.

    ``sth_at_issue`` is the first tree head that contained the receipt; ``sth_now`` the
    latest one (or the one at the client's ``?tree_size=``). The inclusion proof is for
    the leaf in ``sth_now``; the consistency proof links ``sth_at_issue`` to ``sth_now``.
    ValueError when the caller's arguments cannot describe this receipt (wrong index,
    heads out of order); the proofs themselves are not re-verified here — a log that
    was tampered with must reach the client and fail *there*, in the open.
    """
    issue_size, now_size = sth_at_issue.get("tree_size"), sth_now.get("tree_size")
    if not all(isinstance(size, int) and not isinstance(size, bool) for size in (issue_size, now_size)):
        raise ValueError("tree heads must come from sign_tree_head")
    if not isinstance(leaf_index, int) or isinstance(leaf_index, bool) or not 0 <= leaf_index < issue_size:
        raise ValueError(f"leaf_index {leaf_index!r} is not in the tree head at issue (size {issue_size})")
    if now_size < issue_size:
        raise ValueError(f"tree head size {now_size} is older than the tree head at issue (size {issue_size})")
    fetch = leaf_hash_at if callable(leaf_hash_at) else leaf_hash_at.__getitem__
    if fetch(leaf_index) != audit_leaf_hash(signed):
        raise ValueError(f"leaf {leaf_index} of the log is not this receipt")
    return {
        "receipt": signed["receipt"],
        "signature": signed["signature"],
        "audit": {
            "leaf_index": leaf_index,
            "tree_head_at_issue": dict(sth_at_issue),
            "tree_head": dict(sth_now),
            "inclusion_proof": [h.hex() for h in merkle.inclusion_proof(leaf_index, now_size, leaf_hash_at)],
            "consistency_proof": [h.hex() for h in merkle.consistency_proof(issue_size, now_size, leaf_hash_at)],
        },
    }


# ---------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------


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
    """The receipt's ``node_keys`` as ``node (key id), …``; _Invalid unless a list of {node_id, key_id}."""
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


def _object(value: Any, what: str, fields: tuple[str, ...] | None = None, optional: tuple[str, ...] = ()) -> Mapping[str, Any]:
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
    if not isinstance(value, str) or len(value) != 2 * merkle.HASH_SIZE or not _LOWER_HEX.match(value):
        raise _Invalid(f"{what} is not {merkle.HASH_SIZE} bytes of lower-case hex")
    return bytes.fromhex(value)


def _canonical(value: Any, what: str) -> bytes:
    try:
        return canonical_json(value)
    except ValueError as error:
        raise _Invalid(f"{what} cannot be canonicalized (RFC 8785): {error}") from None


def _verify_signature(keys: Mapping[str, Ed25519PublicKey], key_id: Any, value: Any, message: bytes, what: str) -> str:
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
            problems.append(f"key #{position} algorithm is {entry.get('algorithm')!r}, not {SIGNATURE_ALGORITHM}")
            continue
        try:
            raw = base64.b64decode(entry.get("public_key"), validate=True) if isinstance(entry.get("public_key"), str) else b""
        except ValueError:  # binascii.Error, or non-ASCII text
            raw = b""
        if len(raw) != 32:
            problems.append(f"key #{position} public_key is not base64 of 32 bytes")
            continue
        if entry.get("key_id") != key_id_for(raw):
            problems.append(f"key #{position} key_id {entry.get('key_id')!r} is not derived from its public key ({key_id_for(raw)})")
            continue
        try:
            keys[key_id_for(raw)] = Ed25519PublicKey.from_public_bytes(raw)
        except ValueError:
            problems.append(f"key #{position} public_key is not a valid Ed25519 key")
    return keys, problems


def _parse_tree_head(value: Any, what: str) -> _TreeHead:
    head = _object(value, what, _STH_FIELDS)
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
        message = _tree_head_message(head.tree_size, head.root.hex(), head.timestamp, head.key_id)
    except ValueError as error:
        raise _Invalid(f"{what} cannot be canonicalized (RFC 8785): {error}") from None
    return _verify_signature(keys, head.key_id, head.signature, message, what) + f" over size {head.tree_size}"


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
            ordered += [("checkpoint_signature", self._checkpoint_signature), ("checkpoint_matches", self._checkpoint_matches)]
        return ordered

    def _keys_check(self) -> str:
        if self._key_problems:
            raise _Invalid("; ".join(self._key_problems))
        if not self._keys:
            raise _Invalid("the key document lists no keys")
        return f"{len(self._keys)} key(s), each key_id derived from its public key"

    def _receipt_format(self) -> str:
        top = _object(self._document, "the receipt document", ("receipt", "signature", "audit"))
        receipt = _object(top["receipt"], "receipt", _RECEIPT_FIELDS, _OPTIONAL_RECEIPT_FIELDS)
        if receipt["schema"] != RECEIPT_SCHEMA:
            raise _Invalid(f"receipt schema is {receipt['schema']!r}, not {RECEIPT_SCHEMA}")
        signature = _object(top["signature"], "signature", ("key_id", "algorithm", "value"))
        if signature["algorithm"] != SIGNATURE_ALGORITHM:
            raise _Invalid(f"signature algorithm is {signature['algorithm']!r}, not {SIGNATURE_ALGORITHM}")
        self._leaf = merkle.leaf_hash(_canonical({"receipt": receipt, "signature": signature}, "receipt"))
        self._receipt, self._signature = receipt, signature
        return (
            f"{RECEIPT_SCHEMA} receipt {receipt['receipt_id']} for erasure {receipt['erasure_id']};"
            f" evidence signed by {_node_keys_text(receipt['node_keys'])}"
        )

    def _receipt_signature(self) -> str:
        receipt = _require(self._receipt, "not checked: receipt_format failed")
        signature = self._signature
        return _verify_signature(self._keys, signature["key_id"], signature["value"], _canonical(receipt, "receipt"), "receipt")

    def _scope_coverage(self) -> str:
        """The erased blocks per cache scope, checked to add up to the block commitment's count."""
        receipt = _require(self._receipt, "not checked: receipt_format failed")
        if "blocks_by_scope" not in receipt:
            return "not stated: a receipt issued before per-scope coverage (its erasure matched user-scope blocks only)"
        counts = _object(receipt["blocks_by_scope"], "blocks_by_scope", SCOPE_COVERAGE_KEYS)
        numbers = {scope: _size(counts[scope], f"blocks_by_scope.{scope}") for scope in SCOPE_COVERAGE_KEYS}
        commitment = _object(receipt["block_commitment"], "block_commitment")
        committed = _size(commitment.get("count"), "block_commitment.count")
        if sum(numbers.values()) != committed:
            raise _Invalid(f"blocks_by_scope adds up to {sum(numbers.values())}, but the block commitment counts {committed}")
        return "erased blocks by scope: " + ", ".join(f"{scope} {count}" for scope, count in numbers.items())

    def _audit(self) -> Mapping[str, Any]:
        top = _object(self._document, "the receipt document")
        return _object(top.get("audit"), "audit", _AUDIT_FIELDS)

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
            raise _Invalid(f"leaf_index {index} is outside the tree head at issue (size {at_issue.tree_size})")
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
        if not merkle.verify_consistency(at_issue.tree_size, head.tree_size, at_issue.root, head.root, proof):
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
