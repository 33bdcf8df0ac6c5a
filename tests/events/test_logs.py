"""events.logs: the log format switch, request ids in and out, one access line per request."""

from __future__ import annotations

import io
import json
import logging
import logging.config
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from helpers.fork_server import ForkServer

from events.logs import (
    MAX_REQUEST_ID_CHARS,
    RequestIdMiddleware,
    configure_logging,
    log_format,
    make_handler,
    request_id_from,
    uvicorn_log_config,
)

ERROR_BODY = (
    b'{"error":{"message":"internal server error","type":"server_error","code":"internal_error"}}'
)


@pytest.fixture
def json_lines() -> Iterator[io.StringIO]:
    """Everything logged at INFO and above, as the json format writes it."""
    stream = io.StringIO()
    handler = make_handler("json", stream)
    root = logging.getLogger()
    previous_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        root.setLevel(previous_level)


def parsed(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def make_app(observed: list[tuple]) -> FastAPI:
    app = FastAPI()
    handler_log = logging.getLogger("test.handler")

    @app.get("/items/{item_id}")
    async def item(item_id: str) -> dict[str, str]:
        handler_log.info("looking up an item")
        return {"ok": "yes"}

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("broken invariant")

    app.add_middleware(
        RequestIdMiddleware,
        access_logger="test.access",
        error_body=ERROR_BODY,
        observe=lambda *args: observed.append(args),
    )
    return app


async def request(app: FastAPI, method: str, path: str, **kwargs) -> httpx.Response:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        return await client.request(method, path, **kwargs)


@pytest.mark.parametrize("good", ["a", "req-1.2_3", "A" * MAX_REQUEST_ID_CHARS])
def test_a_short_plain_request_id_is_kept(good: str) -> None:
    assert request_id_from(good) == good


@pytest.mark.parametrize(
    "bad", [None, "", "A" * (MAX_REQUEST_ID_CHARS + 1), "a b", "x\ny", 'q"uote', "é", "a/b"]
)
def test_any_other_request_id_is_replaced_by_a_fresh_one(bad: str | None) -> None:
    fresh = request_id_from(bad)
    assert fresh != bad and len(fresh) == 32 and int(fresh, 16) >= 0
    assert request_id_from(bad) != fresh


def test_log_format_defaults_to_text_and_refuses_unknown_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVLEDGER_LOG_FORMAT", raising=False)
    assert log_format() == "text"
    monkeypatch.setenv("KVLEDGER_LOG_FORMAT", "JSON")
    assert log_format() == "json"
    monkeypatch.setenv("KVLEDGER_LOG_FORMAT", "xml")
    with pytest.raises(ValueError, match="KVLEDGER_LOG_FORMAT must be one of text, json"):
        log_format()


async def test_request_id_is_echoed_and_in_every_line_of_the_request(
    json_lines: io.StringIO,
) -> None:
    observed: list[tuple] = []
    response = await request(
        make_app(observed),
        "GET",
        "/items/42?subject=carol-7f3a",
        headers={"X-Request-Id": "trace-77"},
    )
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "trace-77"
    lines = [line for line in parsed(json_lines) if line["logger"].startswith("test.")]
    assert [(line["logger"], line["request_id"]) for line in lines] == [
        ("test.handler", "trace-77"),
        ("test.access", "trace-77"),
    ]
    assert lines[1]["message"].startswith("GET /items/42 200 ")
    # Server-side lines only: the test's own HTTP client (httpx) logs the URL it requested.
    server_lines = [
        line for line in parsed(json_lines) if not line["logger"].startswith(("httpx", "httpcore"))
    ]
    assert "carol-7f3a" not in json.dumps(server_lines)  # the query string never reaches a log line
    assert [args[:3] for args in observed] == [("GET", "/items/{item_id}", 200)]
    logging.getLogger("test.outside").info("after the request")
    assert parsed(json_lines)[-1]["request_id"] == "-"


async def test_a_forged_request_id_is_replaced_and_the_fresh_one_echoed(
    json_lines: io.StringIO,
) -> None:
    response = await request(
        make_app([]), "GET", "/items/1", headers={"X-Request-Id": "evil id; level=ERROR"}
    )
    fresh = response.headers["x-request-id"]
    assert len(fresh) == 32 and fresh != "evil id; level=ERROR"
    access = [line for line in parsed(json_lines) if line["logger"] == "test.access"]
    assert [line["request_id"] for line in access] == [fresh]


async def test_unhandled_errors_answer_500_with_the_request_id(json_lines: io.StringIO) -> None:
    observed: list[tuple] = []
    response = await request(make_app(observed), "GET", "/boom", headers={"X-Request-Id": "boom-1"})
    assert response.status_code == 500
    assert response.headers["x-request-id"] == "boom-1"
    assert response.content == ERROR_BODY
    assert [args[:3] for args in observed] == [("GET", "/boom", 500)]


async def test_answered_requests_to_a_quiet_path_are_not_access_lines_at_info(
    json_lines: io.StringIO,
) -> None:
    """A path machines poll several times a second: its answers go to DEBUG, its refusals and every
    other path to INFO."""
    app = FastAPI()

    @app.get("/load")
    async def load(refuse: bool = False) -> JSONResponse:
        return JSONResponse({}, status_code=401 if refuse else 200)

    app.add_middleware(
        RequestIdMiddleware,
        access_logger="test.access",
        error_body=ERROR_BODY,
        quiet_paths=frozenset({"/load"}),
    )
    for path in ("/load", "/load?refuse=true", "/other"):
        await request(app, "GET", path)
    access = [
        line["message"].rsplit(" ", 1)[0]
        for line in parsed(json_lines)
        if line["logger"] == "test.access"
    ]
    assert access == ["GET /load 401", "GET /other 404"]


async def test_the_access_line_cannot_be_split_by_the_path(json_lines: io.StringIO) -> None:
    await request(make_app([]), "GET", "/items/a%0A2026-01-01 ERROR forged%22line")
    await request(make_app([]), "GET", "/items/" + "x" * 600)
    access = [line["message"] for line in parsed(json_lines) if line["logger"] == "test.access"]
    assert access[0].startswith("GET /items/a%0A2026-01-01%20ERROR%20forged%22line 200 ")
    assert access[1].startswith("GET /items/" + "x" * (512 - len("/items/")) + "… 200 ")


async def test_unknown_routes_and_methods_keep_the_metric_labels_bounded() -> None:
    observed: list[tuple] = []
    app = make_app(observed)
    assert (await request(app, "GET", "/no/such/path-with-an-id-123")).status_code == 404
    assert (await request(app, "BREW", "/items/1")).status_code == 405
    assert [args[:3] for args in observed] == [
        ("GET", "unmatched", 404),
        ("other", "/items/{item_id}", 405),
    ]


def test_configure_logging_writes_one_json_object_per_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    monkeypatch.setenv("KVLEDGER_LOG_FORMAT", "json")
    try:
        configure_logging()
        logging.config.dictConfig(
            uvicorn_log_config()
        )  # what uvicorn does with the servers' log_config
        logging.getLogger("uvicorn.error").info("Uvicorn running")
        try:
            raise ValueError("multi\nline")
        except ValueError:
            logging.getLogger("kvledger.test").exception("it failed")
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [(line["logger"], line["message"], line["request_id"]) for line in lines] == [
        ("uvicorn.error", "Uvicorn running", "-"),
        ("kvledger.test", "it failed", "-"),
    ]
    assert "ValueError: multi\\nline" in json.dumps(lines[1]["exception"])


def test_text_format_carries_the_request_id() -> None:
    stream = io.StringIO()
    logger = logging.getLogger("kvledger.text-test")
    handler = make_handler("text", stream)
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("hello")
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
    assert stream.getvalue().rstrip("\n").endswith(" WARNING kvledger.text-test [-]: hello")


@pytest.mark.parametrize("command", ["node", "coordinator"])
def test_a_bad_log_format_is_a_one_line_configuration_error(
    command: str, fork_server: ForkServer, tmp_path: Path
) -> None:
    env = {**os.environ, "KVLEDGER_LOG_FORMAT": "xml"}
    result = fork_server.run([command], env, tmp_path, timeout_s=120)
    assert result.returncode == 2
    assert (
        result.stderr
        == f"kvledger {command}: error: KVLEDGER_LOG_FORMAT must be one of text, json, not 'xml'\n"
    )
