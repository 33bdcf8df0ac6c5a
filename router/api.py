"""The router's OpenAI-compatible front door: ``/v1/chat/completions``, ``/v1/models``, ``/health``,
``/metrics``.

Order of a chat request: the end user's bearer token is verified first, exactly as a node
verifies it (``identity.tokens.TokenVerifier`` over the same ``auth`` settings, the node's 401
body and ``WWW-Authenticate``); then the body is read (bounded) and keyed (``router.keying``), a
node is chosen (``router.scoring`` over ``router.index``), and the request is proxied to it with
httpx. The node's answer goes back as it came — status, body bytes (SSE included) and its
headers but hop-by-hop ones — with ``X-Kvledger-Node`` naming the node; ``X-Request-Id`` is
sent on to the node and answered back. A request that fails before its first byte (no
connection, a timeout, 502/503/504) is sent once more to the next-best node; any other answer
of the node is the caller's, including governance refusals (409 ``stale_document_version``, 401
``stale_authorization``), which another node would give too.

A request naming a document version (or carrying a token policy version) that the ledger's decisions
made stale (read at start, then followed on ``kvledger.commands``: ``router.feed``) is refused here
with the node's very answer (``prefix_keys.versions.Staleness``), never sent on. It is checked only
when the caller holds the auth scope of every document it names: a node answers 403
``document_scope_forbidden`` first otherwise, and the router must not tell such a caller a
document's current version.

Nothing about other tenants leaks: keys are salted by the caller's verified scopes, so its
lookup only ever matches its own and public blocks, and no answer says what the index holds.
Prompt text is never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from events.logs import RequestIdMiddleware, request_id_var
from events.pull_hint import PULL_BLOCKS_HEADER, PULL_FROM_HEADER
from identity.metrics_access import scrape_refusal
from identity.tokens import AuthError, Principal, TokenVerifier
from prefix_keys.prompt import ChatMessage
from prefix_keys.versions import VersionRegistry
from router.feed import Feed
from router.health import CircuitBreaker, Liveness
from router.index import PrefixIndex, PrefixMatch
from router.keying import Keying, request_messages
from router.load import node_load
from router.metrics import RouterMetrics
from router.scoring import RETRY, Candidate, Decision, PrefixLoadStrategy, Strategy, pull_hint
from router.settings import NodeEndpoint, RouterSettings

log = logging.getLogger(__name__)

NODE_HEADER = "x-kvledger-node"
RETRIED_STATUSES = frozenset({502, 503, 504})
"""A node answer that means "not me, not now": the request never started there."""
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "x-request-id",
        "date",
        "server",
    }
)
MAX_USAGE_BYTES = 1 << 20
"""How much of an answer is kept to read the node's usage from (a non-streamed body, a stream's
tail)."""


class RouterError(Exception):
    """An answer of the router's own, in OpenAI's error shape."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        code: str,
        type: str = "invalid_request_error",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code, self.message, self.code, self.type, self.param = (
            status_code,
            message,
            code,
            type,
            param,
        )


def error_response(
    status_code: int,
    message: str,
    *,
    type: str,
    code: str | None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status_code, headers=headers)


@dataclass
class Fleet:
    """The nodes and what the router knows of them right now."""

    endpoints: dict[str, NodeEndpoint]
    index: PrefixIndex
    keying: Keying
    liveness: Liveness
    failure_threshold: int
    breaker_open_s: float
    reported_queue: dict[str, int] = field(default_factory=dict)
    """Each node's own queue, as last polled (``router.load.QueuePoller``)."""
    versions: VersionRegistry = field(default_factory=VersionRegistry)
    """Current document and policy versions, as the feed reads and follows them (stale requests are
    refused)."""
    in_flight: dict[str, int] = field(default_factory=dict)
    breakers: dict[str, CircuitBreaker] = field(default_factory=dict)

    def breaker(self, node_id: str) -> CircuitBreaker:
        if node_id not in self.breakers:
            self.breakers[node_id] = CircuitBreaker(self.failure_threshold, self.breaker_open_s)
        return self.breakers[node_id]

    def candidates(self, now: float) -> list[Candidate]:
        """Nodes keyed for the model, alive, with a closed (or trial) breaker."""
        candidates = []
        for node_id in self.endpoints:
            state = self.index.node(node_id)
            if (
                node_id not in self.keying.nodes
                or state is None
                or not self.liveness.alive(state.last_seen, now)
            ):
                continue
            if self.breaker(node_id).allows(now):
                candidates.append(
                    Candidate(
                        node_id,
                        node_load(self.in_flight.get(node_id, 0), self.reported_queue.get(node_id)),
                    )
                )
        return candidates


def create_app(
    settings: RouterSettings,
    fleet: Fleet,
    feed: Feed | None,
    verifier: TokenVerifier,
    strategy: Strategy | None = None,
) -> FastAPI:
    """The router's app over ``fleet``; ``feed`` (None in tests that fill the index themselves) keeps the index exact."""
    metrics = feed.metrics if feed is not None else RouterMetrics(fleet.index)
    timeout = httpx.Timeout(
        settings.routing.read_timeout_s, connect=settings.routing.connect_timeout_s
    )
    http = httpx.AsyncClient(
        timeout=timeout, limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await http.aclose()

    app = FastAPI(title="kvledger router", lifespan=lifespan)
    state = _State(
        settings,
        fleet,
        feed,
        verifier,
        strategy or PrefixLoadStrategy(settings.routing.load_cost_blocks),
        metrics,
        http,
    )
    app.state.router = state

    @app.get("/health")
    async def health() -> Response:
        if not state.serving():
            return error_response(
                503, "the router has no node to route to yet", type="server_error", code="not_ready"
            )
        return Response(status_code=200)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> Response:
        if not state.serving():
            return error_response(
                503, "the router has no node to route to yet", type="server_error", code="not_ready"
            )
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def scrape(request: Request) -> Response:
        refusal = scrape_refusal(request.headers.get("authorization"), settings.metrics.token)
        if refusal is not None:
            status_code, code, message = refusal
            headers = {"WWW-Authenticate": "Bearer"} if status_code == 401 else None
            return error_response(
                status_code,
                message,
                type="authentication_error" if status_code == 401 else "invalid_request_error",
                code=code,
                headers=headers,
            )
        metrics.collect_index()
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        state.principal(request)
        cards = (
            [
                {
                    "id": fleet.keying.model,
                    "object": "model",
                    "created": state.started_at,
                    "owned_by": "kvledger",
                }
            ]
            if fleet.keying.nodes
            else []
        )
        return JSONResponse({"object": "list", "data": cards})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await state.chat(request)

    @app.exception_handler(RouterError)
    async def _router_error(_: Request, exc: RouterError) -> JSONResponse:
        return error_response(
            exc.status_code, exc.message, type=exc.type, code=exc.code, param=exc.param
        )

    @app.exception_handler(AuthError)
    async def _auth_error(_: Request, exc: AuthError) -> JSONResponse:
        return error_response(
            401,
            exc.message,
            type="authentication_error",
            code=exc.code,
            headers={"WWW-Authenticate": "Bearer"},
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(
            exc.status_code, str(exc.detail), type="invalid_request_error", code=code
        )

    internal = {
        "error": {
            "message": "internal server error",
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        }
    }
    app.add_middleware(
        RequestIdMiddleware, access_logger="router.access", error_body=json.dumps(internal).encode()
    )
    return app


@dataclass
class _State:
    settings: RouterSettings
    fleet: Fleet
    feed: Feed | None
    verifier: TokenVerifier
    strategy: Strategy
    metrics: RouterMetrics
    http: httpx.AsyncClient
    started_at: int = field(default_factory=lambda: int(time.time()))

    def serving(self) -> bool:
        built = self.feed is None or self.feed.built.is_set()
        return built and bool(self.fleet.candidates(time.monotonic()))

    def principal(self, request: Request) -> Principal:
        header = request.headers.get("authorization")
        token = None
        if header is not None:
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer":
                raise AuthError(
                    "invalid_token", "the Authorization header must use the Bearer scheme"
                )
            token = token.strip()
        return self.verifier.verify(token)

    async def _body(self, request: Request) -> bytes:
        limit = self.settings.limits.max_request_bytes
        too_large = RouterError(
            413,
            f"the request body is larger than {limit} bytes (limits.max_request_bytes)",
            code="request_too_large",
        )
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    async def chat(self, request: Request) -> Response:
        principal = self.principal(request)
        body = await self._body(request)
        started = time.perf_counter()
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        model = parsed.get("model") if isinstance(parsed, dict) else None
        if isinstance(model, str) and model != self.fleet.keying.model:
            raise RouterError(
                404,
                f"the model {model[:100]!r} does not exist on this router",
                code="model_not_found",
                param="model",
            )
        messages = self._messages(parsed)
        if messages is not None:
            self._refuse_stale(principal, messages)
        keys = await self._keys(principal, messages)
        decision = self._decide(keys)
        self.metrics.routing_latency.observe(time.perf_counter() - started)
        self.metrics.decisions.labels(reason=decision.reason).inc()
        headers = {
            "content-type": "application/json",
            "authorization": request.headers["authorization"],
            "x-request-id": request_id_var.get(),
        }
        for attempt, node_id in enumerate(decision.ranked[:2]):
            last = attempt == 1 or len(decision.ranked) == 1
            if attempt == 1:
                self.metrics.decisions.labels(reason=RETRY).inc()
            hint = pull_hint(decision, node_id)
            sent = (
                headers
                if hint is None
                else headers | {PULL_FROM_HEADER: hint[0], PULL_BLOCKS_HEADER: str(hint[1])}
            )
            answer = await self._send(node_id, body, sent, last)
            if answer is not None:
                block_size = self._block_size(node_id)
                self.metrics.predicted_cached_tokens.inc(
                    decision.predicted_blocks.get(node_id, 0) * block_size
                )
                return self._relay(node_id, answer)
        raise RouterError(
            503, "no node could take the request", type="server_error", code="no_node_available"
        )

    def _messages(self, body: Any) -> list[ChatMessage] | None:
        """The body's messages as the node maps them; None for a body the node refuses with its own
        error."""
        if not isinstance(body, dict):
            return None
        try:
            messages = request_messages(body)
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
        return messages if 0 < len(messages) <= self.settings.limits.max_messages else None

    def _refuse_stale(self, principal: Principal, messages: list[ChatMessage]) -> None:
        """The node's refusal of a stale document or policy version, when the caller may learn it
        (module docstring)."""
        if not all(
            principal.holds(message.document.auth_scope)
            for message in messages
            if message.document is not None
        ):
            return
        stale = self.fleet.versions.check(principal, messages)
        if stale is None:
            return
        if stale.kind == "policy":
            raise AuthError(stale.code, stale.message)
        raise RouterError(stale.status_code, stale.message, code=stale.code, param=stale.param)

    async def _keys(
        self, principal: Principal, messages: list[ChatMessage] | None
    ) -> dict[tuple[str, int], list[bytes]]:
        if messages is None:
            return {}
        try:
            return await asyncio.to_thread(self.fleet.keying.keys, principal, messages)
        except (ValueError, KeyError, TypeError, AttributeError):
            return {}  # the node refuses these messages with its own error

    def _decide(self, keys: dict[tuple[str, int], list[bytes]]) -> Decision:
        candidates = self.fleet.candidates(time.monotonic())
        if not candidates:
            raise RouterError(
                503,
                "no node is available for this model",
                type="server_error",
                code="no_node_available",
            )
        matches: list[PrefixMatch] = []
        for (namespace, block_size), hashes in keys.items():
            space = {
                node_id
                for node_id, keying in self.fleet.keying.nodes.items()
                if (keying.namespace, keying.block_size) == (namespace, block_size)
            }
            matches.extend(
                match for match in self.fleet.index.match(hashes) if match.node_id in space
            )
        return self.strategy.rank(candidates, matches)

    def _block_size(self, node_id: str) -> int:
        keying = self.fleet.keying.nodes.get(node_id)
        return 0 if keying is None else keying.block_size

    async def _send(
        self, node_id: str, body: bytes, headers: dict[str, str], last: bool
    ) -> httpx.Response | None:
        """The node's answer, headers received; None when it failed before its first byte and another node may try."""
        breaker = self.fleet.breaker(node_id)
        now = time.monotonic()
        breaker.sent(now)
        url = f"{self.fleet.endpoints[node_id].url}/v1/chat/completions"
        self.fleet.in_flight[node_id] = self.fleet.in_flight.get(node_id, 0) + 1
        try:
            answer = await self.http.send(
                self.http.build_request("POST", url, content=body, headers=headers), stream=True
            )
        except httpx.TransportError as error:
            self._done(node_id)
            breaker.failed(time.monotonic())
            self.metrics.node_errors.labels(node=node_id).inc()
            log.warning("router: %s failed before answering (%s)", node_id, type(error).__name__)
            if last:
                raise RouterError(
                    502,
                    f"node {node_id} could not be reached",
                    type="server_error",
                    code="node_unavailable",
                ) from None
            return None
        if answer.status_code in RETRIED_STATUSES:
            breaker.failed(time.monotonic())
            self.metrics.node_errors.labels(node=node_id).inc()
            if not last:
                await answer.aclose()
                self._done(node_id)
                return None
        else:
            breaker.succeeded()
        return answer

    def _done(self, node_id: str) -> None:
        self.fleet.in_flight[node_id] -= 1

    def _relay(self, node_id: str, answer: httpx.Response) -> StreamingResponse:
        headers = {
            name: value for name, value in answer.headers.items() if name.lower() not in _HOP_BY_HOP
        }
        headers[NODE_HEADER] = node_id
        streamed = answer.headers.get("content-type", "").startswith("text/event-stream")

        async def relay() -> AsyncIterator[bytes]:
            kept = bytearray()
            try:
                async for chunk in answer.aiter_raw():
                    kept += chunk
                    if len(kept) > MAX_USAGE_BYTES:
                        del kept[: len(kept) - MAX_USAGE_BYTES]
                    yield chunk
            finally:
                await answer.aclose()
                self._done(node_id)
            if answer.status_code == 200:
                self._served(bytes(kept), streamed)

        return StreamingResponse(relay(), status_code=answer.status_code, headers=headers)

    def _served(self, kept: bytes, streamed: bool) -> None:
        """Count the cached tokens the node reported (its ``usage``; a stream's only with
        ``include_usage``)."""
        usage = None
        try:
            if streamed:
                for line in reversed(kept.split(b"\n")):
                    if line.startswith(b"data: {") and b'"prompt_tokens_details"' in line:
                        usage = json.loads(line[len(b"data: ") :]).get("usage")
                        break
            else:
                usage = json.loads(kept).get("usage")
        except ValueError:
            return
        if isinstance(usage, dict):
            details = usage.get("prompt_tokens_details") or {}
            self.metrics.served_cached_tokens.inc(int(details.get("cached_tokens") or 0))
            self.metrics.prompt_tokens.inc(int(usage.get("prompt_tokens") or 0))
