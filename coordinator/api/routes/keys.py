"""HTTP access to the data key service for GPU nodes (``coordinator.keys.data_keys``).

``POST /v1/keys/resolve {tenant_id, subject_hash?}`` → ``{key_id, key}``: the
live key of a tenant (or of one subject in it, by keyed digest), created on
first use. ``GET /v1/keys/{key_id}`` → ``{key_id, key}``; 410 ``key_destroyed``
once the key is destroyed, 404 ``key_not_found`` for an id never issued.
Keys travel base64-encoded.

Only nodes may call these, each with a credential only its own enrolled key can
make: a short-lived EdDSA JWT (``identity.node_credentials``) whose key id the
enrollment registry (``coordinator.keys.node_keys``) knows, unrevoked, for the node it
names. Anything else — an end-user or operator token whatever roles it claims, an
unknown or revoked key, a credential naming another node — is 401. Responses carry
``Cache-Control: no-store`` so no proxy keeps a key, and nothing here logs a
key or a wrapped key — only key ids, which are random and name nobody.
Without a master key (``KVLEDGER_MASTER_KEY``) or a subject key the endpoints
answer 503 ``keys_not_configured`` instead of inventing unwrapped keys.
"""

from __future__ import annotations

import base64
import logging
from typing import Annotated

from fastapi import APIRouter, Path
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from coordinator.api.dependencies import KeyServiceForNode, Settings
from coordinator.http import error_response
from coordinator.keys.data_keys import MasterKeyError
from coordinator.settings import CoordinatorSettings
from events.schema import Name
from identity.sealing import KEY_ID_HEX_CHARS

log = logging.getLogger(__name__)

_NO_STORE = {"Cache-Control": "no-store"}
KEY_ID_PATTERN = rf"^[0-9a-f]{{{KEY_ID_HEX_CHARS}}}$"


class ResolveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant_id: Name
    subject_hash: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    """``events.schema.subject_digest(subject_key, tenant_id, subject)`` for a user-scope key; absent for tenant scope."""


def _key_response(key_id: str, key: bytes) -> JSONResponse:
    return JSONResponse(
        content={"key_id": key_id, "key": base64.b64encode(key).decode()}, headers=_NO_STORE
    )


def _master_key_mismatch(error: MasterKeyError) -> JSONResponse:
    log.error("%s", error)
    return error_response(
        500,
        "server_error",
        "master_key_mismatch",
        "a stored data key does not unwrap with the configured master key",
        _NO_STORE,
    )


router = APIRouter(prefix="/v1/keys")


def _not_configured(settings: CoordinatorSettings) -> JSONResponse:
    """Names the settings the key service still needs (the service is None without both)."""
    missing = [
        name
        for name, value in (
            ("KVLEDGER_MASTER_KEY", settings.keys.master_key),
            ("KVLEDGER_SUBJECT_KEY", settings.ledger.subject_key),
        )
        if value is None
    ]
    return error_response(
        503,
        "server_error",
        "keys_not_configured",
        f"this coordinator serves no data keys: set {' and '.join(missing)}",
        _NO_STORE,
    )


@router.post("/resolve")
async def resolve(
    body: ResolveRequest, service: KeyServiceForNode, settings: Settings
) -> JSONResponse:
    """The live key of the tenant (or subject), created on first use; the same for every caller."""
    if service is None:
        return _not_configured(settings)
    try:
        key_id, key = await service.resolve(body.tenant_id, body.subject_hash)
    except MasterKeyError as error:
        return _master_key_mismatch(error)
    return _key_response(key_id, key)


@router.get("/{key_id}")
async def get_key(
    key_id: Annotated[str, Path(pattern=KEY_ID_PATTERN)],
    service: KeyServiceForNode,
    settings: Settings,
) -> JSONResponse:
    """A key by id, to unseal a block file or snapshot shard that names it."""
    if service is None:
        return _not_configured(settings)
    try:
        record = await service.find(key_id)
    except MasterKeyError as error:
        return _master_key_mismatch(error)
    if record is None:
        return error_response(
            404,
            "not_found_error",
            "key_not_found",
            "no data key was issued under this id",
            _NO_STORE,
        )
    if record.key is None:
        return error_response(
            410, "gone_error", "key_destroyed", "this data key has been destroyed", _NO_STORE
        )
    return _key_response(key_id, record.key)
