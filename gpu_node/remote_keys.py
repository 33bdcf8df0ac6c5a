"""Data keys fetched from the coordinator's key service (``coordinator.keys_api``).

With ``coordinator_url`` set, a node holds no data keys of its own: it asks the
coordinator for the live key of a block's scope when it seals a block, and for
a key by id when it unseals one. Keys are cached in memory only — never written
to disk — so the coordinator's destruction of a key (an erasure) plus the
node forgetting its cached copy (the erasure's command) leaves no way to open
any copy of the data sealed under it: block files, snapshot shards, or files
copied off the node.

The pool calls the provider under its lock on the model worker thread, so
calls are synchronous (one ``httpx.Client`` with a short timeout) and the cache
is guarded by its own lock, never held across a request. When the coordinator
cannot be reached, ``key_for`` answers None (the pool then keeps the block out
of the disk tier rather than write it unsealed) and ``key_by_id`` None (the
pool drops the block as undecryptable: a cache miss, never a failed request).
"""

from __future__ import annotations

import base64
import binascii
import logging
import re
import threading
from collections.abc import Callable
from pathlib import Path

import httpx

from events.schema import subject_digest
from gpu_node.crypto import DataKeyProvider, LocalKeyStore
from gpu_node.kv_cache_utils import BlockProvenance, CacheScope
from gpu_node.node_identity import node_signing_key
from gpu_node.settings import NodeSettings
from identity.node_credentials import issue_node_credential
from identity.sealing import KEY_BYTES, KEY_ID_HEX_CHARS

log = logging.getLogger(__name__)

NODE_CREDENTIAL_TTL_S = 30
DEFAULT_TIMEOUT_S = 2.0
_RESOLVE_ATTEMPTS = 2

_KEY_ID = re.compile(rf"[0-9a-f]{{{KEY_ID_HEX_CHARS}}}")


class CoordinatorKeyProvider:
    """A :class:`gpu_node.crypto.DataKeyProvider` backed by the coordinator; see the module docstring.

    ``token_factory`` returns the node's bearer credential; it is called per
    request, so a short credential lifetime costs nothing. ``subject_key`` is
    the deployment's subject digest key: the coordinator files user keys under
    the keyed digest of (tenant, subject), never the raw subject id.
    """

    def __init__(
        self,
        coordinator_url: str,
        token_factory: Callable[[], str],
        subject_key: bytes,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if len(subject_key) < 16:
            raise ValueError("the subject digest key must be at least 16 bytes")
        self._client = httpx.Client(base_url=coordinator_url, timeout=timeout_s)
        self._token_factory = token_factory
        self._subject_key = subject_key
        self._lock = threading.Lock()
        self._by_scope: dict[tuple[str, str | None], tuple[str, bytes]] = {}
        self._by_id: dict[str, bytes] = {}
        self._destroyed: set[str] = set()

    def close(self) -> None:
        self._client.close()

    def _scope(self, tenant_id: str, subject_id: str | None) -> tuple[str, str | None]:
        return tenant_id, None if subject_id is None else subject_digest(self._subject_key, tenant_id, subject_id)

    def key_for(self, provenance: BlockProvenance) -> tuple[str, bytes] | None:
        """The live key of the block's scope (cached, else resolved); None for public scope or no coordinator."""
        if provenance.scope == CacheScope.PUBLIC:
            return None
        assert provenance.tenant_id is not None, "tenant and user scope blocks always carry a tenant id"
        subject_id = None
        if provenance.scope == CacheScope.USER:
            assert provenance.subject_id is not None, "user scope blocks always carry a subject id"
            subject_id = provenance.subject_id
        scope = self._scope(provenance.tenant_id, subject_id)
        with self._lock:
            cached = self._by_scope.get(scope)
        if cached is not None:
            return cached
        body = {"tenant_id": scope[0], "subject_hash": scope[1]}
        for _ in range(_RESOLVE_ATTEMPTS):
            response = self._send("POST", "/v1/keys/resolve", json=body)
            if response is None or response.status_code != 200:
                return None
            resolved = _parse_key(response)
            if resolved is None:
                return None
            with self._lock:
                # A resolve answered just before an erasure destroyed the key may arrive after this
                # node was told to forget it: never reuse such a key, ask again for the scope's next one.
                if resolved[0] not in self._destroyed:
                    self._by_scope[scope] = resolved
                    self._by_id[resolved[0]] = resolved[1]
                    return resolved
        log.warning("the coordinator keeps answering with a destroyed data key; block not sealed")
        return None

    def key_by_id(self, key_id: str) -> bytes | None:
        """The key to unseal with: cached, else fetched; None once destroyed, unknown or unreachable."""
        if not _KEY_ID.fullmatch(key_id):
            return None  # a key id from a corrupt header: the coordinator never issued it
        with self._lock:
            if key_id in self._destroyed:
                return None
            cached = self._by_id.get(key_id)
        if cached is not None:
            return cached
        response = self._send("GET", f"/v1/keys/{key_id}")
        if response is None:
            return None
        if response.status_code == 410:
            with self._lock:
                self._destroyed.add(key_id)
            return None
        if response.status_code != 200:
            return None
        fetched = _parse_key(response)
        if fetched is None or fetched[0] != key_id:
            return None
        with self._lock:
            if key_id in self._destroyed:
                return None
            self._by_id[key_id] = fetched[1]
        return fetched[1]

    def current_key_id(self, tenant_id: str, subject_id: str | None = None) -> str | None:
        """Id of the key this node holds for a tenant (or one subject in it); None if it holds none.

        Local only: the erasure command handler asks which cached key to forget.
        """
        with self._lock:
            cached = self._by_scope.get(self._scope(tenant_id, subject_id))
        return None if cached is None else cached[0]

    def subject_key_ids(self, tenant_id: str, subject_hash: str) -> list[str]:
        """The id of the key this node resolved for a subject (by keyed digest), as a list of at most one.

        Keys fetched by id to unseal a file are not attributed to a scope (the
        coordinator does not say whose they are); the erasure handler finds those
        from the key ids in the headers of the copies it removes.
        """
        with self._lock:
            cached = self._by_scope.get((tenant_id, subject_hash))
        return [] if cached is None else [cached[0]]

    def destroy(self, key_id: str) -> bool:
        """Forget the key and refuse to fetch it again — unless the coordinator still serves it (then False).

        The authoritative destruction happens on the coordinator (``KeyService``),
        which destroys every key of a subject when the erasure starts; what the
        node owes is that it can no longer unseal anything under ``key_id``. A key
        the coordinator still serves was issued after that (the subject's newer
        data) and is not the erasure's to destroy: it is kept. When the
        coordinator cannot be asked, the key is forgotten all the same.
        """
        if _KEY_ID.fullmatch(key_id):
            response = self._send("GET", f"/v1/keys/{key_id}")
            if response is not None and response.status_code == 200:
                return False
        with self._lock:
            self._destroyed.add(key_id)
            self._by_id.pop(key_id, None)
            for scope in [scope for scope, (cached_id, _) in self._by_scope.items() if cached_id == key_id]:
                del self._by_scope[scope]
        return True

    def _send(self, method: str, path: str, **kwargs) -> httpx.Response | None:
        """One request with a fresh node credential; None when the coordinator is unreachable. Logs failures, never keys."""
        try:
            response = self._client.request(
                method, path, headers={"Authorization": f"Bearer {self._token_factory()}"}, **kwargs
            )
        except httpx.HTTPError as error:
            log.warning("key service unreachable (%s %s: %s)", method, path, type(error).__name__)
            return None
        if response.status_code not in (200, 404, 410):
            log.error("key service refused %s %s: HTTP %d %s", method, path, response.status_code, _error_code(response))
        return response


def _error_code(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "(no error code)"


def _parse_key(response: httpx.Response) -> tuple[str, bytes] | None:
    """``(key_id, key)`` from a key response; None (logged) when it is not a well-formed data key."""
    try:
        data = response.json()
        key_id, key = data["key_id"], base64.b64decode(data["key"], validate=True)
    except (ValueError, KeyError, TypeError, binascii.Error):
        key_id, key = None, b""
    if not isinstance(key_id, str) or not _KEY_ID.fullmatch(key_id) or len(key) != KEY_BYTES:
        log.error("key service answered with a malformed data key response")
        return None
    return key_id, key


def data_key_provider(settings: NodeSettings, data_dir: Path) -> DataKeyProvider:
    """The node's key provider: the coordinator's key service when ``coordinator_url`` is set, else a local store.

    The node authenticates with credentials only its own key can make
    (``identity.node_credentials``): a fresh EdDSA JWT per request, signed with the
    node key (``gpu_node.node_identity``), which the coordinator accepts once that key
    is enrolled for this node id. No shared secret is involved.
    """
    if settings.coordinator_url is None:
        subject_key = None if settings.subject_key is None else settings.subject_key.get_secret_value().encode()
        return LocalKeyStore(data_dir / "keys.json", subject_key)
    if settings.subject_key is None:
        raise ValueError("coordinator_url needs the subject key (KVLEDGER_SUBJECT_KEY) shared with the coordinator")
    node_key = node_signing_key(settings)
    node_id = settings.node_id

    def credential() -> str:
        return issue_node_credential(node_key, node_id, NODE_CREDENTIAL_TTL_S)

    return CoordinatorKeyProvider(settings.coordinator_url, credential, settings.subject_key.get_secret_value().encode())
