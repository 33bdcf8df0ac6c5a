"""The read-only web console: server-rendered pages over the same queries as the JSON API.

Who sees what is the API's rule, checked by the same functions (:mod:`coordinator.api.auth`):
every operator role reads its own tenant's invalidations, erasures and receipts;
``platform-admin`` reads every tenant, the nodes and the backlog; a tenant-bound operator
asking for another tenant's anything (or an id that does not exist) gets 403, as from the API.

Authentication: ``Authorization: Bearer <operator token>`` on each request, or the token
pasted once into ``/ui/login``, kept in an ``HttpOnly``, ``SameSite=Strict`` cookie (``Secure``
when served over https) and verified again on every request, exactly like the header.
The console changes nothing in the ledger; its only state-changing requests are login
and logout, which answer 403 unless ``Origin`` (or, without it, ``Referer``) is this
console's own origin — a cross-site form can neither log a browser in nor out.

Every page is rendered with Jinja autoescaping: tenant, document, node and reason
strings come from events and API callers and are hostile until shown otherwise. The
``Content-Security-Policy`` allows no script at all, as a second line.
"""

from __future__ import annotations

import collections
import shlex
import urllib.parse
import uuid
from collections.abc import Callable, Coroutine
from importlib import resources
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.routing import APIRoute
from jinja2 import Environment, PackageLoader, StrictUndefined
from sqlalchemy import func, select

from coordinator import metrics
from coordinator.api.auth import ForbiddenError, authorize, require_tenant
from coordinator.api.dependencies import Session, Settings
from coordinator.api.node_status import node_statuses
from coordinator.api.routes.erasures import (
    describe_erasure,
    list_erasures,
    readable_erasure,
    served_receipt,
)
from coordinator.api.routes.invalidations import describe_invalidation, list_invalidations
from coordinator.audit.audit_log import latest_tree_head, tree_head_document
from coordinator.ledger.models import Invalidation, Receipt, ReceiptKey
from coordinator.ledger.states import ErasureStatus, InvalidationStatus
from events.schema import MAX_ID_CHARS
from events.tiers import Tier
from identity.roles import LEDGER_READERS
from identity.tokens import AuthError, Operator

COOKIE = "kvledger_console"
MAX_LOGIN_BODY_BYTES = 16 * 1024
PAGE_SIZE = 50
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    # same-origin, not no-referrer: with no-referrer a browser sends "Origin: null" on the login
    # POST
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}

_templates = Environment(
    loader=PackageLoader("coordinator.api.ui", "templates"),
    autoescape=True,
    undefined=StrictUndefined,
)


class _LoginRequired(Exception):
    """No token in the header or the cookie: a browser is sent to the login form."""


class _NotFound(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def render(template: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    context.setdefault("operator", None)
    return HTMLResponse(
        _templates.get_template(template).render(tiers=list(Tier), **context),
        status_code=status_code,
    )


class ConsoleRoute(APIRoute):
    """Answers the API's errors as pages (login form, 403, 400, 404) and adds the security headers to every answer."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def console_handler(request: Request) -> Response:
            try:
                response = await handle(request)
            except _LoginRequired:
                response = RedirectResponse("/ui/login", status_code=303)
            except AuthError as error:
                response = render("login.html", 401, error=f"{error.message} ({error.code})")
                response.headers["WWW-Authenticate"] = "Bearer"
                if COOKIE in request.cookies:
                    response.delete_cookie(COOKIE, path="/ui")
            except ForbiddenError as error:
                response = render(
                    "error.html", 403, title="Forbidden", code=error.code, message=error.message
                )
            except RequestValidationError as error:
                # Name the parameter and the problem, never echo the input.
                problems = "; ".join(
                    f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors()
                )
                response = render(
                    "error.html",
                    400,
                    title="Bad request",
                    code="invalid_parameter",
                    message=problems,
                )
            except _NotFound as error:
                response = render(
                    "error.html", 404, title="Not found", code="not_found", message=error.message
                )
            response.headers.update(SECURITY_HEADERS)
            return response

        return console_handler


def _authorization(request: Request) -> str | None:
    """The header as sent, else the cookie's token as a bearer header; the header wins."""
    header = request.headers.get("authorization")
    if header:
        return header
    token = request.cookies.get(COOKIE)
    return f"Bearer {token}" if token else None


async def _operator(request: Request) -> Operator:
    authorization = _authorization(request)
    if authorization is None:
        raise _LoginRequired()
    # verifying may fetch the issuer's JWKS: off the event loop, as coordinator.api.auth.requires
    # does
    return await run_in_threadpool(
        authorize, request.app.state.operator_verifier, authorization, LEDGER_READERS
    )


def _same_origin(request: Request) -> bool:
    """Whether the browser says this request comes from a page of this console's origin."""
    own = f"{request.url.scheme}://{request.url.netloc}"
    origin = request.headers.get("origin")
    if origin is not None:
        return origin == own
    referer = urllib.parse.urlsplit(request.headers.get("referer", ""))
    return bool(referer.netloc) and f"{referer.scheme}://{referer.netloc}" == own


def _refuse_cross_site(request: Request) -> None:
    if not _same_origin(request):
        raise ForbiddenError(
            "cross_site_request", "this form must be sent from the console's own pages"
        )


def _optional(value: str | None) -> str | None:
    """A blank form field means no filter."""
    return value or None


Reader = Annotated[Operator, Depends(_operator)]
"""Like the API's reader, with the token from the header or the console's cookie; no token: the login form."""
Filter = Annotated[str | None, Query(max_length=MAX_ID_CHARS)]


def _ledger_figures() -> dict[str, Any]:
    """The backlog gauges as :func:`metrics.refresh_ledger_gauges` just set them, and this process's
    ingest lag."""

    def samples(metric: Any) -> list[tuple[str, dict[str, str], float]]:
        return [
            (sample.name, sample.labels, sample.value)
            for family in metric.collect()
            for sample in family.samples
        ]

    dead_letters = {
        labels["topic"]: int(value) for _, labels, value in samples(metrics.DEAD_LETTER_RECORDS)
    }
    nodes = {labels["liveness"]: int(value) for _, labels, value in samples(metrics.NODES)}
    invalidations_open = {
        labels["status"]: int(value) for _, labels, value in samples(metrics.INVALIDATIONS_OPEN)
    }
    erasures_unverified: dict[str, int] = collections.Counter()
    for _, labels, value in samples(metrics.ERASURES_UNVERIFIED):
        erasures_unverified[labels["status"]] += int(value)
    lag = {name: value for name, labels, value in samples(metrics.INGEST_LAG_SECONDS) if not labels}
    num_lag_events = int(lag.get("kvledger_ledger_ingest_lag_seconds_count", 0))
    return {
        "outbox_pending": int(samples(metrics.OUTBOX_PENDING)[0][2]),
        "dead_letters": dict(sorted(dead_letters.items())),
        "num_dead_letters": sum(dead_letters.values()),
        "nodes": nodes,
        "invalidations_open": invalidations_open,
        "erasures_unverified": dict(erasures_unverified),
        "num_ingested_events": num_lag_events,
        "mean_ingest_lag_s": lag["kvledger_ledger_ingest_lag_seconds_sum"] / num_lag_events
        if num_lag_events
        else None,
    }


router = APIRouter(prefix="/ui", route_class=ConsoleRoute, include_in_schema=False)


@router.get("/static/console.css")
async def stylesheet() -> Response:
    css = resources.files("coordinator.api.ui").joinpath("static/console.css").read_bytes()
    return Response(css, media_type="text/css")


@router.get("/login")
async def login_form() -> HTMLResponse:
    return render("login.html", error=None)


@router.post("/login")
async def login(request: Request) -> Response:
    """Verify the pasted token like any request would, then keep it in the cookie."""
    _refuse_cross_site(request)
    body = await request.body()
    if len(body) > MAX_LOGIN_BODY_BYTES:
        return render("login.html", 413, error="the form is too large for an operator token")
    token = "".join(
        urllib.parse.parse_qs(body.decode("utf-8", "replace")).get("token", [""])[0].split()
    )
    if not token:
        return render("login.html", 400, error="paste an operator token")
    await run_in_threadpool(
        authorize, request.app.state.operator_verifier, f"Bearer {token}", LEDGER_READERS
    )
    response = RedirectResponse("/ui/", status_code=303)
    response.set_cookie(
        COOKIE,
        token,
        path="/ui",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    _refuse_cross_site(request)
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(COOKIE, path="/ui")
    return response


@router.get("/")
async def overview(reader: Reader, session: Session, settings: Settings) -> HTMLResponse:
    """Nodes and the backlog for a platform admin (what ``/v1/nodes`` and ``/metrics`` show); a
    tenant's operators see their counts."""
    if not reader.is_platform_admin:
        return render("overview.html", operator=reader, nodes=None, figures=None)
    heartbeat_timeout_s = settings.ledger.heartbeat_timeout_s
    nodes = await node_statuses(session, heartbeat_timeout_s)
    await metrics.refresh_ledger_gauges(session, heartbeat_timeout_s)
    return render("overview.html", operator=reader, nodes=nodes, figures=_ledger_figures())


@router.get("/invalidations")
async def invalidations(
    reader: Reader,
    session: Session,
    tenant: Filter = None,
    doc_id: Filter = None,
    status: InvalidationStatus | Literal[""] = "",  # "": the form's "any status"
    before: Annotated[int | None, Query(ge=1)] = None,
) -> HTMLResponse:
    filters = {"tenant": _optional(tenant), "doc_id": _optional(doc_id), "status": status or None}
    page = await list_invalidations(session, reader, **filters, limit=PAGE_SIZE, before=before)
    return render("invalidations.html", operator=reader, page=page, filters=filters)


@router.get("/invalidations/{command_id}")
async def invalidation(command_id: uuid.UUID, reader: Reader, session: Session) -> HTMLResponse:
    found = await session.get(Invalidation, command_id)
    require_tenant(reader, None if found is None else found.predicate.get("tenant"))
    if found is None:
        raise _NotFound(f"no invalidation {command_id}")
    return render(
        "invalidation.html",
        operator=reader,
        invalidation=await describe_invalidation(session, found),
    )


@router.get("/erasures")
async def erasures(
    reader: Reader,
    session: Session,
    tenant: Filter = None,
    status: ErasureStatus | Literal[""] = "",  # "": the form's "any status"
    before: Annotated[str | None, Query(max_length=80)] = None,
) -> HTMLResponse:
    filters = {"tenant": _optional(tenant), "status": status or None}
    try:
        page = await list_erasures(session, reader, **filters, limit=PAGE_SIZE, before=before)
    except ValueError as error:
        return render(
            "error.html",
            400,
            operator=reader,
            title="Bad request",
            code="invalid_parameter",
            message=str(error),
        )
    return render("erasures.html", operator=reader, page=page, filters=filters)


@router.get("/erasures/{erasure_id}")
async def erasure(erasure_id: uuid.UUID, reader: Reader, session: Session) -> HTMLResponse:
    found = await readable_erasure(session, reader, erasure_id)
    if found is None:
        raise _NotFound(f"no erasure {erasure_id}")
    described = await describe_erasure(session, found)
    receipt_file = f"receipt-{erasure_id}.json"
    commands = {
        "fetch": shlex.join(
            [
                "kvledger",
                "erasure",
                "receipt",
                str(erasure_id),
                "--tenant",
                found.tenant_id,
                "--output",
                f"receipt-{erasure_id}",
            ]
        ),
        "verify": shlex.join(
            [
                "kvledger",
                "verify-receipt",
                receipt_file,
                "--public-key",
                "receipt-keys.json",
                "--checkpoint",
                "checkpoint.json",
            ]
        ),
    }
    return render(
        "erasure.html",
        operator=reader,
        erasure=described,
        receipt_file=receipt_file,
        commands=commands,
    )


@router.get("/erasures/{erasure_id}/receipt.json")
async def receipt(erasure_id: uuid.UUID, reader: Reader, session: Session) -> Response:
    """The receipt as ``GET /v1/erasures/{id}/receipt`` serves it, as a download."""
    found = await readable_erasure(session, reader, erasure_id)
    if found is None:
        raise _NotFound(f"no erasure {erasure_id}")
    issued = await session.scalar(select(Receipt).where(Receipt.erasure_id == found.id))
    if issued is None:
        raise _NotFound(f"the erasure is {found.status}; no receipt yet")
    served = await served_receipt(session, issued, None)
    if isinstance(served, Response):
        return served
    disposition = f'attachment; filename="receipt-{erasure_id}.json"'
    return JSONResponse(served, headers={"Content-Disposition": disposition})


@router.get("/audit")
async def audit(reader: Reader, session: Session) -> HTMLResponse:
    head = await latest_tree_head(session)
    num_keys = await session.scalar(select(func.count()).select_from(ReceiptKey))
    return render(
        "audit.html",
        operator=reader,
        checkpoint=None if head is None else tree_head_document(head),
        num_keys=num_keys,
    )
