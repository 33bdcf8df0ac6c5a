"""What the coordinator's route handlers get from their app, as FastAPI dependencies.

The routers (``coordinator.api.app``, the ``*_api`` modules, ``coordinator.api.ops_app``, the
console) are module-level: nothing is captured when an app is built. :func:`provide_api` (or, for
the consumers-only ops app, :func:`provide`) puts what the process was configured with on
``app.state`` once, when the app is created, so a bad configuration still fails at start-up; the
database itself is on ``app.state.database`` from the app's lifespan
(:func:`coordinator.ledger.db.database_lifespan`). Handlers ask for what they need with the
``Annotated`` aliases below, which read it back per request.

Who the caller is comes from here too, checked in the order the parameters are declared and
before any body or query parameter is looked at: a caller who may not be here is answered 401
or 403 whatever else is wrong with the request.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, FastAPI, Request
from sqlalchemy.ext.asyncio import AsyncSession

from coordinator.api.auth import requires
from coordinator.http import ApiError
from coordinator.keys.data_keys import KeyService
from coordinator.keys.node_keys import EnrolledKey, authenticate_node
from coordinator.ledger.db import request_session
from coordinator.readiness import ConsumerReadiness
from coordinator.settings import CoordinatorSettings
from identity.metrics_access import scrape_refusal
from identity.roles import ERASURE_REQUESTERS, LEDGER_READERS, PLATFORM_ADMINS, PRODUCER_KEY_ADMINS
from identity.signing import EnvelopeSigner
from identity.tokens import Operator, TokenVerifier


def provide(
    app: FastAPI, settings: CoordinatorSettings, readiness: ConsumerReadiness | None
) -> None:
    """What every coordinator app serves from: its settings and the readiness of this process's
    consumers (None: none run here)."""
    app.state.settings = settings
    app.state.readiness = readiness


def provide_api(
    app: FastAPI, settings: CoordinatorSettings, readiness: ConsumerReadiness | None
) -> None:
    """What the ledger API serves from, checked now: ValueError for a configuration the operator has to fix.

    The operator token verifier (read by ``coordinator.api.auth`` as well), the command signer
    and the decoded master key are made once here, not per request.
    """
    if not settings.operator_auth.configured:
        raise ValueError(
            "configure operator_auth (the operator issuer's key): the API accepts only operator tokens"
        )
    provide(app, settings, readiness)
    app.state.operator_verifier = TokenVerifier(settings.operator_auth, secret_env=None)
    app.state.command_signer = settings.command_signer()
    app.state.master_key = settings.keys.master_key_bytes()


def _settings(request: Request) -> CoordinatorSettings:
    return request.app.state.settings


def _readiness(request: Request) -> ConsumerReadiness | None:
    return request.app.state.readiness


def _command_signer(request: Request) -> EnvelopeSigner:
    return request.app.state.command_signer


Settings = Annotated[CoordinatorSettings, Depends(_settings)]
Readiness = Annotated[ConsumerReadiness | None, Depends(_readiness)]
CommandSigner = Annotated[EnvelopeSigner, Depends(_command_signer)]
Session = Annotated[AsyncSession, Depends(request_session)]
"""A session of the ledger database for this request; the handler commits what it changes."""

Reader = Annotated[Operator, Depends(requires(LEDGER_READERS))]
"""An operator of any role (tenant-bound ones still see only their tenant:
``coordinator.api.auth.require_tenant``)."""
PlatformAdmin = Annotated[Operator, Depends(requires(PLATFORM_ADMINS))]
ErasureRequester = Annotated[Operator, Depends(requires(ERASURE_REQUESTERS))]
ProducerKeyAdmin = Annotated[Operator, Depends(requires(PRODUCER_KEY_ADMINS))]


def require_scraper(request: Request, settings: Settings) -> None:
    """The metrics bearer token, checked before the database session is opened: an unauthenticated
    scrape costs nothing."""
    refusal = scrape_refusal(request.headers.get("authorization"), settings.metrics.token)
    if refusal is not None:
        status_code, code, message = refusal
        raise ApiError(
            status_code,
            "authentication_error" if status_code == 401 else "invalid_request_error",
            code,
            message,
        )


async def _governance_caller(request: Request) -> EnrolledKey:
    return await authenticate_node(request, "the governance state")


async def _key_service_caller(request: Request) -> EnrolledKey:
    return await authenticate_node(request, "the key service")


async def _key_service(
    request: Request, _: Annotated[EnrolledKey, Depends(_key_service_caller)], settings: Settings
) -> KeyService | None:
    """The data key service for an authenticated node; None when this coordinator holds no keys."""
    master_key: bytes | None = request.app.state.master_key
    subject_key = settings.ledger.subject_key
    if master_key is None or subject_key is None:
        return None
    return KeyService(
        request.app.state.database, master_key, subject_key.get_secret_value().encode()
    )


GovernanceCaller = Annotated[EnrolledKey, Depends(_governance_caller)]
"""The enrolled node that made the request's bearer credential (401 for anyone else)."""
KeyServiceForNode = Annotated[KeyService | None, Depends(_key_service)]
"""The key service once the caller is authenticated as an enrolled node (401 for anyone else); None
without keys."""
