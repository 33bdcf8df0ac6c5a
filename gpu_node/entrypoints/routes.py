"""OpenAI-compatible HTTP API of a GPU node (docs/design.md §4).

The official ``openai`` client must work unchanged, so request and response
bodies follow OpenAI's chat-completions shapes, and *every* error — including
FastAPI's own validation and routing errors — is rendered as OpenAI's
``{"error": {"message", "type", "param", "code"}}`` (the client reads
``error.message``/``error.code`` from it and maps the HTTP status to an
exception class).

Cache governance enters through two per-message extension fields,
``cache_scope`` and ``document``. The caller's identity never comes from the
body: the :class:`Principal` that salts cache keys is built only from the
verified bearer token.

Versions are enforced where messages are converted: a request naming a document
version or carrying a token policy version older than the node's command stream
made current is refused (409 ``stale_document_version`` / 401
``stale_authorization``), because serving it would rebuild and reuse exactly the
KV an invalidation just deleted. On a node whose namespace was retired, requests
are served without the prefix cache and the response says so in
:data:`CACHE_BYPASS_HEADER`.

Two routes serve replicas (``gpu_node.cache.peers``): a chat request may carry a router's pull hint
(:func:`_pull_hint`), and ``POST /v1/kvledger/peer/blocks`` serves a prefix's sealed records to
an enrolled peer of this namespace — authenticated by its peer credential, not by a user token.

Prompt text is never logged, nor tenant or subject ids: log lines carry the
request id (``X-Request-Id``, :mod:`events.logs`), the completion id and token
counts only; the access line has method, path, status and duration.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from events.logs import RequestIdMiddleware
from events.pull_hint import MAX_HINT_BLOCKS, PULL_BLOCKS_HEADER, PULL_FROM_HEADER
from events.schema import (
    MAX_ID_CHARS,
    MAX_LIST_ITEMS,
    MAX_SAFE_INT,
    DocumentVersion,
    Name,
    check_identifier,
)
from gpu_node.cache.layout_sampler import layout_sampler
from gpu_node.cache.peers import (
    PULL_PATH,
    PullHint,
    PullRefused,
    authorize_pull,
    frame_chunks,
    frames_length,
    read_prefix,
    seal_records,
)
from gpu_node.engine.async_engine import (
    AsyncEngine,
    GenerationDone,
    GenerationRequest,
    PromptStats,
    PromptTooLongError,
    SamplingParams,
    TokenDelta,
)
from gpu_node.entrypoints.vllm_routes import vllm_router
from gpu_node.governance.usage import usage_meter
from gpu_node.settings import RequestLimits
from identity.metrics_access import scrape_refusal
from identity.roles import PLATFORM_ADMIN
from identity.tokens import AuthError, Operator, TokenVerifier
from prefix_keys.blocks import TENANT_WIDE_AUTH_SCOPE, CacheScope, DocumentRef, Principal
from prefix_keys.model_files import keying_digest
from prefix_keys.prompt import ChatMessage, request_message
from prefix_keys.versions import Staleness, VersionRegistry

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
CACHE_BYPASS_HEADER = "x-kvledger-cache-bypass"
"""Set (to the reason) on responses served without the prefix cache."""


# --------------------------------------------------------------------------- errors


class ApiError(Exception):
    """An error answered to the caller in OpenAI's error shape."""

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
        self.status_code = status_code
        self.message = message
        self.code = code
        self.type = type
        self.param = param


def error_body(message: str, *, type: str, code: str | None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _error_response(exc: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    body = error_body(exc.message, type=exc.type, code=exc.code, param=exc.param)
    return JSONResponse(body, status_code=exc.status_code, headers=headers)


# pydantic names union members in error locations ("str", "list[TextPart]");
# they are not part of the request's field path.
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _param_from_loc(loc: tuple) -> str | None:
    """``("messages", 0, "content")`` → ``"messages[0].content"`` (OpenAI's ``param`` style)."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif "[" in part or part in _UNION_TAGS:
            continue
        else:
            param += f".{part}" if param else str(part)
    return param or None


_CODE_BY_FIELD = {
    "messages.document.id": "invalid_document_id",
    "messages.document.version": "invalid_document_version",
    "messages.document.auth_scope": "invalid_auth_scope",
    "max_tokens": "invalid_max_tokens",
    "max_completion_tokens": "invalid_max_tokens",
    "seed": "invalid_seed",
}
"""Fields whose refusal has a code of its own (they reach the ledger or the sampler); others:
``invalid_value``."""


def _field_code(loc: tuple) -> str:
    path = ".".join(
        part
        for part in loc
        if isinstance(part, str) and "[" not in part and part not in _UNION_TAGS
    )
    return _CODE_BY_FIELD.get(path, "invalid_value")


MAX_ECHOED_NAME_CHARS = 100


def _validation_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    # For a union (e.g. content: str | list of parts) pydantic reports one error
    # per member; the deepest location is the one that names the actual problem.
    deepest = max(errors, key=lambda error: len(error.get("loc", ())))
    if deepest.get("type") == "json_invalid":
        return ApiError(
            400, f"request body is not valid JSON: {deepest.get('msg')}", code="invalid_json"
        )
    param = _param_from_loc(tuple(deepest.get("loc", ())))
    if deepest.get("type") == "extra_forbidden":
        # The name is the caller's own key, cut short: it may be as long as the body.
        param = (param or "")[:MAX_ECHOED_NAME_CHARS]
        return ApiError(
            400,
            f"'{param}' is not supported by this node",
            code="unsupported_parameter",
            param=param,
        )
    where = f" at '{param}'" if param else ""
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    # Only pydantic's message is echoed, never the offending input (it may be prompt text).
    code = _field_code(tuple(deepest.get("loc", ())))
    return ApiError(
        400, f"invalid request{where}: {deepest.get('msg')}{more}", code=code, param=param
    )


# --------------------------------------------------------------------------- request models


class _OpenAIModel(BaseModel):
    """A field this node does not implement is refused (400 ``unsupported_parameter`` naming it), never
    dropped: a caller who sends ``logit_bias``, ``response_format`` or ``user`` expects it to have an effect."""

    model_config = ConfigDict(extra="forbid")


class TextPart(_OpenAIModel):
    type: Literal["text"]
    text: str


class DocumentField(BaseModel):
    """The ``document`` extension of a message: whose text this is and who may read it.

    Its fields travel into block provenance, kv-events and the ledger, so they carry the
    event contract's bounds (no control characters, at most 256 characters, versions 0..2^53-2).
    """

    model_config = ConfigDict(extra="forbid")

    id: Name
    version: DocumentVersion
    auth_scope: Name


class ChatMessageIn(_OpenAIModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    cache_scope: Literal["public", "tenant", "user"] = "user"
    document: DocumentField | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: every content chunk carries the usage so far (guidellm asks for it)."""


MAX_STOP_TOKEN_IDS = 64
"""Most ``stop_token_ids`` in one request: each is checked per generated token."""


class ChatCompletionRequest(_OpenAIModel):
    """Field bounds that do not depend on settings; :func:`_sampling` applies the configured ones.

    Beyond OpenAI's fields the node implements vLLM's ``min_tokens``, ``ignore_eos`` and
    ``stop_token_ids``. ``n``, ``logprobs``, ``tools``, ``presence_penalty`` and
    ``frequency_penalty`` are accepted only at the value that changes nothing (1, false,
    none, 0, 0); any other field is refused (:class:`_OpenAIModel`).
    """

    model: Name
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_SAFE_INT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_SAFE_INT)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SAFE_INT)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    tools: list[dict] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    min_tokens: int = Field(0, ge=0, le=MAX_SAFE_INT)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_SAFE_INT)]] | None = Field(
        None, max_length=MAX_STOP_TOKEN_IDS
    )


# --------------------------------------------------------------------------- request → engine


def _too_large(limits: RequestLimits) -> ApiError:
    return ApiError(
        413,
        f"the request body is larger than {limits.max_request_bytes} bytes (limits.max_request_bytes)",
        code="request_too_large",
    )


async def _bounded_body(request: Request, limits: RequestLimits) -> bytes:
    """The body, refused once it exceeds ``max_request_bytes``: by its Content-Length before
    reading anything, and while reading for chunked bodies (or a Content-Length that lies)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_request_bytes:
        raise _too_large(limits)
    chunks = []
    num_bytes = 0
    async for chunk in request.stream():
        num_bytes += len(chunk)
        if num_bytes > limits.max_request_bytes:
            raise _too_large(limits)
        chunks.append(chunk)
    return b"".join(chunks)


async def _read_body(request: Request, limits: RequestLimits) -> ChatCompletionRequest:
    """Parse the body only after the caller is authenticated, and only once its size is known to be
    bounded.

    A ``body: Model`` parameter would make FastAPI parse JSON before running the
    auth dependency, answering unauthenticated callers with 400 instead of 401.
    """
    data = await _bounded_body(request, limits)
    try:
        body = ChatCompletionRequest.model_validate_json(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_input=False)) from None
    if len(body.messages) > limits.max_messages:
        raise ApiError(
            400,
            f"the request has {len(body.messages)} messages; at most {limits.max_messages} are allowed (limits.max_messages)",
            code="too_many_messages",
            param="messages",
        )
    _check_provenance_limits(body)
    return body


def _check_provenance_limits(body: ChatCompletionRequest) -> None:
    """Refuse a prompt whose blocks would carry more documents or auth scopes than a kv-event lists.

    A block's provenance accumulates every document and auth scope before it, and the wire
    contract (:data:`events.schema.MAX_LIST_ITEMS` on ``BlockProvenance``) carries at most that
    many of each: past it a block could be cached and served but never reported to the ledger,
    so neither invalidated by it nor covered by an erasure receipt. Counted over the whole
    request (distinct ``id@version`` documents; distinct auth scopes, tenant-wide ``*``
    included), before anything is rendered or cached.
    """
    documents = {
        (m.document.id, m.document.version) for m in body.messages if m.document is not None
    }
    auth_scopes = {m.document.auth_scope for m in body.messages if m.document is not None}
    if any(m.document is None and m.cache_scope == "tenant" for m in body.messages):
        auth_scopes.add(TENANT_WIDE_AUTH_SCOPE)
    for what, count in (("documents", len(documents)), ("auth scopes", len(auth_scopes))):
        if count > MAX_LIST_ITEMS:
            raise ApiError(
                400,
                f"the request names {count} distinct {what}; at most {MAX_LIST_ITEMS} are allowed "
                f"(the ledger contract's MAX_LIST_ITEMS per block)",
                code=f"too_many_{what.replace(' ', '_')}",
                param="messages",
            )


def _to_messages(
    body: ChatCompletionRequest, principal: Principal, versions: VersionRegistry
) -> tuple[ChatMessage, ...]:
    """Map API messages to engine messages, enforcing document authorization and current versions.

    A document message is tenant scope by definition; an explicit contrary
    ``cache_scope`` is refused rather than silently overridden, and a document
    whose auth scope is not among the caller's token scopes is forbidden
    (its KV must never be built or read under this caller's identity). A
    document or token policy version older than the node knows is refused
    (:func:`_stale_error`).
    """
    messages = []
    for index, message in enumerate(body.messages):
        scope = CacheScope.parse(message.cache_scope)
        document = None
        if message.document is not None:
            if "cache_scope" in message.model_fields_set and scope != CacheScope.TENANT:
                raise ApiError(
                    400,
                    "a document message is tenant scope; omit cache_scope or set it to 'tenant'",
                    code="invalid_value",
                    param=f"messages[{index}].cache_scope",
                )
            if not principal.holds(message.document.auth_scope):
                raise ApiError(
                    403,
                    f"the token does not grant auth scope {message.document.auth_scope!r} required by document {message.document.id!r}",
                    type="permission_error",
                    code="document_scope_forbidden",
                    param=f"messages[{index}].document.auth_scope",
                )
            document = DocumentRef(
                doc_id=message.document.id,
                version=message.document.version,
                auth_scope=message.document.auth_scope,
            )
        messages.append(request_message(message.role, message.text(), scope, document))
    stale = versions.check(principal, messages)
    if stale is not None:
        raise _stale_error(stale)
    return tuple(messages)


def _stale_error(stale: Staleness) -> ApiError | AuthError:
    """The refusal :class:`Staleness` describes (a fleet router answers the same from its own
    registry)."""
    if stale.kind == "policy":
        return AuthError(stale.code, stale.message)
    return ApiError(stale.status_code, stale.message, code=stale.code, param=stale.param)


def _sampling(
    body: ChatCompletionRequest, max_context_tokens: int, limits: RequestLimits
) -> SamplingParams:
    """Only fields the caller set are passed on, so the engine's defaults apply otherwise.

    A requested completion length above ``limits.max_completion_tokens`` or the model's
    context is refused (it could never be produced); the engine then stops at whatever
    context the prompt leaves.
    """
    if body.n is not None and body.n > 1:
        raise ApiError(400, "only n=1 is supported", code="unsupported_value", param="n")
    if body.logprobs:
        raise ApiError(
            400, "logprobs are not supported", code="unsupported_value", param="logprobs"
        )
    if body.tools:
        raise ApiError(400, "tools are not supported", code="unsupported_parameter", param="tools")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise ApiError(
                400,
                f"{name} is not supported; only 0 is accepted",
                code="unsupported_value",
                param=name,
            )
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stop) > 4:
        raise ApiError(
            400, "at most 4 stop sequences are allowed", code="invalid_value", param="stop"
        )
    bound = min(limits.max_completion_tokens, max_context_tokens)
    for name in ("max_completion_tokens", "max_tokens"):
        value = getattr(body, name)
        if value is not None and value > bound:
            raise ApiError(
                400,
                f"{name} is {value}; at most {bound} is allowed (the model's context and limits.max_completion_tokens)",
                code="invalid_max_tokens",
                param=name,
            )
    requested = body.max_completion_tokens or body.max_tokens or DEFAULT_MAX_TOKENS
    if body.min_tokens > requested:
        raise ApiError(
            400,
            f"min_tokens is {body.min_tokens}; it must not exceed max_tokens ({requested})",
            code="invalid_value",
            param="min_tokens",
        )
    options: dict = {
        "max_tokens": min(requested, max_context_tokens),
        "stop": stop,
        "stop_token_ids": tuple(body.stop_token_ids or ()),
        "min_tokens": body.min_tokens,
        "ignore_eos": body.ignore_eos,
    }
    for name in ("temperature", "top_p", "seed"):
        value = getattr(body, name)
        if value is not None:
            options[name] = value
    return SamplingParams(**options)


async def _start(
    engine: AsyncEngine, request: GenerationRequest
) -> tuple[AsyncIterator, PromptStats]:
    """Start generation and wait for its PromptStats.

    The engine refuses an oversize prompt before yielding anything; pulling the
    first item here turns that into a proper HTTP 400 even for streaming
    requests, whose status line has not been sent yet.
    """
    try:
        stream = engine.generate(request)
        stats = await anext(stream)
    except PromptTooLongError as exc:
        raise ApiError(
            400,
            f"This model's maximum context length is {exc.max_context_tokens} tokens, "
            f"but the prompt has {exc.num_prompt_tokens} tokens. Shorten the messages.",
            code="context_length_exceeded",
            param="messages",
        ) from None
    except ValueError as exc:
        # The engine's contract: bad caller input surfaces as ValueError (a SamplingError names its
        # field).
        raise ApiError(
            400, str(exc), code="invalid_value", param=getattr(exc, "param", None)
        ) from None
    assert isinstance(stats, PromptStats), (
        f"engine must yield PromptStats first, got {type(stats).__name__}"
    )
    return stream, stats


def _usage(stats: PromptStats, num_completion_tokens: int, details: bool = True) -> dict:
    """A response's usage; ``details`` false for vLLM's per-chunk usage, which has only the three
    counts."""
    usage: dict = {
        "prompt_tokens": stats.num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": stats.num_prompt_tokens + num_completion_tokens,
    }
    if details:
        usage["prompt_tokens_details"] = {"cached_tokens": stats.num_cached_tokens}
    return usage


# --------------------------------------------------------------------------- app


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        raise AuthError("invalid_token", "the Authorization header must use the Bearer scheme")
    return token.strip()


def _principal(request: Request) -> Principal:
    """The end user, from the bearer token only (never from the body)."""
    verifier: TokenVerifier = request.app.state.verifier
    return verifier.verify(_bearer(request))


def _platform_admin(request: Request) -> Operator:
    """A ``platform-admin`` with a token of the operator issuer; end users' tokens never qualify."""
    verifier: TokenVerifier | None = request.app.state.operator_verifier
    if verifier is None:
        raise ApiError(
            403,
            "this node has no operator issuer configured (operator_auth), so no operator endpoint answers",
            type="permission_error",
            code="operator_auth_not_configured",
        )
    operator = verifier.verify_operator(_bearer(request))
    if not operator.is_platform_admin:
        raise ApiError(
            403,
            f"requires the {PLATFORM_ADMIN!r} role",
            type="permission_error",
            code="insufficient_role",
        )
    return operator


Caller = Annotated[Principal, Depends(_principal)]
PlatformAdmin = Annotated[Operator, Depends(_platform_admin)]


def create_app(
    engine: AsyncEngine, verifier: TokenVerifier, *, operator_verifier: TokenVerifier | None = None
) -> FastAPI:
    """Build the node's HTTP app around ``engine``.

    ``verifier`` checks end users' tokens; ``operator_verifier`` (the operator
    issuer, a different key) the operators' — without it no operator endpoint answers.

    The caller owns the engine's lifecycle (``gpu_node.entrypoints.server`` starts it on the
    serving event loop before the app takes traffic); until ``engine.ready`` the
    app answers 503 rather than serve from a cache that may still hold blocks
    pending invalidation. The routes are module-level (:data:`router`); what they
    serve from is put on ``app.state`` here, once, and read back per request by
    the dependencies above.
    """
    app = FastAPI(title="kvledger GPU node")
    app.state.engine = engine
    app.state.verifier = verifier
    app.state.operator_verifier = operator_verifier
    app.state.started_at = int(time.time())
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(AuthError, _auth_error)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.include_router(router)
    app.include_router(vllm_router(require_ready, _principal))
    app.add_middleware(
        RequestIdMiddleware,
        access_logger="gpu_node.access",
        error_body=json.dumps(
            {
                "error": {
                    "message": "internal server error",
                    "type": "server_error",
                    "param": None,
                    "code": "internal_error",
                }
            }
        ).encode(),
        observe=engine.metrics.observe_http,
        quiet_paths=frozenset({LOAD_PATH}),
    )
    return app


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError), f"registered for ApiError, got {type(exc).__name__}"
    return _error_response(exc)


async def _auth_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, AuthError), f"registered for AuthError, got {type(exc).__name__}"
    error = ApiError(401, exc.message, type="authentication_error", code=exc.code)
    return _error_response(error, headers={"WWW-Authenticate": "Bearer"})


async def _invalid_request(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError), (
        f"registered for RequestValidationError, got {type(exc).__name__}"
    )
    return _error_response(_validation_error(exc))


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException), (
        f"registered for HTTPException, got {type(exc).__name__}"
    )
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    error = ApiError(exc.status_code, str(exc.detail), code=code)
    return _error_response(error, headers=getattr(exc, "headers", None))


async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    logger.error("unhandled %s in request", type(exc).__name__)
    return _error_response(
        ApiError(500, "internal server error", type="server_error", code="internal_error")
    )


def _engine(request: Request) -> AsyncEngine:
    return request.app.state.engine


Engine = Annotated[AsyncEngine, Depends(_engine)]


def _require_ready(engine: AsyncEngine) -> None:
    # Until the node has replayed pending invalidations it may hold blocks
    # that must no longer be served, so it serves nothing.
    if not engine.ready:
        raise ApiError(503, "the node is not ready yet", type="server_error", code="not_ready")


def require_ready(engine: Engine) -> None:
    """Dependency: the node's 503 ``not_ready`` until its engine is ready."""
    _require_ready(engine)


def _require_model(engine: AsyncEngine, name: str) -> None:
    if name != engine.model_name:
        raise ApiError(
            404,
            f"the model {name!r} does not exist on this node",
            code="model_not_found",
            param="model",
        )


def _model_card(request: Request, engine: AsyncEngine) -> dict:
    return {
        "id": engine.model_name,
        "object": "model",
        "created": request.app.state.started_at,
        "owned_by": "kvledger",
    }


def _require_scraper(request: Request, engine: Engine) -> None:
    """The operational views aggregate every tenant's traffic: the operator's metrics token only."""
    refusal = scrape_refusal(request.headers.get("authorization"), engine.settings.metrics.token)
    if refusal is not None:
        status_code, code, message = refusal
        if status_code == 401:
            raise AuthError(code, message)
        raise ApiError(status_code, message, code=code)


router = APIRouter()
"""The node's own routes; vLLM's operational routes are
:func:`gpu_node.entrypoints.vllm_routes.vllm_router`."""


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz", dependencies=[Depends(require_ready)])
async def readyz() -> dict:
    return {"status": "ready"}


@router.get("/metrics", dependencies=[Depends(_require_scraper)])
async def metrics(engine: Engine) -> Response:
    return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(request: Request, _: Caller, engine: Engine) -> dict:
    return {"object": "list", "data": [_model_card(request, engine)]}


@router.get("/v1/models/{model:path}")
async def get_model(request: Request, model: str, _: Caller, engine: Engine) -> dict:
    _require_model(engine, model)
    return _model_card(request, engine)


@router.get("/v1/cache/stats", dependencies=[Depends(_require_scraper)])
async def cache_stats(engine: Engine) -> dict:
    return engine.cache_stats()


@router.get("/v1/kvledger/keying", dependencies=[Depends(_require_scraper)])
async def keying(request: Request, engine: Engine) -> dict:
    """What a fleet router needs to compute this node's block keys (``kvledger router``): the model
    name, namespace and block size, and the digest of the tokenizer and chat template files
    (:func:`prefix_keys.model_files.keying_digest`), which the router compares with its own
    copy's."""
    digest = getattr(request.app.state, "keying_digest", None)
    if digest is None:
        digest = request.app.state.keying_digest = await asyncio.to_thread(
            keying_digest, engine.settings.model_dir
        )
    return {
        "model": engine.model_name,
        "namespace": engine.namespace.namespace,
        "block_size": engine.block_size,
        "keying_digest": digest,
    }


LOAD_PATH = "/v1/kvledger/load"


@router.get(LOAD_PATH, dependencies=[Depends(_require_scraper)])
async def load(engine: Engine) -> dict:
    """The scheduler's queue as of its last step, for a fleet router's scoring (``router.load``): a few bytes a fleet
    router polls several times a second, where ``/metrics`` renders every series. Logged at DEBUG when answered."""
    registry = engine.metrics.registry
    return {
        "num_requests_running": int(
            registry.get_sample_value("kvledger_num_requests_running") or 0
        ),
        "num_requests_waiting": int(
            registry.get_sample_value("kvledger_num_requests_waiting") or 0
        ),
    }


@router.get("/v1/cache/layout", dependencies=[Depends(_require_scraper)])
async def cache_layout(engine: Engine) -> dict:
    return layout_sampler(engine).snapshot()


@router.post("/v1/cache/snapshots", status_code=201)
async def write_snapshot(_: PlatformAdmin, engine: Engine) -> dict:
    _require_ready(engine)
    return await engine.write_snapshot()


def _pull_hint(request: Request) -> PullHint | None:
    """The pull hint a router sent (:data:`PULL_FROM_HEADER`, :data:`PULL_BLOCKS_HEADER`); None without one.

    A hint only names a node id, which the engine resolves in its own trusted peer list
    (``peers.urls``), and asks for blocks of the caller's own keys: whoever sends it can at
    most make this node ask a configured peer for blocks the caller could be served anyway.
    """
    node_id = request.headers.get(PULL_FROM_HEADER)
    num_blocks = request.headers.get(PULL_BLOCKS_HEADER)
    if node_id is None and num_blocks is None:
        return None
    try:
        node_id = check_identifier(node_id or "")
        if (
            len(node_id) > MAX_ID_CHARS
            or num_blocks is None
            or not num_blocks.isdigit()
            or not 1 <= int(num_blocks) <= MAX_HINT_BLOCKS
        ):
            raise ValueError("out of range")
    except ValueError:
        raise ApiError(
            400,
            f"a pull hint is {PULL_FROM_HEADER}: <node id> and {PULL_BLOCKS_HEADER}: <1..{MAX_HINT_BLOCKS}>",
            code="invalid_pull_hint",
        ) from None
    return PullHint(node_id, int(num_blocks))


@router.post(PULL_PATH)
async def serve_pull(http_request: Request, engine: Engine) -> Response:
    """A peer node pulls the blocks of a prefix this node holds (``gpu_node.cache.peers``): signed,
    same namespace, sealed records."""
    _require_ready(engine)
    body = await _bounded_body(http_request, engine.settings.limits)
    namespace = engine.namespace.namespace
    try:
        _, block_hashes = await authorize_pull(
            engine.peer_keys,
            http_request.headers.get("authorization"),
            body,
            engine.settings.node_id,
            namespace,
            engine.versions.is_retired(namespace),
        )
    except PullRefused as refusal:
        engine.metrics.peer_serves.labels(refusal.code).inc()
        error_type = "authentication_error" if refusal.status == 401 else "invalid_request_error"
        return JSONResponse(
            error_body(refusal.message, type=error_type, code=refusal.code),
            status_code=refusal.status,
        )
    records = await engine.run_exclusive(
        read_prefix, engine.pool, block_hashes[: engine.settings.peers.max_pull_blocks]
    )
    engine.manager.drain_events()
    # Sealed off the worker and off the lock (a key not held yet is fetched, not a short run).
    sealed = await asyncio.to_thread(seal_records, records, engine.pool.key_provider.blocking())
    engine.metrics.peer_serves.labels("served").inc()

    async def frames() -> AsyncIterator[bytes]:
        for chunk in frame_chunks(sealed):
            yield chunk

    return StreamingResponse(
        frames(),
        media_type="application/octet-stream",
        headers={"Content-Length": str(frames_length(sealed))},
    )


@router.post("/v1/chat/completions")
async def chat_completions(http_request: Request, caller: Caller, engine: Engine) -> Response:
    limits = engine.settings.limits
    body = await _read_body(http_request, limits)
    _require_ready(engine)
    _require_model(engine, body.model)
    sampling = _sampling(body, engine.max_context_tokens, limits)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    # A retired namespace's blocks are being deleted everywhere; new ones must not be built.
    use_cache = not engine.versions.is_retired(engine.namespace.namespace)
    headers = None if use_cache else {CACHE_BYPASS_HEADER: "namespace_retired"}
    request = GenerationRequest(
        request_id=request_id,
        messages=_to_messages(body, caller, engine.versions),
        sampling=sampling,
        principal=caller,
        use_cache=use_cache,
        pull_hint=_pull_hint(http_request) if use_cache else None,
    )
    stream, stats = await _start(engine, request)
    stream = usage_meter(engine).metered(
        stream, caller.tenant_id, stats.num_prompt_tokens, stats.num_cached_tokens
    )
    created = int(time.time())
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        continuous_usage = (
            include_usage
            and body.stream_options is not None
            and body.stream_options.continuous_usage_stats
        )
        events = _sse_events(
            stream,
            stats,
            request_id,
            created,
            engine.model_name,
            include_usage,
            caller,
            continuous_usage,
        )
        return StreamingResponse(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"} | (headers or {}),
        )
    async with aclosing(stream):
        texts: list[str] = []
        done: GenerationDone | None = None
        async for item in stream:
            if isinstance(item, TokenDelta):
                texts.append(item.text)
            else:
                assert isinstance(item, GenerationDone), (
                    f"unexpected engine item {type(item).__name__}"
                )
                done = item
    assert done is not None, "engine stream ended without GenerationDone"
    _log_completion(request_id, stats, done)
    return JSONResponse(
        {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": engine.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(texts)},
                    "logprobs": None,
                    "finish_reason": done.finish_reason,
                }
            ],
            "usage": _usage(stats, done.num_completion_tokens),
        },
        headers=headers,
    )


async def _sse_events(
    stream: AsyncIterator,
    stats: PromptStats,
    request_id: str,
    created: int,
    model: str,
    include_usage: bool,
    caller: Principal,
    continuous_usage: bool = False,
) -> AsyncIterator[str]:
    """``chat.completion.chunk`` events, then ``[DONE]``, framed as server-sent events (``data: ...`` and a blank line).

    Headers are already sent when this runs, so a failure can only be reported
    in-band: an ``error`` event in OpenAI's shape, which the client raises.
    Closing ``stream`` (also on client disconnect, which cancels this generator
    inside the engine's stream) aborts the request in the engine: its sequence
    leaves the batch at the next step and its blocks are released.

    A content chunk is the same JSON every time but for its text: it is built
    once and each token's event is the text's JSON string between the two
    halves (byte for byte what serializing the whole chunk gives), instead of
    serializing a fresh dict per token per stream. Plain Starlette streaming
    rather than sse-starlette: that library keeps a process-wide "server is
    exiting" flag that, once any uvicorn server in the process has shut down,
    ends every later stream at once (tests run several).

    ``continuous_usage`` (vLLM's ``stream_options.continuous_usage_stats``, with
    ``include_usage``): every chunk carries the usage so far instead of null; content
    chunks are then serialized whole.
    """

    def chunk(delta: dict, finish_reason: str | None = None, num_completion_tokens: int = 0) -> str:
        payload: dict = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            ],
        }
        if include_usage:
            payload["usage"] = (
                _usage(stats, num_completion_tokens, details=False) if continuous_usage else None
            )
        return _sse(json.dumps(payload))

    head, tail = chunk({"content": _CONTENT_MARK}).split(json.dumps(_CONTENT_MARK))
    async with aclosing(stream):
        try:
            yield chunk({"role": "assistant", "content": ""})
            done: GenerationDone | None = None
            async for item in stream:
                if isinstance(item, TokenDelta):
                    # The engine holds back incomplete UTF-8 as empty deltas; they carry nothing.
                    if item.text and continuous_usage:
                        yield chunk({"content": item.text}, None, item.num_completion_tokens)
                    elif item.text:
                        yield head + json.dumps(item.text) + tail
                else:
                    assert isinstance(item, GenerationDone), (
                        f"unexpected engine item {type(item).__name__}"
                    )
                    done = item
            assert done is not None, "engine stream ended without GenerationDone"
        except Exception as exc:
            logger.error("request %s failed while streaming: %s", request_id, type(exc).__name__)
            yield _sse(
                json.dumps(
                    error_body("generation failed", type="server_error", code="internal_error")
                )
            )
            return
    yield chunk({}, done.finish_reason, done.num_completion_tokens)
    if include_usage:
        yield _sse(
            json.dumps(
                {
                    "id": request_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": _usage(stats, done.num_completion_tokens),
                }
            )
        )
    _log_completion(request_id, stats, done)
    yield _sse("[DONE]")


_CONTENT_MARK = "\x00content\x00"
"""Stands for a content chunk's text while its template is built; its JSON form (with ``\\u0000``)
cannot occur in the rest."""


def _sse(data: str) -> str:
    return f"data: {data}\n\n"


def _log_completion(request_id: str, stats: PromptStats, done: GenerationDone) -> None:
    logger.info(
        "completion %s prompt_tokens=%d cached_tokens=%d completion_tokens=%d finish=%s",
        request_id,
        stats.num_prompt_tokens,
        stats.num_cached_tokens,
        done.num_completion_tokens,
        done.finish_reason,
    )
