"""Signed erasure receipts and signed tree heads of the audit log (verified offline by
``coordinator.audit.verifier``).

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

Builders and signers raise ValueError for bad caller input.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import rfc8785
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
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

LOWER_HEX = re.compile(r"^(?:[0-9a-f]{2})+$")
_SUBJECT_HASH = re.compile(r"^[0-9a-f]{64}$")
_NODE_KEY_ID = re.compile(r"^[0-9a-f]{32}$")
_MAX_ID_CHARS = 512
RECEIPT_FIELDS = (
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
OPTIONAL_RECEIPT_FIELDS = ("blocks_by_scope",)
"""Fields a receipt may lack: receipts issued before them stay valid (the signature covers whatever the body holds)."""
SCOPE_COVERAGE_KEYS = ("public", "tenant", "user", "unrecorded")
"""``blocks_by_scope``: erased blocks per cache scope, and ``unrecorded`` ones the ledger held no
provenance for."""
TREE_HEAD_FIELDS = ("tree_size", "root_hash", "timestamp", "key_id", "signature")
AUDIT_FIELDS = (
    "leaf_index",
    "tree_head_at_issue",
    "tree_head",
    "inclusion_proof",
    "consistency_proof",
)


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
        if (
            not isinstance(block_hash, str)
            or not LOWER_HEX.match(block_hash)
            or not 16 <= len(block_hash) // 2 <= 64
        ):
            raise ValueError(
                f"block hash must be lower-case hex of 16..64 bytes, got {block_hash!r}"
            )
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
    """A verification key as the key document lists it; also how retired keys stay listed after
    rotation."""

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
        raw = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.public_key = ReceiptPublicKey(raw, rfc3339(created_at or datetime.now(UTC)))

    @classmethod
    def from_pem(
        cls, pem: SecretStr | str | bytes, created_at: datetime | None = None
    ) -> ReceiptSigner:
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


def public_key_document(
    keys: Iterable[ReceiptSigner | ReceiptPublicKey],
) -> dict[str, list[dict[str, str]]]:
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
    """What one node did in one tier for an erasure. Only the digest of ``evidence`` enters the
    receipt."""

    node_id: str
    tier: str
    count: int
    method: str
    evidence: Any = field(repr=False)


def receipt_method(node_erase_method: str) -> str:
    """The receipt's NIST 800-88 term for a node's ``EraseMethod`` (see
    ``METHOD_FOR_NODE_ERASE_METHOD``)."""
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
        raise ValueError(
            "subject_hash must be the 64-hex-character keyed subject digest, never the subject id"
        )
    requested, verified = rfc3339(requested_at), rfc3339(verified_at)
    if verified_at < requested_at:
        raise ValueError("verified_at is before requested_at")
    entries = [_tier_entry(entry) for entry in tiers]
    entries.sort(key=lambda e: (e["node_id"], TIERS.index(e["tier"])))
    for previous, current in itertools.pairwise(entries):
        if (previous["node_id"], previous["tier"]) == (current["node_id"], current["tier"]):
            raise ValueError(
                f"two entries for node {current['node_id']!r} tier {current['tier']!r}"
            )
    destroyed = sorted({_identifier("key id", key_id) for key_id in key_ids_destroyed})
    signers = [
        {"node_id": node_id, "key_id": key_id}
        for node_id, key_id in sorted(
            {(_identifier("node_id", n), _node_key_id(k)) for n, k in node_keys}
        )
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
            raise ValueError(
                f"blocks_by_scope[{scope!r}] must be a non-negative integer, got {count!r}"
            )
    if sum(counts.values()) != num_blocks:
        raise ValueError(
            f"blocks_by_scope adds up to {sum(counts.values())}, but {num_blocks} distinct blocks were erased"
        )
    return {scope: counts[scope] for scope in SCOPE_COVERAGE_KEYS}


def sign_receipt(body: Mapping[str, Any], signer: ReceiptSigner) -> dict[str, Any]:
    """``{"receipt": body, "signature": {key_id, algorithm, value}}``; the signature covers
    canonical(body)."""
    if not isinstance(body, Mapping) or body.get("schema") != RECEIPT_SCHEMA:
        raise ValueError(f"not a {RECEIPT_SCHEMA} body")
    body = dict(body)
    return {
        "receipt": body,
        "signature": {
            "key_id": signer.key_id,
            "algorithm": SIGNATURE_ALGORITHM,
            "value": signer.sign(canonical_json(body)),
        },
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


def tree_head_message(tree_size: int, root_hash_hex: str, timestamp: str, key_id: str) -> bytes:
    return canonical_json(
        {
            "tree_size": tree_size,
            "root_hash": root_hash_hex,
            "timestamp": timestamp,
            "key_id": key_id,
        }
    )


def sign_tree_head(
    tree_size: int, root_hash: bytes, timestamp: datetime, signer: ReceiptSigner
) -> dict[str, Any]:
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
        "signature": signer.sign(tree_head_message(tree_size, root_hex, stamp, signer.key_id)),
    }


def serve_receipt(
    signed: Mapping[str, Any],
    leaf_index: int,
    sth_at_issue: Mapping[str, Any],
    sth_now: Mapping[str, Any],
    leaf_hash_at: merkle.LeafSource,
) -> dict[str, Any]:
    """The body of ``GET /v1/erasures/{id}/receipt``: the signed receipt plus the proofs to check it
    offline.

    ``sth_at_issue`` is the first tree head that contained the receipt; ``sth_now`` the
    latest one (or the one at the client's ``?tree_size=``). The inclusion proof is for
    the leaf in ``sth_now``; the consistency proof links ``sth_at_issue`` to ``sth_now``.
    ValueError when the caller's arguments cannot describe this receipt (wrong index,
    heads out of order); the proofs themselves are not re-verified here — a log that
    was tampered with must reach the client and fail *there*, in the open.
    """
    issue_size, now_size = sth_at_issue.get("tree_size"), sth_now.get("tree_size")
    if not all(
        isinstance(size, int) and not isinstance(size, bool) for size in (issue_size, now_size)
    ):
        raise ValueError("tree heads must come from sign_tree_head")
    if (
        not isinstance(leaf_index, int)
        or isinstance(leaf_index, bool)
        or not 0 <= leaf_index < issue_size
    ):
        raise ValueError(
            f"leaf_index {leaf_index!r} is not in the tree head at issue (size {issue_size})"
        )
    if now_size < issue_size:
        raise ValueError(
            f"tree head size {now_size} is older than the tree head at issue (size {issue_size})"
        )
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
            "inclusion_proof": [
                h.hex() for h in merkle.inclusion_proof(leaf_index, now_size, leaf_hash_at)
            ],
            "consistency_proof": [
                h.hex() for h in merkle.consistency_proof(issue_size, now_size, leaf_hash_at)
            ],
        },
    }
