"""``GET /v1/usage?since=&until=&tenant=``: what the nodes served each tenant, from the ledger.

Sums the ``UsageReported`` records the nodes sent (table ``usage_reports``) per tenant:
requests, prompt, cached and output tokens. A report counts when its ``window_end`` lies
in ``[since, until)``, so the window's edges are as fine as the nodes' reporting interval
(``heartbeat_interval_s``). ``kvledger cost report`` prices these sums
(docs/operations.md, "Cost").

Any operator role may read; a tenant-bound operator sees only its own tenant (no
``tenant``: its own; another tenant: 403 ``tenant_forbidden``), ``platform-admin`` every
tenant. Errors use the API's ``{"error": {"message", "type", "code"}}`` shape.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import AwareDatetime
from sqlalchemy import func, select

from coordinator.api.auth import require_tenant
from coordinator.api.dependencies import Reader, Session
from coordinator.http import error_response
from coordinator.ledger.models import UsageReport
from events.schema import Name

COUNTS = ("num_requests", "num_prompt_tokens", "num_cached_tokens", "num_output_tokens")


router = APIRouter()


@router.get("/v1/usage")
async def usage(
    reader: Reader,
    session: Session,
    since: Annotated[AwareDatetime, Query(description="RFC 3339 start of the window (inclusive)")],
    until: Annotated[
        AwareDatetime | None,
        Query(description="RFC 3339 end of the window (exclusive); default now"),
    ] = None,
    tenant: Annotated[Name | None, Query()] = None,
) -> Any:
    if not reader.is_platform_admin:
        tenant = reader.tenant_id if tenant is None else tenant
        require_tenant(reader, tenant)
    until = until or datetime.now(UTC)
    if until < since:
        return error_response(
            400, "invalid_request_error", "bad_window", "until must not precede since"
        )
    query = (
        select(
            UsageReport.tenant_id,
            func.count().label("num_reports"),
            *(func.sum(getattr(UsageReport, name)).label(name) for name in COUNTS),
        )
        .where(UsageReport.window_end >= since, UsageReport.window_end < until)
        .group_by(UsageReport.tenant_id)
        .order_by(UsageReport.tenant_id)
    )
    if tenant is not None:
        query = query.where(UsageReport.tenant_id == tenant)
    rows = (await session.execute(query)).all()
    return {
        "since": since.isoformat(),
        "until": until.isoformat(),
        "tenants": [
            {"tenant_id": row.tenant_id, "num_reports": row.num_reports}
            | {name: int(getattr(row, name)) for name in COUNTS}
            for row in rows
        ],
    }
