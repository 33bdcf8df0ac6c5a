"""Pure cache-identity types and block hashing.

This module is the vLLM ``kv_cache_utils.py`` of kvledger: it knows nothing of torch, storage or
HTTP, so a node and a router derive the very same keys from it. Everything that decides *whether two
requests may share a block* lives here, so it can be unit-tested with exact hash values and so the
rest of the node cannot accidentally derive a key from client-supplied data.

Key derivation (docs/design.md §2)::

    h_0 = H(namespace)
    h_i = H(h_{i-1} ‖ scope_salt_i ‖ token_ids_i ‖ extra_i)

Every field is length-prefixed, token ids are packed as little-endian u32 and policy versions as
little-endian u64 (:data:`TENANT_SALT_TAG`), so the byte encoding is canonical (no str/pickle
ambiguity between ``[1, 23]`` and ``[12, 3]``). The salt is derived from :class:`Principal`, which
is only ever built from a verified JWT."""

from __future__ import annotations

import hashlib
import struct
import time
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

from events.schema import MAX_LIST_ITEMS, MAX_SAFE_INT
from identity.tokens import Principal

HASH_BYTES = 32
DEFAULT_BLOCK_SIZE = 16

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_sha256 = hashlib.sha256

TENANT_SALT_TAG = b"T2"
"""Format tag of a tenant-scope salt. ``T2``: each policy version packed as little-endian u64, so every
version a token may carry (0..2^53-1, ``events.schema.MAX_SAFE_INT``) has an encoding. The first format
(``T``) packed u32 and failed on versions from 2^32; its blocks are never looked up again."""


class CacheScope(IntEnum):
    """Sharing scope of a prompt segment, ordered from widest to strictest.

    The order matters: a block's scope is the *maximum* scope of any token in
    the prefix up to the block's end (scope along a prompt is monotone).
    """

    PUBLIC = 0
    TENANT = 1
    USER = 2

    @classmethod
    def parse(cls, value: str) -> CacheScope:
        try:
            return cls[value.upper()]
        except KeyError:
            raise ValueError(
                f"unknown cache_scope {value!r}; expected public, tenant or user"
            ) from None

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True, slots=True)
class DocumentRef:
    """A versioned document whose tokens appear in the prompt."""

    doc_id: str
    version: int
    auth_scope: str

    @property
    def tag(self) -> str:
        return f"{self.doc_id}@{self.version}"


# Auth scope recorded for tenant-scope messages that are not documents: they are
# shared by the whole tenant, under the tenant-wide policy version.
TENANT_WIDE_AUTH_SCOPE = "*"


@dataclass(frozen=True, slots=True)
class Segment:
    """A contiguous token span of the rendered prompt with one cache scope."""

    start: int
    end: int
    scope: CacheScope
    document: DocumentRef | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"bad segment span [{self.start}, {self.end})")
        if self.document is not None and self.scope != CacheScope.TENANT:
            raise ValueError("a document segment is tenant scope")

    @property
    def auth_scope(self) -> str | None:
        if self.document is not None:
            return self.document.auth_scope
        return TENANT_WIDE_AUTH_SCOPE if self.scope == CacheScope.TENANT else None


@dataclass(frozen=True, slots=True)
class CacheProvenance:
    """Whose data a cached block holds, as the node salts, seals and matches it. Travels with the block to every tier.

    It names the subject as the node knows it; the ledger's record of the same facts
    is :class:`events.schema.BlockProvenance` (subject as a keyed digest, plus the
    block's hash and position), built from this one by the publisher.

    ``creator_subject_id`` is the keyed digest (:func:`events.schema.subject_digest`) of
    the subject whose request created the block, in every scope, so an erasure of that
    subject reaches the public and tenant blocks holding its text. A digest, not the raw
    id, because a public block's record lies on disk in plaintext. A block later hit by
    another subject keeps its creator. ``None`` on a node without the subject key and in
    records written before the field existed.
    """

    namespace: str
    tenant_id: str | None
    scope: CacheScope
    auth_scopes: tuple[tuple[str, int], ...]
    subject_id: str | None
    documents: tuple[str, ...]
    created_at: float
    creator_subject_id: str | None = None

    def to_dict(self) -> dict:
        return {
            "namespace": self.namespace,
            "tenant_id": self.tenant_id,
            "scope": self.scope.label,
            "auth_scopes": [[scope, version] for scope, version in self.auth_scopes],
            "subject_id": self.subject_id,
            "documents": list(self.documents),
            "created_at": self.created_at,
            "creator_subject_id": self.creator_subject_id,
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> CacheProvenance:
        return cls(
            namespace=data["namespace"],
            tenant_id=data["tenant_id"],
            scope=CacheScope.parse(data["scope"]),
            auth_scopes=tuple((scope, int(version)) for scope, version in data["auth_scopes"]),
            subject_id=data["subject_id"],
            documents=tuple(data["documents"]),
            created_at=float(data["created_at"]),
            creator_subject_id=data.get("creator_subject_id"),
        )


class BlockKey(NamedTuple):
    """Identity of one full block: its chained hash, parent, position and provenance.

    A NamedTuple rather than a dataclass because a long prompt creates hundreds
    of these per request and construction cost is part of the hashing budget.
    Consecutive blocks with the same provenance share one provenance object.
    """

    block_hash: bytes
    parent_hash: bytes
    index: int  # type: ignore[assignment]  # the block's position; shadows tuple.index
    block_size: int
    provenance: CacheProvenance

    @property
    def hex(self) -> str:
        return self.block_hash.hex()

    @property
    def token_offset(self) -> int:
        return self.index * self.block_size


def _field(data: bytes) -> bytes:
    return _U32.pack(len(data)) + data


def _text(value: str | None) -> bytes:
    return _field(b"" if value is None else value.encode())


def namespace_root(namespace: str) -> bytes:
    """``h_0``: the chain root. Different namespaces can never share any block."""
    return hashlib.sha256(b"kvledger/ns/v1\x00" + namespace.encode()).digest()


def scope_salt(
    scope: CacheScope,
    principal: Principal,
    auth_scopes: Sequence[tuple[str, int]],
) -> bytes:
    """Canonical salt bytes for one block, derived only from verified claims.

    public → empty; tenant → tenant id + (auth scope, policy version as u64) pairs;
    user → tenant id + subject id.
    """
    if scope == CacheScope.PUBLIC:
        return b""
    if scope == CacheScope.TENANT:
        parts = [TENANT_SALT_TAG, _text(principal.tenant_id), _U32.pack(len(auth_scopes))]
        for auth_scope, version in auth_scopes:
            assert 0 <= version <= MAX_SAFE_INT, (
                "a Principal's policy versions come from a verified token (0..2^53-1)"
            )
            parts.append(_text(auth_scope))
            parts.append(_U64.pack(version))
        return b"".join(parts)
    return b"U" + _text(principal.tenant_id) + _text(principal.subject_id)


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Little-endian u32 packing: the canonical byte form of token ids."""
    packed = array("I", token_ids)
    if packed.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte unsigned int
        raise RuntimeError("array('I') is not 32-bit on this platform")
    return packed.tobytes() if _LITTLE_ENDIAN else _byteswapped(packed)


def _byteswapped(packed: array) -> bytes:  # pragma: no cover - big-endian hosts only
    packed.byteswap()
    return packed.tobytes()


_LITTLE_ENDIAN = struct.pack("=I", 1) == struct.pack("<I", 1)


def hash_block(parent: bytes, salt: bytes, packed_tokens: bytes, extra: bytes) -> bytes:
    """``h_i = H(h_{i-1} ‖ salt ‖ tokens ‖ extra)`` with length-prefixed fields."""
    assert len(parent) == HASH_BYTES, f"parent hash must be {HASH_BYTES} bytes, got {len(parent)}"
    return _sha256(_field(salt).join((parent, _field(packed_tokens) + _field(extra)))).digest()


def validate_segments(segments: Sequence[Segment], num_tokens: int) -> None:
    """Segments must tile ``[0, num_tokens)`` in order without gaps."""
    position = 0
    for segment in segments:
        if segment.start != position:
            raise ValueError(
                f"segments must be contiguous: expected start {position}, got {segment.start}"
            )
        position = segment.end
    if position != num_tokens:
        raise ValueError(f"segments cover {position} tokens, prompt has {num_tokens}")


def num_cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """Full blocks that may be cached: the last prompt token is always recomputed (its logits are
    needed)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    return max(num_tokens - 1, 0) // block_size


def compute_block_keys(
    namespace: str,
    token_ids: Sequence[int],
    segments: Sequence[Segment],
    principal: Principal,
    block_size: int = DEFAULT_BLOCK_SIZE,
    adapter: str | None = None,
    now: float | None = None,
    creator_subject_id: str | None = None,
) -> list[BlockKey]:
    """Chained keys and provenance for every cacheable full block of a prompt.

    Scope is monotone along the prompt: block *i* takes the strictest scope of
    any token in ``[0, end_i)``. Provenance accumulates every document and auth
    scope seen so far, because a block's KV depends on all tokens before it.
    ``creator_subject_id`` (the requester's keyed subject digest) is recorded on
    every block as its creator.

    ValueError when a block would list more documents or auth scopes than a
    kv-event carries (:data:`events.schema.MAX_LIST_ITEMS`): such a block could be
    cached but never reported to the ledger, so it is refused rather than cut
    short. The API refuses such prompts first, naming the limit.
    """
    validate_segments(segments, len(token_ids))
    created_at = time.time() if now is None else now
    num_blocks = num_cacheable_blocks(len(token_ids), block_size)
    packed = pack_token_ids(token_ids[: num_blocks * block_size])
    adapter_field = _text(adapter)
    token_length = _U32.pack(block_size * 4)
    stride = block_size * 4

    keys: list[BlockKey] = []
    append = keys.append
    parent = namespace_root(namespace)
    scope = CacheScope.PUBLIC
    auth_scopes: dict[str, int] = {}
    documents: dict[str, None] = {}
    provenance: CacheProvenance | None = None
    salt_field = b""
    segment_index = 0
    index = 0
    while index < num_blocks:
        start, end = index * block_size, (index + 1) * block_size
        block_documents: list[str] = []
        changed = provenance is None
        # Walk every segment that overlaps [start, end); a segment longer than
        # the block stays current for the next block.
        while segment_index < len(segments):
            segment = segments[segment_index]
            if segment.start >= end:
                break
            if (
                segment.end > start and segment.end > segment.start
            ):  # an empty segment holds no token
                if segment.scope > scope:
                    scope, changed = segment.scope, True
                auth_scope = segment.auth_scope
                if auth_scope is not None and auth_scope not in auth_scopes:
                    auth_scopes[auth_scope] = principal.policy_version(auth_scope)
                    changed = True
                if segment.document is not None:
                    tag = segment.document.tag
                    block_documents.append(tag)
                    if tag not in documents:
                        documents[tag] = None
                        changed = True
            if segment.end > end:
                break
            segment_index += 1
        if changed:
            _check_provenance_size(index, len(documents), len(auth_scopes))
            sorted_auth = tuple(sorted(auth_scopes.items()))
            salt_field = _field(scope_salt(scope, principal, sorted_auth))
            provenance = CacheProvenance(
                namespace=namespace,
                tenant_id=None if scope == CacheScope.PUBLIC else principal.tenant_id,
                scope=scope,
                auth_scopes=sorted_auth,
                subject_id=principal.subject_id if scope == CacheScope.USER else None,
                documents=tuple(documents),
                created_at=created_at,
                creator_subject_id=creator_subject_id,
            )
        assert provenance is not None, "the first block always builds its provenance"
        extra_field = _field(adapter_field + _field("\x00".join(block_documents).encode()))
        block_hash = _sha256(
            b"".join((parent, salt_field, token_length, packed[start * 4 : end * 4], extra_field))
        ).digest()
        append(BlockKey(block_hash, parent, index, block_size, provenance))
        parent = block_hash
        index += 1
        # Fast path: the following blocks lie wholly inside the current segment,
        # which this block already entered (so scope, auth scopes and documents are
        # walked): salt and provenance are unchanged and the block's extra holds
        # only this segment's document. Only tokens and parent move.
        if segment_index < len(segments) and segments[segment_index].start < end:
            segment = segments[segment_index]
            last_inside = min(segment.end // block_size, num_blocks)
            prefix = salt_field + token_length
            tags = segment.document.tag if segment.document is not None else ""
            suffix = _field(adapter_field + _field(tags.encode()))
            while index < last_inside:
                offset = index * stride
                block_hash = _sha256(
                    b"".join((parent, prefix, packed[offset : offset + stride], suffix))
                ).digest()
                append(BlockKey(block_hash, parent, index, block_size, provenance))
                parent = block_hash
                index += 1
    return keys


def _check_provenance_size(index: int, num_documents: int, num_auth_scopes: int) -> None:
    for what, count in (("documents", num_documents), ("auth scopes", num_auth_scopes)):
        if count > MAX_LIST_ITEMS:
            raise ValueError(
                f"block {index} would hold {count} {what}; a block's provenance carries at most {MAX_LIST_ITEMS}"
            )
