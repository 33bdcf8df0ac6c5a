"""What a node served each tenant, as counts: the source of ``kvledger cost report``.

Every finished completion adds its prompt, cached and output tokens (exactly the
``usage`` its response reported) to its tenant's running totals; the publisher drains
the totals into one :class:`events.schema.UsageReported` record per tenant and interval
(docs/operations.md, "Cost"). Nothing but tenant ids and integers is kept: no prompt,
no subject, no request id.

The meter belongs to an engine but is kept out of it: serving a request and accounting
for it are separate concerns, and both the HTTP layer (which knows when a response is
complete) and the publisher (which reports) reach it through :func:`usage_meter`.
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from datetime import UTC, datetime


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """One tenant's totals over ``[window_start, window_end)``."""

    tenant_id: str
    window_start: datetime
    window_end: datetime
    num_requests: int
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int


class UsageMeter:
    """Per-tenant running totals since the last :meth:`drain`. Event-loop only (no locking)."""

    def __init__(self) -> None:
        self._totals: dict[str, list[int]] = {}
        self._window_start = datetime.now(UTC)

    def record(
        self, tenant_id: str, num_prompt_tokens: int, num_cached_tokens: int, num_output_tokens: int
    ) -> None:
        assert 0 <= num_cached_tokens <= num_prompt_tokens, (
            f"cached {num_cached_tokens} of {num_prompt_tokens} prompt tokens"
        )
        totals = self._totals.setdefault(tenant_id, [0, 0, 0, 0])
        totals[0] += 1
        totals[1] += num_prompt_tokens
        totals[2] += num_cached_tokens
        totals[3] += num_output_tokens

    def drain(self) -> list[TenantUsage]:
        """The totals since the last drain, one per tenant that was served; the next window starts
        now."""
        window_start, window_end = self._window_start, datetime.now(UTC)
        totals, self._totals = self._totals, {}
        self._window_start = window_end
        return [
            TenantUsage(tenant_id, window_start, window_end, *counts)
            for tenant_id, counts in sorted(totals.items())
        ]

    async def metered(
        self, stream: AsyncIterator, tenant_id: str, num_prompt_tokens: int, num_cached_tokens: int
    ) -> AsyncIterator:
        """``stream`` (an engine's generation) unchanged, recording its usage when its
        ``GenerationDone`` passes.

        Duck-typed on ``finish_reason`` so this module does not import the engine (and torch): every
        streamed token carries its running ``num_completion_tokens`` too, only the end has a reason.
        """
        async with aclosing(stream):
            async for item in stream:
                if getattr(item, "finish_reason", None) is not None:
                    self.record(
                        tenant_id, num_prompt_tokens, num_cached_tokens, item.num_completion_tokens
                    )
                yield item


_METERS: weakref.WeakKeyDictionary[object, UsageMeter] = weakref.WeakKeyDictionary()


def usage_meter(engine: object) -> UsageMeter:
    """The meter of ``engine`` (created on first use; several engines may live in one process)."""
    meter = _METERS.get(engine)
    if meter is None:
        meter = _METERS[engine] = UsageMeter()
    return meter
