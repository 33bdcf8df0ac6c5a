"""Access to the operational views (``/metrics``, cache stats) of nodes and coordinator.

Those views aggregate every tenant's traffic, so only the operator's scraper may read
them: it presents a shared bearer token, distinct from every user and operator token.
"""

from __future__ import annotations

import hmac
from pathlib import Path

from pydantic import BaseModel, SecretStr, model_validator


class MetricsSettings(BaseModel):
    """Who may read the detailed, cross-tenant operational views (``/metrics``, ``/v1/cache/stats``).

    They aggregate every tenant's traffic, so they are for the operator's scraper only:
    callers present ``token`` as a bearer token. Unset, those routes are disabled
    (404) rather than open. ``token_file`` reads the token from a file instead (a
    container secret shared with the scraper, which reads the same file).
    """

    token: SecretStr | None = None
    token_file: Path | None = None

    @model_validator(mode="after")
    def _read_token_file(self) -> MetricsSettings:
        if self.token_file is None:
            return self
        if self.token is not None:
            raise ValueError("set the metrics token or the metrics token file, not both")
        try:
            text = self.token_file.read_text().strip()
        except OSError as exc:
            raise ValueError(
                f"cannot read the metrics token file {self.token_file}: {exc.strerror}"
            ) from None
        if not text:
            raise ValueError(f"the metrics token file {self.token_file} is empty")
        self.token = SecretStr(text)
        return self


def scrape_refusal(
    authorization: str | None, token: SecretStr | None
) -> tuple[int, str, str] | None:
    """Why a request for an operational view (``/metrics``, cache stats) is refused: ``(status, code, message)``, or None.

    Without a configured token the views are disabled (404), never open: a node or
    coordinator deployed without one must not hand every caller the cross-tenant
    aggregates. Otherwise the caller must present the token as a bearer token (401);
    compared in constant time.
    """
    if token is None:
        return (
            404,
            "metrics_disabled",
            "operational metrics are disabled: no metrics token is configured",
        )
    scheme, _, presented = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        presented.strip().encode(), token.get_secret_value().encode()
    ):
        return 401, "invalid_metrics_token", "this route needs the metrics bearer token"
    return None
