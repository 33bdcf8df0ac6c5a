"""AES-256-GCM sealing of blocks at rest, and the data keys that seal them.

Blocks of tenant or user scope leave memory (disk tier, snapshots) only sealed
under a per-scope data key: one key per tenant for tenant scope, one per
(tenant, subject) for user scope. Destroying a key is then a cryptographic
erase of every copy sealed under it, wherever it lies (NIST 800-88 Purge) —
which is what makes a person's erasure verifiable for data on disk.

The AAD binds each ciphertext to its block hash and key id, so a sealed block
cannot be swapped for another block's file or replayed under another key.

Key ids are keyed hashes (HMAC under a per-store secret), never tenant or
subject ids in clear: they appear in block files and snapshot shards.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import struct
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol, TypeVar

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from events.schema import subject_digest
from identity.sealing import KEY_BYTES, KEY_ID_HEX_CHARS, NONCE_BYTES, TAG_BYTES
from identity.tokens import Principal
from prefix_keys.blocks import CacheProvenance, CacheScope

log = logging.getLogger(__name__)

_U32 = struct.Struct("<I")

T = TypeVar("T")


class KeyServiceUnavailable(Exception):
    """Whether a data key still exists could not be learned now (its service unreachable, or answering with an error).

    Raised only by :meth:`DataKeyProvider.blocking` views, for callers that must not mistake "cannot ask" for
    "destroyed": a snapshot's inventory (:func:`gpu_node.pool.snapshots.readable_blocks`) would otherwise tell the
    ledger that copies still on disk are gone. The message names no key.
    """


KEY_SERVICE_RETRY_S = (0.5, 5.0)
"""First and longest wait between attempts at start-up work that needs the key service to answer for
sealed copies (the longest: :data:`gpu_node.keys.remote_keys.UNREACHABLE_RETRY_S`, how long an
unanswered key is not asked for again)."""


async def until_key_service_answers(attempt: Callable[[], Awaitable[T]], what: str) -> T:
    """``attempt()`` retried with capped backoff for as long as it raises
    :class:`KeyServiceUnavailable`.

    For start-up work that must not mistake "cannot ask" for "destroyed" and has nothing better to
    do than wait: re-indexing the disk tier (a file whose key cannot be asked for would be deleted
    as unreadable) and the start inventory (it would tell the ledger a snapshot's sealed copies are
    gone). The node is not ready meanwhile, as while it fetches its governance state from the same
    coordinator."""
    wait_s, max_wait_s = KEY_SERVICE_RETRY_S
    while True:
        try:
            return await attempt()
        except KeyServiceUnavailable:
            log.warning(
                "%s: the key service cannot answer for sealed copies; trying again in %.1fs",
                what,
                wait_s,
            )
            await asyncio.sleep(wait_s)
            wait_s = min(wait_s * 2, max_wait_s)


class DataKeyProvider(Protocol):
    """Where data keys come from. Small on purpose: the coordinator will take over key custody."""

    def key_for(self, provenance: CacheProvenance) -> tuple[str, bytes] | None:
        """``(key_id, key)`` that seals blocks of this provenance's scope; None for public scope."""
        ...

    def key_by_id(self, key_id: str) -> bytes | None:
        """The key to unseal with; None once destroyed (or never known)."""
        ...

    def destroy(self, key_id: str) -> bool:
        """Crypto-erase every block sealed under ``key_id``.

        False if the key was not held, or if the key's authority keeps it live
        (a remote provider does not destroy what the key service still serves).
        """
        ...

    def subject_key_ids(self, tenant_id: str, subject_hash: str) -> list[str]:
        """Ids of the keys this provider could still unseal one subject's blocks with, by keyed digest.

        Erasure commands name a subject only by :func:`events.schema.subject_digest`,
        so the provider must find the subject's keys from the digest alone.
        """
        ...

    async def prefetch(self, principal: Principal) -> None:
        """Make the keys of ``principal``'s scopes local before a request looks blocks up.

        ``key_for`` and ``key_by_id`` run under the pool's lock; a provider whose keys live
        elsewhere answers them from memory only, and this is where it fetches (bounded).
        """
        ...

    def blocking(self) -> DataKeyProvider:
        """A view whose ``key_by_id``/``key_for`` fetch a key they do not hold: for callers outside the pool's lock.

        Its ``key_by_id`` answers None only when the key is known to be gone (destroyed, never issued); when
        that cannot be learned now it raises :class:`KeyServiceUnavailable`.
        """
        ...


def _aad(block_hash: bytes, key_id: str) -> bytes:
    return _U32.pack(len(block_hash)) + block_hash + key_id.encode("ascii")


def seal(
    key: bytes, key_id: str, block_hash: bytes, plaintext: bytes, header: bytes = b""
) -> bytearray:
    """``header ‖ nonce ‖ ciphertext ‖ tag`` under a fresh random 96-bit nonce.

    Encrypted straight into the one buffer it returns: a block's KV is hundreds of KB for a
    real model, and concatenating nonce, ciphertext and a caller's header afterwards would
    copy all of it twice more.
    """
    if len(key) != KEY_BYTES:
        raise ValueError(f"data keys are {KEY_BYTES} bytes, got {len(key)}")
    nonce = os.urandom(NONCE_BYTES)
    start = len(header) + NONCE_BYTES
    sealed = bytearray(start + len(plaintext) + TAG_BYTES)
    sealed[: len(header)] = header
    sealed[len(header) : start] = nonce
    AESGCM(key).encrypt_into(nonce, plaintext, _aad(block_hash, key_id), memoryview(sealed)[start:])
    return sealed


def unseal(
    key: bytes,
    key_id: str,
    block_hash: bytes,
    sealed: bytes | memoryview,
    aead: AESGCM | None = None,
) -> bytes | None:
    """The plaintext, or None when the ciphertext, block hash or key id does not authenticate.

    ``aead`` may pass an ``AESGCM(key)`` already built for ``key``: building one
    costs about as much as decrypting a 32 KiB block, so a batch of blocks under
    one key (a restored prefix) builds it once. Callers keep such an object no
    longer than the batch, so no key material outlives a key's destruction.
    """
    if len(key) != KEY_BYTES:
        raise ValueError(f"data keys are {KEY_BYTES} bytes, got {len(key)}")
    if len(sealed) < NONCE_BYTES + TAG_BYTES:
        return None
    nonce, ciphertext = bytes(sealed[:NONCE_BYTES]), sealed[NONCE_BYTES:]
    try:
        return (AESGCM(key) if aead is None else aead).decrypt(
            nonce, ciphertext, _aad(block_hash, key_id)
        )
    except InvalidTag:
        return None


def _length_prefixed(value: str) -> bytes:
    data = value.encode()
    return _U32.pack(len(data)) + data


def scope_label(tenant_id: str, subject_id: str | None = None) -> bytes:
    """Canonical bytes naming one key scope: a tenant, or one subject within a tenant."""
    if subject_id is None:
        return b"T" + _length_prefixed(tenant_id)
    return b"U" + _length_prefixed(tenant_id) + _length_prefixed(subject_id)


def provenance_label(provenance: CacheProvenance) -> bytes | None:
    """The key scope a block is sealed under; None for public blocks, which are not encrypted."""
    if provenance.scope == CacheScope.PUBLIC:
        return None
    assert provenance.tenant_id is not None, "tenant and user scope blocks always carry a tenant id"
    if provenance.scope == CacheScope.TENANT:
        return scope_label(provenance.tenant_id)
    assert provenance.subject_id is not None, "user scope blocks always carry a subject id"
    return scope_label(provenance.tenant_id, provenance.subject_id)


class LocalKeyStore:
    """Data keys kept in a 0600 JSON file under the node's data directory.

    File layout: ``id_secret`` (HMAC key for ids), ``keys`` (key id → hex key),
    ``generations`` (hashed scope label → generation), ``subjects`` (hashed
    (tenant, subject digest) → hashed scope label). A destroyed key bumps its
    scope's generation, so the scope's next block gets a *new* key id and the
    destroyed id stays dead. Nothing in the file names a tenant or subject.

    ``subject_key`` is the deployment's subject digest key: with it the store
    indexes user-scope keys by the subject's keyed digest, which is all an
    erasure command carries (:meth:`subject_key_ids`). Without it (a node with
    no ledger) user keys can only be found from the raw subject id.

    Rewrites replace the file atomically, then overwrite the old file's bytes in
    place through a descriptor still open on it, so a destroyed key does not
    linger in the unlinked inode (best effort on copy-on-write filesystems).
    """

    def __init__(self, path: Path, subject_key: bytes | None = None) -> None:
        if subject_key is not None and len(subject_key) < 16:
            raise ValueError("the subject digest key must be at least 16 bytes")
        self._path = Path(path)
        self._subject_key = subject_key
        self._lock = threading.RLock()
        if self._path.exists():
            os.chmod(self._path, 0o600)
            data = json.loads(self._path.read_text())
            self._id_secret = bytes.fromhex(data["id_secret"])
            self._keys = {key_id: bytes.fromhex(key) for key_id, key in data["keys"].items()}
            self._generations = {label: int(gen) for label, gen in data["generations"].items()}
            self._subjects: dict[str, str] = dict(data.get("subjects", {}))
        else:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._id_secret = os.urandom(32)
            self._keys: dict[str, bytes] = {}
            self._generations: dict[str, int] = {}
            self._subjects = {}
            self._write()

    @property
    def path(self) -> Path:
        return self._path

    def _label_digest(self, label: bytes) -> str:
        return hmac.new(
            self._id_secret, b"kvledger/key-label/v1\x00" + label, hashlib.sha256
        ).hexdigest()[:KEY_ID_HEX_CHARS]

    def _key_id(self, label_digest: str, generation: int) -> str:
        message = b"kvledger/key-id/v1\x00" + label_digest.encode() + _U32.pack(generation)
        return hmac.new(self._id_secret, message, hashlib.sha256).hexdigest()[:KEY_ID_HEX_CHARS]

    def _subject_index(self, tenant_id: str, subject_hash: str) -> str:
        message = b"kvledger/subject-index/v1\x00" + scope_label(tenant_id, subject_hash)
        return hmac.new(self._id_secret, message, hashlib.sha256).hexdigest()[:KEY_ID_HEX_CHARS]

    def _current_key_id(self, label: bytes) -> tuple[str, str]:
        label_digest = self._label_digest(label)
        return label_digest, self._key_id(label_digest, self._generations.get(label_digest, 0))

    def key_for(self, provenance: CacheProvenance) -> tuple[str, bytes] | None:
        label = provenance_label(provenance)
        if label is None:
            return None
        with self._lock:
            label_digest, key_id = self._current_key_id(label)
            key = self._keys.get(key_id)
            if key is None:
                key = os.urandom(KEY_BYTES)
                self._keys[key_id] = key
                self._generations.setdefault(label_digest, 0)
                if provenance.scope == CacheScope.USER and self._subject_key is not None:
                    assert provenance.tenant_id is not None and provenance.subject_id is not None, (
                        "user blocks name both"
                    )
                    digest = subject_digest(
                        self._subject_key, provenance.tenant_id, provenance.subject_id
                    )
                    self._subjects[self._subject_index(provenance.tenant_id, digest)] = label_digest
                self._write()
            return key_id, key

    def key_by_id(self, key_id: str) -> bytes | None:
        with self._lock:
            return self._keys.get(key_id)

    async def prefetch(self, principal: Principal) -> None:
        """Nothing to fetch: every key of this store is local."""

    def blocking(self) -> LocalKeyStore:
        return self

    def current_key_id(self, tenant_id: str, subject_id: str | None = None) -> str | None:
        """Id of the live key of a tenant (or of one subject in it), for erasure to destroy; None if
        none."""
        with self._lock:
            _, key_id = self._current_key_id(scope_label(tenant_id, subject_id))
            return key_id if key_id in self._keys else None

    def subject_key_ids(self, tenant_id: str, subject_hash: str) -> list[str]:
        """The subject's live key id (a list of at most one); [] if none or the store has no subject
        key."""
        with self._lock:
            label_digest = self._subjects.get(self._subject_index(tenant_id, subject_hash))
            if label_digest is None:
                return []
            key_id = self._key_id(label_digest, self._generations.get(label_digest, 0))
            return [key_id] if key_id in self._keys else []

    def destroy(self, key_id: str) -> bool:
        with self._lock:
            if key_id not in self._keys:
                return False
            del self._keys[key_id]
            for label_digest, generation in self._generations.items():
                if self._key_id(label_digest, generation) == key_id:
                    self._generations[label_digest] = generation + 1
                    break
            self._write()
            return True

    def _write(self) -> None:
        payload = json.dumps(
            {
                "version": 1,
                "id_secret": self._id_secret.hex(),
                "keys": {key_id: key.hex() for key_id, key in sorted(self._keys.items())},
                "generations": dict(sorted(self._generations.items())),
                "subjects": dict(sorted(self._subjects.items())),
            }
        ).encode()
        tmp = self._path.with_name(self._path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)
        old_fd = os.open(self._path, os.O_WRONLY) if self._path.exists() else None
        try:
            os.replace(tmp, self._path)
            if old_fd is not None:
                _overwrite_with_zeros(old_fd)
        finally:
            if old_fd is not None:
                os.close(old_fd)


def overwrite_and_unlink(path: Path) -> bool:
    """Zero a file's bytes, then unlink it; True when the path is verifiably absent afterwards.

    Unlinking alone leaves the bytes in free filesystem blocks; overwriting first
    is NIST 800-88 Clear for plaintext and belt-and-braces for sealed data whose
    key stays alive (a tenant key outlives one document's invalidation).
    """
    try:
        fd = os.open(path, os.O_WRONLY)
    except FileNotFoundError:
        return True
    try:
        _overwrite_with_zeros(fd)
    finally:
        os.close(fd)
    os.unlink(path)
    return not os.path.lexists(path)


def _overwrite_with_zeros(fd: int) -> None:
    """Zero a file's current bytes through ``fd`` and flush them to disk."""
    size = os.fstat(fd).st_size
    os.lseek(fd, 0, os.SEEK_SET)
    chunk = b"\x00" * min(size, 1 << 20)
    remaining = size
    while remaining > 0:
        remaining -= os.write(fd, chunk[: min(remaining, len(chunk))])
    os.fsync(fd)
