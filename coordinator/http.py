"""The coordinator's HTTP error vocabulary: one error type, one response shape, one time format.

Every coordinator endpoint (the ledger API, the consumers-only ops app, the console's JSON
answers) reports failures as ``{"error": {"message", "type", "code"}}`` with the HTTP status
saying the class of failure. Raise :class:`ApiError` from a handler or a dependency, or return
:func:`error_response` where a handler already returns responses; :func:`install_error_handlers`
turns raised errors, failed authentication and invalid parameters into that shape.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from identity.tokens import AuthError


class ApiError(Exception):
    """An error answered with the JSON error shape; ``headers`` go out with it (e.g.
    ``Retry-After``)."""

    def __init__(
        self,
        status_code: int,
        error_type: str,
        code: str,
        message: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.error_type = error_type
        self.code = code
        self.message = message
        self.headers = headers


def error_content(error_type: str, code: str, message: str) -> dict[str, Any]:
    """The body of every coordinator error."""
    return {"error": {"message": message, "type": error_type, "code": code}}


def error_response(
    status_code: int,
    error_type: str,
    code: str,
    message: str,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """The error as a response. A 401 names the scheme the caller must use (``WWW-Authenticate:
    Bearer``)."""
    if status_code == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    return JSONResponse(
        status_code=status_code, content=error_content(error_type, code, message), headers=headers
    )


INTERNAL_ERROR_BODY = json.dumps(
    error_content("server_error", "internal_error", "internal server error"), separators=(",", ":")
).encode()
"""What an unhandled exception answers (500): nothing of the exception leaves the process."""


def iso(value: datetime | None) -> str | None:
    """A stored time as the API shows it: ISO 8601 with its offset, or None when unset."""
    return None if value is None else value.isoformat()


def install_error_handlers(app: FastAPI) -> None:
    """Answer :class:`ApiError`, failed authentication (401) and invalid parameters (400) in the error shape."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status_code, exc.error_type, exc.code, exc.message, exc.headers)

    @app.exception_handler(AuthError)
    async def _auth_error(_: Request, exc: AuthError) -> JSONResponse:
        return error_response(401, "authentication_error", exc.code, exc.message)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # Name the parameter and the problem, never echo the input (it may be a subject id).
        problems = "; ".join(
            f"{'.'.join(str(part) for part in error['loc'])}: {error['msg']}"
            for error in exc.errors()
        )
        return error_response(400, "invalid_request_error", "invalid_parameter", problems)
