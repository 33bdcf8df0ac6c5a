"""The at-rest record format of a block: disk-tier files and snapshot shards share it.

A record carries the block's identity and provenance, its KV format, its wall-clock
expiry and the raw KV bytes. Public blocks are plaintext with a sha256 checksum;
tenant and user blocks are sealed with AES-256-GCM under their scope's data key, the
provenance inside the ciphertext, so a copied file says nothing about whose it is.
Only the clear header (magic, version, flags, block hash, and for sealed records the
data key id) can be read without a key.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gpu_node.keys.crypto import DataKeyProvider, seal, unseal
from gpu_node.pool.kv_spec import KVBlockSpec
from identity.sealing import KEY_BYTES
from prefix_keys.blocks import BlockKey, CacheProvenance, CacheScope


class BlockRestoreError(Exception):
    """A block's bytes could not be produced (corrupt, undecryptable, invalidated while held).

    The pool has already removed a corrupt or undecryptable entry when this is
    raised; the caller releases its references and falls back to prefill.
    """

    def __init__(self, block_hash: bytes, reason: str) -> None:
        super().__init__(f"block {block_hash.hex()[:16]} cannot be restored: {reason}")
        self.block_hash = block_hash
        self.reason = reason


MAGIC = b"KVLB"
RECORD_VERSION = 1
FLAG_PLAIN = 0
FLAG_SEALED = 1
HEADER = struct.Struct("<4sBB32s")
MAX_CLEAR_HEADER_BYTES = HEADER.size + 1 + 255
"""The longest clear header a record can have: the fixed header, then a sealed record's key id with its length byte."""
META_LENGTH = struct.Struct("<I")
CHECKSUM_BYTES = 32


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """A block as stored at rest: identity, KV format, wall-clock expiry and raw KV bytes."""

    key: BlockKey
    kv_format: str
    expires_at_wall: float | None
    payload: bytes


def _key_to_dict(key: BlockKey) -> dict:
    return {
        "block_hash": key.block_hash.hex(),
        "parent_hash": key.parent_hash.hex(),
        "index": key.index,
        "block_size": key.block_size,
        "provenance": key.provenance.to_dict(),
    }


def _key_from_dict(data: Mapping) -> BlockKey:
    return BlockKey(
        block_hash=bytes.fromhex(data["block_hash"]),
        parent_hash=bytes.fromhex(data["parent_hash"]),
        index=int(data["index"]),
        block_size=int(data["block_size"]),
        provenance=CacheProvenance.from_dict(data["provenance"]),
    )


def record_meta(record: BlockRecord) -> bytes:
    """The record's identity/format/expiry metadata as stored (compact JSON)."""
    return json.dumps(
        {
            "key": _key_to_dict(record.key),
            "kv_format": record.kv_format,
            "expires_at_wall": record.expires_at_wall,
        },
        separators=(",", ":"),
    ).encode()


def encode_block_record(
    record: BlockRecord, key_provider: DataKeyProvider, meta: bytes | None = None
) -> bytes | bytearray | None:
    """Serialize a block for disk or a snapshot; None when its scope has no data key available.

    Layout: ``KVLB ‖ version ‖ flags ‖ block_hash ‖ …``. Sealed (tenant/user):
    ``len(key_id) ‖ key_id ‖ AES-GCM(meta ‖ payload)``; the provenance is inside
    the ciphertext. Plain (public): ``meta ‖ payload ‖ sha256(everything before)``.
    A block without a key is never written in plaintext. ``meta`` may pass
    :func:`record_meta` of ``record`` when the caller already built it.
    """
    block_hash = record.key.block_hash
    if meta is None:
        meta = record_meta(record)
    body = META_LENGTH.pack(len(meta)) + meta + record.payload
    if record.key.provenance.scope == CacheScope.PUBLIC:
        head = HEADER.pack(MAGIC, RECORD_VERSION, FLAG_PLAIN, block_hash) + body
        return head + hashlib.sha256(head).digest()
    sealing = key_provider.key_for(record.key.provenance)
    if sealing is None:
        return None
    key_id, key = sealing
    key_id_bytes = key_id.encode("ascii")
    header = (
        HEADER.pack(MAGIC, RECORD_VERSION, FLAG_SEALED, block_hash)
        + bytes([len(key_id_bytes)])
        + key_id_bytes
    )
    return seal(key, key_id, block_hash, body, header)


def record_key_id(data: bytes) -> str | None:
    """The data key id in a sealed record's clear header; None for plaintext or a malformed header."""
    if record_block_hash(data) is None or data[5] != FLAG_SEALED or len(data) <= HEADER.size:
        return None
    key_id_end = HEADER.size + 1 + data[HEADER.size]
    if len(data) < key_id_end:
        return None
    try:
        return data[HEADER.size + 1 : key_id_end].decode("ascii")
    except UnicodeDecodeError:
        return None


def record_block_hash(data: bytes | bytearray) -> bytes | None:
    """The block hash in a record's clear header; None if the header is malformed."""
    if len(data) < HEADER.size:
        return None
    magic, version, _, block_hash = HEADER.unpack_from(data)
    return block_hash if magic == MAGIC and version == RECORD_VERSION else None


def open_record(
    data: bytes | bytearray,
    key_provider: DataKeyProvider,
    aeads: dict[str, tuple[bytes, AESGCM]] | None = None,
) -> tuple[bytes, int, bytes | memoryview]:
    """Authenticate a record: ``(header block hash, flags, body)``; raises :class:`BlockRestoreError`.

    ``body`` is ``len(meta) ‖ meta ‖ payload``, checksummed (plain) or
    decrypted (sealed). ``aeads`` caches key id → (key, AESGCM) for one batch
    only; a key destroyed before the batch is never found (``key_by_id`` is
    asked once per key id per batch).
    """
    block_hash = record_block_hash(data)
    if block_hash is None:
        raise BlockRestoreError(b"", "bad_header")
    flags = data[5]
    view = memoryview(data)
    if flags == FLAG_PLAIN:
        if (
            len(data) < HEADER.size + CHECKSUM_BYTES
            or hashlib.sha256(view[:-CHECKSUM_BYTES]).digest() != data[-CHECKSUM_BYTES:]
        ):
            raise BlockRestoreError(block_hash, "checksum_mismatch")
        return block_hash, flags, view[HEADER.size : -CHECKSUM_BYTES]
    if flags != FLAG_SEALED or len(data) <= HEADER.size:
        raise BlockRestoreError(block_hash, "bad_header")
    key_id_end = HEADER.size + 1 + data[HEADER.size]
    try:
        key_id = data[HEADER.size + 1 : key_id_end].decode("ascii")
    except UnicodeDecodeError:
        raise BlockRestoreError(block_hash, "bad_header") from None
    cached = None if aeads is None else aeads.get(key_id)
    if cached is None:
        key = key_provider.key_by_id(key_id)
        if key is None:
            raise BlockRestoreError(block_hash, "key_unavailable")
        aead = AESGCM(key) if aeads is not None and len(key) == KEY_BYTES else None
        if aead is not None:
            aeads[key_id] = (key, aead)
    else:
        key, aead = cached
    opened = unseal(key, key_id, block_hash, view[key_id_end:], aead)
    if opened is None:
        raise BlockRestoreError(block_hash, "decrypt_failed")
    return block_hash, flags, opened


def parse_record_body(
    block_hash: bytes, flags: int, body: bytes | memoryview
) -> tuple[BlockRecord, bytes]:
    """The record in an authenticated body and its raw meta bytes; checks hash and scope against the
    header."""
    try:
        (meta_len,) = META_LENGTH.unpack_from(body)
        meta_bytes = bytes(body[4 : 4 + meta_len])
        meta = json.loads(meta_bytes)
        key = _key_from_dict(meta["key"])
        expires_at_wall = meta["expires_at_wall"]
        record = BlockRecord(
            key,
            str(meta["kv_format"]),
            None if expires_at_wall is None else float(expires_at_wall),
            bytes(body[4 + meta_len :]),
        )
    except (struct.error, ValueError, KeyError, TypeError):
        raise BlockRestoreError(block_hash, "bad_metadata") from None
    if key.block_hash != block_hash:
        raise BlockRestoreError(block_hash, "hash_mismatch")
    if (flags == FLAG_PLAIN) != (key.provenance.scope == CacheScope.PUBLIC):
        raise BlockRestoreError(block_hash, "scope_mismatch")
    return record, meta_bytes


def decode_block_record(data: bytes, key_provider: DataKeyProvider) -> BlockRecord:
    """Parse and authenticate a record; raises :class:`BlockRestoreError` with the reason it is
    unusable."""
    block_hash, flags, body = open_record(data, key_provider)
    return parse_record_body(block_hash, flags, body)[0]


def check_record(record: BlockRecord, block_hash: bytes, namespace: str, spec: KVBlockSpec) -> None:
    """Raise :class:`BlockRestoreError` unless ``record`` is ``block_hash`` of ``namespace`` in
    ``spec``'s KV format."""
    if record.key.block_hash != block_hash:
        raise BlockRestoreError(block_hash, "hash_mismatch")
    if record.key.provenance.namespace != namespace:
        raise BlockRestoreError(block_hash, "namespace_mismatch")
    if record.kv_format != spec.kv_format or len(record.payload) != spec.block_bytes:
        raise BlockRestoreError(block_hash, "format_mismatch")


def tensor_bytes(kv: torch.Tensor) -> bytes:
    """A block's KV as the raw bytes a record stores."""
    return kv.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def payload_tensor(payload: bytes, spec: KVBlockSpec) -> torch.Tensor:
    """A record's raw KV bytes as a CPU tensor of ``spec``'s block shape (a private copy)."""
    return (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        .view(spec.dtype)
        .reshape(spec.block_shape)
    )
