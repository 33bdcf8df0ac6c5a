"""Data keys fetched from the coordinator's key service (``coordinator.api.routes.keys``).

With ``coordinator_url`` set, a node holds no data keys of its own: it asks the
coordinator for the live key of a block's scope when it seals a block, and for
a key by id when it unseals one. Keys are cached in memory only — never written
to disk — so the coordinator's destruction of a key (an erasure) plus the
node forgetting its cached copy (the erasure's command) leaves no way to open
any copy of the data sealed under it: block files, snapshot shards, or files
copied off the node.

The pool calls ``key_for``/``key_by_id`` under its lock, so once the node serves they never touch
the network: they answer from memory, and a key not held is fetched in the background (the caller
gets None: the block stays out of the disk tier, or a sealed block counts as a ``key_unavailable``
miss). The network happens ahead of the lock: :meth:`CoordinatorKeyProvider.prefetch` fetches a
request's tenant and user keys before its prefix lookup, waiting at most ``prefetch_wait_s``. Before
the first request (start-up re-index, warm start: nobody waits on the pool yet) and through
:meth:`CoordinatorKeyProvider.blocking` (callers outside the lock), a missing key is fetched on the
spot, each request bounded by ``timeout_s``. An answer "no such key" is remembered for
``negative_ttl_s``, a request that failed in transit (or got an error answer) for
:data:`UNREACHABLE_RETRY_S`; every cache is an LRU of bounded size
(``gpu_node.settings.DataKeySettings``). The two stay apart: the blocking view raises
:class:`gpu_node.keys.crypto.KeyServiceUnavailable` for the second, so a snapshot's inventory never
reports a copy as gone because the coordinator was down or slow at that moment."""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import logging
import re
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Generic, TypeVar

import httpx

from events.schema import subject_digest
from gpu_node.keys.crypto import DataKeyProvider, KeyServiceUnavailable, LocalKeyStore
from gpu_node.keys.node_identity import node_signing_key
from gpu_node.settings import DataKeySettings, NodeSettings
from identity.node_credentials import issue_node_credential
from identity.sealing import KEY_BYTES, KEY_ID_HEX_CHARS
from identity.tokens import Principal
from prefix_keys.blocks import CacheProvenance, CacheScope

log = logging.getLogger(__name__)

NODE_CREDENTIAL_TTL_S = 30
_RESOLVE_ATTEMPTS = 2
_FETCH_WORKERS = 2
UNREACHABLE_RETRY_S = 5.0
"""After a request to the key service failed in transit (refused, timed out), the same key is not asked for
again before this long. Before the node serves, look-ups fetch on the spot, one block after the other:
without it, re-indexing a disk tier of N blocks sealed under one key cost N timeouts while the coordinator
was slow (a restarted node in a soak was still re-indexing after 300 s)."""

_KEY_ID = re.compile(rf"[0-9a-f]{{{KEY_ID_HEX_CHARS}}}")

Scope = tuple[str, str | None]
"""(tenant id, keyed subject digest or None): a key scope as the key service files it."""


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Lru(Generic[K, V]):  # noqa: UP046 - Python 3.11 has no type parameter syntax
    """A dict of at most ``max_entries`` entries; the least recently used leaves first. Not
    thread-safe."""

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError("an LRU holds at least one entry")
        self._max_entries = max_entries
        self._entries: collections.OrderedDict[K, V] = collections.OrderedDict()

    def get(self, key: K) -> V | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)

    def pop(self, key: K) -> V | None:
        return self._entries.pop(key, None)

    def items(self) -> list[tuple[K, V]]:
        return list(self._entries.items())

    def __contains__(self, key: K) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)


class CoordinatorKeyProvider:
    """A :class:`gpu_node.keys.crypto.DataKeyProvider` backed by the coordinator; see the module
    docstring.

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
        settings: DataKeySettings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if len(subject_key) < 16:
            raise ValueError("the subject digest key must be at least 16 bytes")
        self._settings = settings = settings or DataKeySettings()
        self._client = httpx.Client(base_url=coordinator_url, timeout=settings.timeout_s)
        self._token_factory = token_factory
        self._subject_key = subject_key
        self._clock = clock
        self._lock = threading.Lock()
        self._by_scope: _Lru[Scope, tuple[str, bytes]] = _Lru(settings.max_cached_keys)
        self._by_id: _Lru[str, bytes] = _Lru(settings.max_cached_keys)
        # Key ids destroyed by an erasure command. Bounded too: past the bound the key
        # service's own answer (410) still refuses them.
        self._destroyed: _Lru[str, bool] = _Lru(settings.max_negative_entries)
        self._negative: _Lru[tuple[str, Hashable], tuple[float, bool]] = _Lru(
            settings.max_negative_entries
        )
        """What memory answers None for, until when, and whether in doubt (the service could not answer) rather than "no such key"."""
        self._inflight: dict[tuple[str, Hashable], Future] = {}
        self._fetcher = ThreadPoolExecutor(
            max_workers=_FETCH_WORKERS, thread_name_prefix="kvledger-keys"
        )
        self._serving = False

    def close(self) -> None:
        self._fetcher.shutdown(wait=True, cancel_futures=True)
        self._client.close()

    def _scope(self, tenant_id: str, subject_id: str | None) -> Scope:
        return tenant_id, None if subject_id is None else subject_digest(
            self._subject_key, tenant_id, subject_id
        )

    # -- what the pool calls, under its lock: memory only once serving ------------------------

    def key_for(self, provenance: CacheProvenance) -> tuple[str, bytes] | None:
        """The live key of the block's scope if held (else fetched, see the module docstring); None for public scope."""
        if provenance.scope == CacheScope.PUBLIC:
            return None
        assert provenance.tenant_id is not None, (
            "tenant and user scope blocks always carry a tenant id"
        )
        subject_id = None
        if provenance.scope == CacheScope.USER:
            assert provenance.subject_id is not None, "user scope blocks always carry a subject id"
            subject_id = provenance.subject_id
        return self._lookup(
            ("scope", self._scope(provenance.tenant_id, subject_id)), wait=not self._serving
        )

    def key_by_id(self, key_id: str) -> bytes | None:
        """The key to unseal with if held (else fetched, see the module docstring); None once destroyed or unknown."""
        if not _KEY_ID.fullmatch(key_id):
            return None  # a key id from a corrupt header: the coordinator never issued it
        return self._lookup(("id", key_id), wait=not self._serving)

    # -- ahead of the lock ------------------------------------------------------------------

    async def prefetch(self, principal: Principal) -> None:
        """Fetch the keys of ``principal``'s tenant and user scopes, waiting at most
        ``prefetch_wait_s``.

        From the first call on, the pool's look-ups never fetch themselves. A fetch still
        running when the wait ends goes on in the background and serves later requests.
        """
        self._serving = True
        futures = [
            future
            for scope in (
                self._scope(principal.tenant_id, None),
                self._scope(principal.tenant_id, principal.subject_id),
            )
            if (future := self._wanted(("scope", scope))) is not None
        ]
        if futures:
            await asyncio.wait(
                [asyncio.wrap_future(future) for future in futures],
                timeout=self._settings.prefetch_wait_s,
            )

    def blocking(self) -> DataKeyProvider:
        """A view that fetches a key it does not hold (bounded by ``timeout_s``): for callers outside the pool's lock."""
        return _Blocking(self)

    # -- local state --------------------------------------------------------------------------

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
        data) and is not the erasure's to destroy: it is kept (and held). When the
        coordinator cannot be asked, the key is forgotten all the same.
        """
        if _KEY_ID.fullmatch(key_id) and self._fetch_id(key_id) is not None:
            return False
        with self._lock:
            self._destroyed.put(key_id, True)
            self._by_id.pop(key_id)
            for scope in [
                scope for scope, (cached_id, _) in self._by_scope.items() if cached_id == key_id
            ]:
                self._by_scope.pop(scope)
        return True

    def _cached(self, want: tuple[str, Hashable]) -> tuple[bool, tuple[str, bytes] | bytes | None]:
        """(known, answer): whether memory answers ``want`` (held, destroyed or recently unknown). Call with the lock."""
        kind, value = want
        if kind == "id":
            if value in self._destroyed:
                return True, None
            key = self._by_id.get(value)
            if key is not None:
                return True, key
        else:
            resolved = self._by_scope.get(value)
            if resolved is not None:
                return True, resolved
        negative = self._negative.get(want)
        if negative is not None:
            if self._clock() < negative[0]:
                return True, None
            self._negative.pop(want)
        return False, None

    def _in_doubt(self, want: tuple[str, Hashable]) -> bool:
        """Whether memory answers None for ``want`` only because the key service could not answer
        lately."""
        with self._lock:
            if want[0] == "id" and want[1] in self._destroyed:
                return False
            negative = self._negative.get(want)
        return negative is not None and negative[1] and self._clock() < negative[0]

    def _lookup(self, want: tuple[str, Hashable], *, wait: bool):
        with self._lock:
            known, answer = self._cached(want)
        if known:
            return answer
        if wait:
            return self._fetch(want)
        self._wanted(want)
        return None

    def _wanted(self, want: tuple[str, Hashable]) -> Future | None:
        """The background fetch of ``want`` (started unless one runs); None when memory already answers it."""
        with self._lock:
            known, _ = self._cached(want)
            if known:
                return None
            future = self._inflight.get(want)
            if future is None:
                future = self._inflight[want] = self._fetcher.submit(self._fetch_then_forget, want)
            return future

    def _fetch_then_forget(self, want: tuple[str, Hashable]):
        try:
            return self._fetch(want)
        finally:
            with self._lock:
                self._inflight.pop(want, None)

    def _fetch(self, want: tuple[str, Hashable]):
        kind, value = want
        return self._fetch_id(value) if kind == "id" else self._resolve(value)

    def _remember_unknown(self, want: tuple[str, Hashable]) -> None:
        """The key service answered that ``want`` does not exist (or is not this node's to have)."""
        if self._settings.negative_ttl_s > 0:
            with self._lock:
                self._negative.put(want, (self._clock() + self._settings.negative_ttl_s, False))

    def _remember_unanswered(self, want: tuple[str, Hashable]) -> None:
        """The key service could not say (unreachable, an error answer): not asked again for
        :data:`UNREACHABLE_RETRY_S`."""
        with self._lock:
            self._negative.put(want, (self._clock() + UNREACHABLE_RETRY_S, True))

    # -- the network: never called under the pool's lock once serving ---------------------------

    def _resolve(self, scope: Scope) -> tuple[str, bytes] | None:
        body = {"tenant_id": scope[0], "subject_hash": scope[1]}
        for _ in range(_RESOLVE_ATTEMPTS):
            response = self._send("POST", "/v1/keys/resolve", json=body)
            if response is None:
                self._remember_unanswered(("scope", scope))
                return None
            if response.status_code != 200:
                self._remember_unknown(("scope", scope))
                return None
            resolved = _parse_key(response)
            if resolved is None:
                return None
            with self._lock:
                # A resolve answered just before an erasure destroyed the key may arrive after this
                # node was told to forget it: never reuse such a key, ask again for the scope's next
                # one.
                if resolved[0] not in self._destroyed:
                    self._by_scope.put(scope, resolved)
                    self._by_id.put(resolved[0], resolved[1])
                    return resolved
        log.warning("the coordinator keeps answering with a destroyed data key; block not sealed")
        return None

    def _fetch_id(self, key_id: str) -> bytes | None:
        response = self._send("GET", f"/v1/keys/{key_id}")
        if response is not None and response.status_code == 410:
            with self._lock:
                self._destroyed.put(key_id, True)
            return None
        if response is not None and response.status_code == 404:
            self._remember_unknown(("id", key_id))
            return None
        fetched = None if response is None or response.status_code != 200 else _parse_key(response)
        if fetched is None or fetched[0] != key_id:
            self._remember_unanswered(("id", key_id))
            return None
        with self._lock:
            if key_id in self._destroyed:
                return None
            self._by_id.put(key_id, fetched[1])
        return fetched[1]

    def _send(self, method: str, path: str, **kwargs) -> httpx.Response | None:
        """One request with a fresh node credential; None when the coordinator is unreachable. Logs
        failures, never keys."""
        try:
            response = self._client.request(
                method, path, headers={"Authorization": f"Bearer {self._token_factory()}"}, **kwargs
            )
        except httpx.HTTPError as error:
            log.warning("key service unreachable (%s %s: %s)", method, path, type(error).__name__)
            return None
        if response.status_code not in (200, 404, 410):
            log.error(
                "key service refused %s %s: HTTP %d %s",
                method,
                path,
                response.status_code,
                _error_code(response),
            )
        return response


class _Blocking:
    """:meth:`CoordinatorKeyProvider.blocking`: the same memory, but a key not held is fetched before answering."""

    def __init__(self, provider: CoordinatorKeyProvider) -> None:
        self._provider = provider

    def key_for(self, provenance: CacheProvenance) -> tuple[str, bytes] | None:
        if provenance.scope == CacheScope.PUBLIC:
            return None
        assert provenance.tenant_id is not None, (
            "tenant and user scope blocks always carry a tenant id"
        )
        subject_id = provenance.subject_id if provenance.scope == CacheScope.USER else None
        return self._provider._lookup(
            ("scope", self._provider._scope(provenance.tenant_id, subject_id)), wait=True
        )

    def key_by_id(self, key_id: str) -> bytes | None:
        """The key; None when it is gone (destroyed, never issued, a malformed id); raises
        :class:`KeyServiceUnavailable` when the key service could not say (see
        :meth:`CoordinatorKeyProvider._in_doubt`)."""
        if not _KEY_ID.fullmatch(key_id):
            return None
        want = ("id", key_id)
        key = self._provider._lookup(want, wait=True)
        if key is None and self._provider._in_doubt(want):
            raise KeyServiceUnavailable("the key service could not be asked for a data key")
        return key

    def destroy(self, key_id: str) -> bool:
        return self._provider.destroy(key_id)

    def subject_key_ids(self, tenant_id: str, subject_hash: str) -> list[str]:
        return self._provider.subject_key_ids(tenant_id, subject_hash)

    async def prefetch(self, principal: Principal) -> None:
        await self._provider.prefetch(principal)

    def blocking(self) -> DataKeyProvider:
        return self


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
    node key (``gpu_node.keys.node_identity``), which the coordinator accepts once that key
    is enrolled for this node id. No shared secret is involved.
    """
    if settings.coordinator_url is None:
        subject_key = (
            None
            if settings.subject_key is None
            else settings.subject_key.get_secret_value().encode()
        )
        return LocalKeyStore(data_dir / "keys.json", subject_key)
    if settings.subject_key is None:
        raise ValueError(
            "coordinator_url needs the subject key (KVLEDGER_SUBJECT_KEY) shared with the coordinator"
        )
    node_key = node_signing_key(settings)
    node_id = settings.node_id

    def credential() -> str:
        return issue_node_credential(node_key, node_id, NODE_CREDENTIAL_TTL_S)

    return CoordinatorKeyProvider(
        settings.coordinator_url,
        credential,
        settings.subject_key.get_secret_value().encode(),
        settings.data_keys,
    )
