"""Replicas: a node pulls the cached blocks of a prefix from the peer that holds them instead of
recomputing them.

Why: a prefix computed on one node is worth nothing to another that misses it, yet the
KV of a long prompt crosses a network in a fraction of its prefill. Why not simply copy:
the blocks are tenants' and users' data, and a copy must be as governed as the original.
So (docs/architecture.md "Replicas", docs/security.md "Replicas"):

* **Who may ask.** The puller signs each request with its own enrolled node key: a
  peer credential (:func:`identity.node_credentials.issue_peer_credential`) bound to the
  holder's node id and to the sha256 of the request body. The holder looks the key id up
  in the coordinator's node registry (``GET /v1/nodes/peer-keys/{key_id}``, asked with
  the holder's own node credential) and trusts an answer for ``peers.key_cache_s``; an
  unknown or revoked key is refused (401), a node of another namespace — by the
  registry's record and by the request — too (403). A retired namespace serves nothing (409).
* **Where to.** A pull hint names a node id only; the puller resolves it in its own
  ``peers.urls`` (trusted configuration). A hint naming a node it does not know is a
  counted fallback, never a connection: no client can make a node fetch a URL.
* **What travels.** The holder serves only the READY, unexpired run of the asked block
  hashes from the first one, as at-rest records (:mod:`gpu_node.pool.block_records`):
  tenant and user blocks sealed with AES-256-GCM under their scope's data key, the
  block hash as associated data, exactly as the disk tier stores them; public blocks
  plaintext with their checksum. A tombstoned, invalidated or expiring block is never
  served. The puller opens each record with its own key provider (a node that cannot
  fetch the key cannot read the block), checks it is the asked hash, namespace and KV
  format, and stops at the first that fails.
* **Where it lands.** In the BUILDING entries its request claimed (single-flighted like
  builds: other requests for the prefix wait on the same claims), committed through
  :meth:`gpu_node.pool.block_pool.BlockPool.commit_build`, so an invalidation or erasure
  that ran during the pull tombstoned the claim and the pulled bytes are discarded. The
  versions are checked again after the pull. The replica's ``BlockStored`` names its
  source node and time (``events.schema.ReplicaOrigin``).

Anything that fails — unknown peer, refusal, unreachable, timeout, a truncated body, a
record that does not open — falls back to recompute, counted in
``kvledger_peer_pulls_total{outcome}``; the cache is an optimisation, never a reason to fail.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import http.client
import json
import logging
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import httpx
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpu_node.keys.crypto import DataKeyProvider
from gpu_node.pool.block_pool import BlockPool
from gpu_node.pool.block_records import (
    BlockRecord,
    BlockRestoreError,
    check_record,
    encode_block_record,
    open_record,
    parse_record_body,
    payload_tensor,
)
from gpu_node.pool.kv_spec import KVBlockSpec
from gpu_node.pool.vocabulary import CacheEntry
from gpu_node.settings import PeerSettings
from identity.node_credentials import (
    CredentialError,
    credential_key_id,
    issue_peer_credential,
    verify_peer_credential,
)
from identity.signing import public_key_from_raw
from prefix_keys.blocks import HASH_BYTES

log = logging.getLogger(__name__)

PULL_PATH = "/v1/kvledger/peer/blocks"
FRAME_LENGTH = struct.Struct("<I")
MAX_RECORD_OVERHEAD_BYTES = 64 * 1024
"""A record is its block's KV bytes plus a header, a key id, the metadata JSON (bounded provenance) and a tag."""
PEER_CREDENTIAL_TTL_S = 30
MAX_PEER_KEYS_CACHED = 1024


@dataclass(frozen=True, slots=True)
class PullHint:
    """A router's advice: ``node_id`` holds the first ``num_blocks`` blocks of this request's
    prefix."""

    node_id: str
    num_blocks: int


class PullFailed(Exception):
    """A pull that brought nothing usable; ``reason`` labels ``kvledger_peer_pulls_total{outcome}``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class PullRefused(Exception):
    """A holder's refusal of a pull request: HTTP ``status`` with a machine-readable ``code``."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


class PullRequestBody(BaseModel):
    """What a puller asks a holder for: the block hashes of one prefix, first block first."""

    model_config = ConfigDict(extra="forbid")

    namespace: str = Field(min_length=1, max_length=256)
    block_hashes: list[str] = Field(min_length=1, max_length=65_536)


def max_record_bytes(spec: KVBlockSpec) -> int:
    return spec.block_bytes + MAX_RECORD_OVERHEAD_BYTES


def frame_chunks(records: Sequence[bytes | bytearray]) -> Iterator[bytes | memoryview]:
    """``len ‖ record`` for each record, as the pieces a pull response is written in.

    Pieces, not one joined body: a prefix of a real model is tens to hundreds of MB, and
    joining it would copy every byte once more before the first one is sent. Records are
    handed out as views (what an ASGI body may be besides bytes), never copied.
    """
    for record in records:
        yield FRAME_LENGTH.pack(len(record))
        yield memoryview(record)


def frames_length(records: Sequence[bytes | bytearray]) -> int:
    """The byte length of :func:`frame_chunks` of ``records`` (the response's Content-Length)."""
    return sum(FRAME_LENGTH.size + len(record) for record in records)


class _ReadInto(Protocol):
    def readinto(self, buffer: memoryview, /) -> int | None: ...


def _read_into(stream: _ReadInto, view: memoryview) -> int:
    """Fill ``view`` from ``stream``; how many bytes arrived (fewer only at the end of the stream)."""
    num_read = 0
    while num_read < len(view):
        got = stream.readinto(view[num_read:])
        if not got:
            break
        num_read += got
    return num_read


def read_frames(stream: _ReadInto, max_records: int, max_record: int) -> list[bytearray]:
    """The records of a pull response, each read straight into a buffer of its own size;
    :class:`PullFailed` ``malformed`` when the stream is not whole frames within bounds."""
    records: list[bytearray] = []
    length = bytearray(FRAME_LENGTH.size)
    while True:
        num_read = _read_into(stream, memoryview(length))
        if num_read == 0:
            return records
        if num_read < FRAME_LENGTH.size or len(records) == max_records:
            raise PullFailed("malformed")
        (num_bytes,) = FRAME_LENGTH.unpack(length)
        if num_bytes > max_record:
            raise PullFailed("malformed")
        record = bytearray(num_bytes)
        if _read_into(stream, memoryview(record)) < num_bytes:
            raise PullFailed("malformed")
        records.append(record)


# --- holder --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PeerKey:
    node_id: str
    public_key: Ed25519PublicKey
    namespace: str | None


class PeerKeys:
    """Enrolled, unrevoked peer keys by id, as the coordinator's registry answers, each trusted for
    ``cache_s``.

    Unknown and revoked ids are never cached (a new enrollment works at once; a revoked
    key is asked about again). ``credential`` makes this node's own key-service credential.
    """

    def __init__(
        self, coordinator_url: str, credential: Callable[[], str], cache_s: float, timeout_s: float
    ) -> None:
        self._client = httpx.AsyncClient(base_url=coordinator_url, timeout=timeout_s)
        self._credential = credential
        self._cache_s = cache_s
        self._cached: dict[str, tuple[float, PeerKey]] = {}

    async def aclose(self) -> None:
        await self._client.aclose()

    async def lookup(self, key_id: str) -> PeerKey | None:
        """The key, or None when the registry has no live key of that id; PullRefused 503 when it
        cannot be asked."""
        now = time.monotonic()
        cached = self._cached.get(key_id)
        if cached is not None and now - cached[0] < self._cache_s:
            return cached[1]
        self._cached.pop(key_id, None)
        try:
            response = await self._client.get(
                f"/v1/nodes/peer-keys/{key_id}",
                headers={"Authorization": f"Bearer {self._credential()}"},
            )
        except httpx.HTTPError as error:
            log.warning("the peer key registry could not be asked: %s", type(error).__name__)
            raise PullRefused(
                503,
                "peer_registry_unavailable",
                "the coordinator's node registry cannot be asked now",
            ) from None
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            log.warning("the peer key registry answered %d", response.status_code)
            raise PullRefused(
                503,
                "peer_registry_unavailable",
                "the coordinator's node registry cannot be asked now",
            )
        try:
            data = response.json()
            raw = base64.urlsafe_b64decode(
                data["public_key"] + "=" * (-len(data["public_key"]) % 4)
            )
            key = PeerKey(str(data["node_id"]), public_key_from_raw(raw), data["namespace"])
        except (ValueError, KeyError, TypeError, binascii.Error):
            log.error("the peer key registry answered with a malformed key")
            raise PullRefused(
                503, "peer_registry_unavailable", "the coordinator's node registry answered badly"
            ) from None
        if len(self._cached) >= MAX_PEER_KEYS_CACHED:
            self._cached.pop(next(iter(self._cached)))
        self._cached[key_id] = (now, key)
        return key


async def authorize_pull(
    peer_keys: PeerKeys | None,
    authorization: str | None,
    body: bytes,
    holder_id: str,
    namespace: str,
    retired: bool,
) -> tuple[str, list[bytes]]:
    """``(puller node id, asked block hashes)`` of a pull request this holder may serve;
    :class:`PullRefused` otherwise."""
    if peer_keys is None:
        raise PullRefused(
            503,
            "peer_registry_unavailable",
            "this node serves pulls only with a coordinator to check peers against",
        )
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise PullRefused(
            401, "missing_token", "a pull needs 'Authorization: Bearer <peer credential>'"
        )
    token = token.strip()
    try:
        key_id = credential_key_id(token)
        key = await peer_keys.lookup(key_id)
        if key is None:
            raise PullRefused(
                401, "unknown_node_key", "the credential's key is not enrolled, or was revoked"
            )
        verify_peer_credential(
            token, key.public_key, key.node_id, holder_id, hashlib.sha256(body).hexdigest()
        )
    except CredentialError as error:
        raise PullRefused(401, error.code, error.message) from None
    try:
        request = PullRequestBody.model_validate(json.loads(body))
        hashes = [bytes.fromhex(block_hash) for block_hash in request.block_hashes]
    except (ValueError, ValidationError):
        raise PullRefused(
            400, "invalid_pull_request", "a pull request is {namespace, block_hashes: [hex]}"
        ) from None
    if any(len(block_hash) != HASH_BYTES for block_hash in hashes):
        raise PullRefused(400, "invalid_pull_request", f"block hashes are {HASH_BYTES} bytes")
    if key.namespace != namespace or request.namespace != namespace:
        raise PullRefused(
            403, "namespace_mismatch", "only nodes of this node's namespace may pull its blocks"
        )
    if retired:
        raise PullRefused(
            409, "namespace_retired", "this namespace is retired; its blocks are being deleted"
        )
    return key.node_id, hashes


def read_prefix(pool: BlockPool, block_hashes: Sequence[bytes]) -> list[BlockRecord]:
    """The READY, unexpired run of ``block_hashes`` from the first, copied out (model worker thread).

    Referenced while copied, so no byte is moved or freed meanwhile; a block tombstoned in
    between ends the run. Only the copy runs on the worker: :func:`seal_records` seals
    elsewhere, so a pull holds the worker about as long as a memory copy of its bytes.
    """
    with pool.lock:
        entries = pool.longest_ready_prefix(block_hashes)
        pool.inc_lock_ref(entries)
    records: list[BlockRecord] = []
    try:
        for entry in entries:
            try:
                records.append(pool.read_record(entry))
            except BlockRestoreError:
                break
    finally:
        pool.dec_lock_ref(entries)
    return records


def seal_records(
    records: Sequence[BlockRecord], key_provider: DataKeyProvider
) -> list[bytes | bytearray]:
    """The at-rest form of each record, up to the first whose scope has no data key here."""
    sealed: list[bytes | bytearray] = []
    for record in records:
        data = encode_block_record(record, key_provider)
        if data is None:
            break
        sealed.append(data)
    return sealed


# --- puller --------------------------------------------------------------------------------


class PeerPuller:
    """Fetches records of claimed blocks from the peers in ``settings.urls``, signed with this node's key."""

    def __init__(
        self, node_id: str, signing_key: Ed25519PrivateKey, settings: PeerSettings
    ) -> None:
        self._node_id = node_id
        self._signing_key = signing_key
        self._urls = dict(settings.urls)
        self.settings = settings

    def knows(self, node_id: str) -> bool:
        return node_id in self._urls and node_id != self._node_id

    async def fetch(
        self, peer_id: str, namespace: str, block_hashes: Sequence[bytes], spec: KVBlockSpec
    ) -> list[bytearray]:
        """The records the peer serves for ``block_hashes`` (a prefix of them); :class:`PullFailed`
        when it serves none."""
        url = self._urls.get(peer_id)
        if url is None or peer_id == self._node_id:
            raise PullFailed("unknown_peer")
        body = json.dumps(
            {
                "namespace": namespace,
                "block_hashes": [block_hash.hex() for block_hash in block_hashes],
            }
        ).encode()
        credential = issue_peer_credential(
            self._signing_key,
            self._node_id,
            peer_id,
            hashlib.sha256(body).hexdigest(),
            PEER_CREDENTIAL_TTL_S,
        )
        headers = {"Authorization": f"Bearer {credential}", "Content-Type": "application/json"}
        records = await asyncio.to_thread(
            post_for_frames,
            url,
            body,
            headers,
            self.settings.pull_timeout_s,
            len(block_hashes),
            max_record_bytes(spec),
        )
        if not records:
            raise PullFailed("not_held")
        return records


def post_for_frames(
    base_url: str,
    body: bytes,
    headers: dict[str, str],
    timeout_s: float,
    max_records: int,
    max_record: int,
) -> list[bytearray]:
    """POST a pull to ``base_url`` and read the framed records it answers (blocking; a thread).

    Why not the node's ``httpx`` client: it reads a body 64 KiB at a time through its own
    parser and hands out chunks that must then be joined and sliced, which for a real
    model's prefix cost more than the transfer itself. Here each record is read straight
    into a buffer of its own size. The whole pull — connect, request, every byte — is bounded
    by ``timeout_s``: past it a timer shuts the socket down, whatever the peer sends.
    https peers are verified against the system's trust store.
    """
    parts = urlsplit(base_url)
    connection: http.client.HTTPConnection
    if parts.scheme == "https":
        connection = http.client.HTTPSConnection(
            parts.hostname or "",
            parts.port,
            timeout=timeout_s,
            context=ssl.create_default_context(),
        )
    else:
        connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    watchdog: threading.Timer | None = None
    try:
        connection.connect()
        watchdog = threading.Timer(
            max(deadline - time.monotonic(), 0.0), _shut_down, (connection.sock,)
        )
        watchdog.start()
        connection.request("POST", parts.path.rstrip("/") + PULL_PATH, body=body, headers=headers)
        response = connection.getresponse()
        if response.status != 200:
            raise PullFailed("refused")
        try:
            records = read_frames(response, max_records, max_record)
        except PullFailed:
            if response.isclosed() and response.length:
                # The body ended before its Content-Length: the connection was cut (or shut down
                # at the deadline), not the frames malformed.
                raise PullFailed(_cut_reason(deadline)) from None
            raise
        if response.length:
            # Cut between two frames: whole records, but not the whole answer. http.client reports
            # a short body as its end, so the count it still expected tells.
            raise PullFailed(_cut_reason(deadline))
        return records
    except (OSError, http.client.HTTPException):
        raise PullFailed(_cut_reason(deadline)) from None
    finally:
        if watchdog is not None:
            watchdog.cancel()
        connection.close()


def _cut_reason(deadline: float) -> str:
    """Why a pull's connection failed: its deadline passed (the watchdog shut it), or the peer."""
    return "timeout" if time.monotonic() >= deadline else "unavailable"


def _shut_down(sock: socket.socket | None) -> None:
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def open_pulled(
    records: Sequence[bytes | bytearray],
    targets: Sequence[CacheEntry],
    key_provider: DataKeyProvider,
    namespace: str,
    spec: KVBlockSpec,
) -> tuple[list[torch.Tensor], str | None]:
    """The KV of each pulled record that opens as its target's block, in order, and why the run ended early (or None).

    Runs off the event loop: opening a sealed record may ask the key service for its key.
    The block hash is the associated data of the seal and commits to the block's salted
    provenance, so a record of the asked hash that opens under its scope's key is that block.
    """
    kvs: list[torch.Tensor] = []
    aeads: dict = {}
    for record, target in zip(records, targets, strict=False):
        try:
            opened, _ = parse_record_body(*open_record(record, key_provider, aeads))
            check_record(opened, target.block_hash, namespace, spec)
        except BlockRestoreError as error:
            return kvs, "decrypt_failed" if error.reason in (
                "decrypt_failed",
                "checksum_mismatch",
                "key_unavailable",
            ) else "mismatch"
        kvs.append(payload_tensor(opened.payload, spec))
    return kvs, None
