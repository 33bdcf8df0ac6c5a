"""HTTP API of customer-event producer keys (``coordinator.keys.producer_keys``; docs/security.md,
"Signed customer events").

* ``POST /v1/producer-keys {public_key_pem, name, tenants | all_tenants}`` → 201 the key as listed.
  A ``tenant-admin`` enrolls keys bound to its own tenant only (``tenants: [own]``); a
  ``platform-admin`` binds any tenants, or ``all_tenants: true``. Enrolling the same key with the
  same binding again answers the same key; another binding, or a revoked key, is 409.
* ``GET /v1/producer-keys[?tenant=T]`` — the keys that may publish for ``T`` (a tenant-admin: its
  own tenant, always), all-tenant keys included; a platform-admin without ``tenant`` sees every key.
  A tenant-admin sees of each key's binding only whether it includes its own tenant, never the
  others.
* ``POST /v1/producer-keys/{key_id}/revoke`` → 200 ``{key_id, revoked: true}``. A tenant-admin
  revokes only keys bound to its own tenant alone (revoking a shared key would cut off other
  tenants' producers); anything else is 403 ``tenant_forbidden``, whether the key exists or not.

A revocation takes effect at every coordinator replica within ``ledger.node_key_cache_s``.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from coordinator.api.auth import TenantForbiddenError, require_tenant
from coordinator.api.dependencies import ProducerKeyAdmin, Session
from coordinator.http import error_response
from coordinator.keys import producer_keys
from events.schema import MAX_LIST_ITEMS, Name
from identity.signing import load_public_key_pem
from identity.tokens import Operator

router = APIRouter()

MAX_PUBLIC_KEY_PEM_CHARS = 1024
"""An Ed25519 SubjectPublicKeyInfo PEM is 113 characters; anything much longer is not one."""


class Enrollment(BaseModel):
    model_config = ConfigDict(extra="forbid")

    public_key_pem: str = Field(min_length=1, max_length=MAX_PUBLIC_KEY_PEM_CHARS)
    name: Name
    tenants: Annotated[list[Name], Field(min_length=1, max_length=MAX_LIST_ITEMS)] | None = None
    all_tenants: bool = False

    @model_validator(mode="after")
    def _one_binding(self) -> Enrollment:
        if self.all_tenants == (self.tenants is not None):
            raise ValueError("give either tenants or all_tenants: true")
        return self


def _require_binding(operator: Operator, tenants: list[str] | None) -> None:
    """Only a platform-admin binds a key to all tenants or to any other tenant than its own."""
    if tenants is None:
        require_tenant(operator, None)
    else:
        for tenant in tenants:
            require_tenant(operator, tenant)


def _as_seen_by(operator: Operator, key: dict[str, Any]) -> dict[str, Any]:
    """A tenant-admin learns of a key's other tenants nothing: only its own tenant stays in the
    binding."""
    if operator.is_platform_admin:
        return key
    return {**key, "tenants": [tenant for tenant in key["tenants"] if tenant == operator.tenant_id]}


@router.post("/v1/producer-keys")
async def enroll_producer_key(
    body: Enrollment, operator: ProducerKeyAdmin, session: Session
) -> JSONResponse:
    tenants = None if body.all_tenants else body.tenants
    _require_binding(operator, tenants)
    try:
        public_key = load_public_key_pem(body.public_key_pem.encode())
    except ValueError as error:
        return error_response(400, "invalid_request_error", "invalid_public_key", str(error))
    async with session.begin():
        try:
            enrolled = await producer_keys.enroll(
                session, public_key, tenants, name=body.name, enrolled_by=operator.subject_id
            )
        except ValueError as error:
            return error_response(409, "invalid_request_error", "producer_key_conflict", str(error))
        described = await producer_keys.described(session, enrolled.key_id)
    assert described is not None, "an enrolled key is described in the transaction that enrolled it"
    return JSONResponse(status_code=201, content=_as_seen_by(operator, described))


@router.get("/v1/producer-keys")
async def list_producer_keys(
    operator: ProducerKeyAdmin, session: Session, tenant: Annotated[Name | None, Query()] = None
) -> Any:
    if not operator.is_platform_admin:
        tenant = tenant or operator.tenant_id
        require_tenant(operator, tenant)
    async with session.begin():
        keys = await producer_keys.listed(session, tenant)
    return {"producer_keys": [_as_seen_by(operator, key) for key in keys]}


@router.post("/v1/producer-keys/{key_id}/revoke")
async def revoke_producer_key(
    key_id: Annotated[str, Path(pattern=r"^[0-9a-f]{32}$")],
    operator: ProducerKeyAdmin,
    session: Session,
) -> Any:
    async with session.begin():
        binding = await producer_keys.get(session, key_id)
        if not operator.is_platform_admin and (
            binding is None
            or binding.all_tenants
            or binding.tenants != frozenset({operator.tenant_id})
        ):
            raise TenantForbiddenError()  # shared, another tenant's, or no such key: the same answer
        if binding is None or not await producer_keys.revoke(session, key_id):
            return error_response(
                404,
                "invalid_request_error",
                "producer_key_not_found",
                f"no live producer key {key_id}",
            )
    return {"key_id": key_id, "revoked": True}
