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

import base64
import binascii
import hashlib
import json
import logging
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpu_node.keys.crypto import DataKeyProvider
from gpu_node.pool.block_pool import BlockPool
from gpu_node.pool.block_records import (
    BlockRestoreError,
    check_record,
    decode_block_record,
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


def encode_frames(records: Sequence[bytes]) -> bytes:
    """``len ‖ record`` for each record: the body of a pull response."""
    return b"".join(FRAME_LENGTH.pack(len(record)) + record for record in records)


def decode_frames(data: bytes, max_records: int, max_record: int) -> list[bytes]:
    """The records of a pull response; :class:`PullFailed` ``malformed`` when it is not whole frames
    within bounds."""
    records: list[bytes] = []
    offset = 0
    while offset < len(data):
        if len(records) == max_records or offset + FRAME_LENGTH.size > len(data):
            raise PullFailed("malformed")
        (length,) = FRAME_LENGTH.unpack_from(data, offset)
        offset += FRAME_LENGTH.size
        if length > max_record or offset + length > len(data):
            raise PullFailed("malformed")
        records.append(data[offset : offset + length])
        offset += length
    return records


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


def export_prefix(pool: BlockPool, block_hashes: Sequence[bytes]) -> list[bytes]:
    """At-rest records of the READY, unexpired run of ``block_hashes`` from the first (model worker
    thread).

    Referenced while exported, so no byte is moved or freed meanwhile; a block
    tombstoned in between, or whose scope has no data key here, ends the run.
    """
    with pool.lock:
        entries = pool.longest_ready_prefix(block_hashes)
        pool.inc_lock_ref(entries)
    records: list[bytes] = []
    try:
        for entry in entries:
            try:
                record = pool.export_record(entry)
            except BlockRestoreError:
                break
            if record is None:
                break
            records.append(record)
    finally:
        pool.dec_lock_ref(entries)
    return records


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
        self._client = httpx.AsyncClient(timeout=settings.pull_timeout_s)

    async def aclose(self) -> None:
        await self._client.aclose()

    def knows(self, node_id: str) -> bool:
        return node_id in self._urls and node_id != self._node_id

    async def fetch(
        self, peer_id: str, namespace: str, block_hashes: Sequence[bytes], spec: KVBlockSpec
    ) -> list[bytes]:
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
        max_bytes = len(block_hashes) * (max_record_bytes(spec) + FRAME_LENGTH.size)
        headers = {"Authorization": f"Bearer {credential}", "Content-Type": "application/json"}
        try:
            async with self._client.stream(
                "POST", url.rstrip("/") + PULL_PATH, content=body, headers=headers
            ) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise PullFailed("refused")
                chunks: list[bytes] = []
                num_bytes = 0
                async for chunk in response.aiter_raw():
                    num_bytes += len(chunk)
                    if num_bytes > max_bytes:
                        raise PullFailed("malformed")
                    chunks.append(chunk)
        except httpx.TimeoutException:
            raise PullFailed("timeout") from None
        except httpx.HTTPError:
            raise PullFailed("unavailable") from None
        records = decode_frames(b"".join(chunks), len(block_hashes), max_record_bytes(spec))
        if not records:
            raise PullFailed("not_held")
        return records


def open_pulled(
    records: Sequence[bytes],
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
    for record, target in zip(records, targets, strict=False):
        try:
            opened = decode_block_record(record, key_provider)
            check_record(opened, target.block_hash, namespace, spec)
        except BlockRestoreError as error:
            return kvs, "decrypt_failed" if error.reason in (
                "decrypt_failed",
                "checksum_mismatch",
                "key_unavailable",
            ) else "mismatch"
        kvs.append(payload_tensor(opened.payload, spec))
    return kvs, None
