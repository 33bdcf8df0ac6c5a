"""The disk tier's files: one at-rest record per block, and what the pool knows of each file.

The pool decides *which* block lives on disk and reports every change; this class
only reads, writes and deletes the files and keeps the per-file facts that spare
work later: each file's size (so disk bytes are a running total and a read is one
``read`` call), the exact meta bytes written (a disk hit whose authenticated meta
equals them needs no JSON parse) and the data key id in a sealed file's header (a
removal names the key without reading the file). It takes no lock: the pool calls
it under its own.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gpu_node.keys.crypto import DataKeyProvider, overwrite_and_unlink
from gpu_node.pool.block_records import (
    FLAG_PLAIN,
    FLAG_SEALED,
    HEADER,
    META_LENGTH,
    BlockRecord,
    BlockRestoreError,
    check_record,
    decode_block_record,
    encode_block_record,
    open_record,
    parse_record_body,
    record_key_id,
    record_meta,
)
from gpu_node.pool.kv_spec import KVBlockSpec
from prefix_keys.blocks import HASH_BYTES, BlockKey, CacheScope

FILE_DELETE_WORKERS = 4
"""Block files overwritten and unlinked at once by a bulk removal."""


class DiskTier:
    """Block files under ``directory`` (created private), named by block hash."""

    def __init__(
        self, directory: Path, namespace: str, spec: KVBlockSpec, key_provider: DataKeyProvider
    ) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._prefix = os.path.join(directory, "")
        self._namespace = namespace
        self._spec = spec
        self._key_provider = key_provider
        self.num_bytes = 0
        self._file_bytes: dict[bytes, int] = {}
        self.known_meta: dict[bytes, bytes] = {}
        """The exact meta bytes this pool wrote into (or checked in) each block file."""
        self._key_ids: dict[bytes, str] = {}

    def path(self, block_hash: bytes) -> Path:
        return self.directory / f"{block_hash.hex()}.kvb"

    def write(self, record: BlockRecord) -> bool:
        """Write the block file (sealed unless public); False when its scope has no data key."""
        meta = record_meta(record)
        data = encode_block_record(record, self._key_provider, meta)
        if data is None:
            return False
        block_hash = record.key.block_hash
        fd = os.open(self.path(block_hash), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        self.adopt(block_hash, data, meta)
        return True

    def adopt(self, block_hash: bytes, data: bytes, meta: bytes) -> None:
        """Remember the facts of a block file whose content is ``data`` with meta ``meta``."""
        self.num_bytes += len(data) - self._file_bytes.get(block_hash, 0)
        self._file_bytes[block_hash] = len(data)
        self.known_meta[block_hash] = meta
        key_id = record_key_id(data)
        if key_id is not None:
            self._key_ids[block_hash] = key_id

    def forget(self, block_hash: bytes) -> str | None:
        """Drop what is known of a block's file (it is gone or going); returns the data key id it
        named."""
        self.num_bytes -= self._file_bytes.pop(block_hash, 0)
        self.known_meta.pop(block_hash, None)
        return self._key_ids.pop(block_hash, None)

    def read_record(self, block_hash: bytes) -> BlockRecord:
        """The checked record of a block's file; :class:`BlockRestoreError` when it is missing or
        unusable."""
        try:
            data = self.path(block_hash).read_bytes()
        except FileNotFoundError:
            raise BlockRestoreError(block_hash, "file_missing") from None
        record = decode_block_record(data, self._key_provider)
        check_record(record, block_hash, self._namespace, self._spec)
        return record

    def payload(self, key: BlockKey, aeads: dict[str, tuple[bytes, AESGCM]]) -> bytes | memoryview:
        """The authenticated KV bytes of a block's file; :class:`BlockRestoreError` when missing or
        unusable.

        When the authenticated meta equals the bytes this pool wrote for the
        block, the header hash, the scope flag and the payload length are
        checked and the JSON is not parsed again: equal meta means the same
        key (block hash, namespace, provenance) and KV format as were checked
        when the block was admitted. Otherwise the record is fully parsed and
        checked, as for a file found at start. ``aeads`` caches keys for one batch.
        """
        block_hash = key.block_hash
        try:
            data = _read_file(
                self._prefix + block_hash.hex() + ".kvb", self._file_bytes.get(block_hash, 0)
            )
        except FileNotFoundError:
            raise BlockRestoreError(block_hash, "file_missing") from None
        header_hash, flags, body = open_record(data, self._key_provider, aeads)
        if header_hash != block_hash:
            raise BlockRestoreError(block_hash, "hash_mismatch")
        known_meta = self.known_meta.get(block_hash)
        meta_len = META_LENGTH.unpack_from(body)[0] if len(body) >= META_LENGTH.size else -1
        if (
            known_meta is not None
            and meta_len == len(known_meta)
            and body[4 : 4 + meta_len] == known_meta
        ):
            if (flags == FLAG_PLAIN) != (key.provenance.scope == CacheScope.PUBLIC):
                raise BlockRestoreError(block_hash, "scope_mismatch")
            payload = body[4 + meta_len :]
            if len(payload) != self._spec.block_bytes:
                raise BlockRestoreError(block_hash, "format_mismatch")
            return payload
        record, _ = parse_record_body(header_hash, flags, body)
        check_record(record, block_hash, self._namespace, self._spec)
        return record.payload

    def unlink_promoted(self, block_hash: bytes) -> None:
        """Unlink the file a block promoted out of the disk tier left, without the overwrite.

        The pool's promotion explains why no overwrite (``PoolReader._promote_batch`` in
        :mod:`gpu_node.pool.reads`)."""
        try:
            os.unlink(self._prefix + block_hash.hex() + ".kvb")
        except FileNotFoundError:
            pass
        self.forget(block_hash)

    def delete(self, block_hash: bytes) -> bool:
        """Overwrite and unlink a block's file; whether it is verifiably absent."""
        return overwrite_and_unlink(self.path(block_hash))

    def delete_many(self, block_hashes: Sequence[bytes]) -> list[bool]:
        """Overwrite and unlink block files in parallel; whether each is verifiably absent.

        Each overwrite is flushed to disk before its unlink; the flushes wait on
        the device, so running a few at once lets the file system commit them
        together (about half the time of one by one for thousands of files).
        """
        paths = [self.path(block_hash) for block_hash in block_hashes]
        if len(paths) < 2:
            return [overwrite_and_unlink(path) for path in paths]
        with ThreadPoolExecutor(
            max_workers=FILE_DELETE_WORKERS, thread_name_prefix="kvledger-unlink"
        ) as executor:
            return list(executor.map(overwrite_and_unlink, paths))

    def stored_files(self) -> Iterator[tuple[Path, bytes]]:
        """``(path, block hash)`` of every block file, in name order (files with other names are not
        blocks)."""
        for path in sorted(self.directory.glob("*.kvb")):
            block_hash = _hash_from_name(path.stem)
            if block_hash is not None:
                yield path, block_hash

    def open_stored(self, path: Path, block_hash: bytes) -> tuple[bytes, BlockRecord | None, bytes]:
        """A stored file's bytes, its checked record (None when unusable) and the meta bytes it holds.

        Asks the key service for a key not held (the blocking view: a start-up re-index runs before anyone waits on
        the pool), so that "cannot ask now" raises :class:`gpu_node.keys.crypto.KeyServiceUnavailable` instead of
        reading as "key destroyed" — the file is then not deleted as unreadable.
        """
        data = path.read_bytes()
        try:
            record, meta = parse_record_body(*open_record(data, self._key_provider.blocking()))
            check_record(record, block_hash, self._namespace, self._spec)
        except BlockRestoreError:
            return data, None, b""
        return data, record, meta


def is_sealed(data: bytes) -> bool:
    """Whether a record's clear header says sealed (ciphertext)."""
    return len(data) > HEADER.size and data[5] == FLAG_SEALED


def _read_file(path: str, size_hint: int) -> bytes:
    """A whole file in one ``read`` when ``size_hint`` is right (raises FileNotFoundError)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.read(fd, size_hint + 1)
        while True:
            more = os.read(fd, 1 << 20)
            if not more:
                return data
            data += more
    finally:
        os.close(fd)


def _hash_from_name(stem: str) -> bytes | None:
    try:
        block_hash = bytes.fromhex(stem)
    except ValueError:
        return None
    return block_hash if len(block_hash) == HASH_BYTES else None
