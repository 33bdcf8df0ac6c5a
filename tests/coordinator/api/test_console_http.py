"""The console's HTTP behaviour without a browser: authentication, the login form's CSRF defence,
escaping.

The coordinator's app over ASGI (base URL ``http://c``) on a fresh database; the pages
themselves are read in a real browser by ``tests/browser/test_console.py``.
"""

from __future__ import annotations

import base64
import uuid

import httpx
import pytest
from helpers.ledger import coordinator_settings, operator_headers, operator_token

from coordinator.settings import CoordinatorSettings

ORIGIN = "http://c"
HOSTILE_TENANT = "<script>alert(1)</script>"


@pytest.fixture(scope="module")
def settings(ledger_url: str, kafka_bootstrap: str) -> CoordinatorSettings:
    return coordinator_settings(
        ledger_url, kafka_bootstrap, keys={"master_key": base64.b64encode(b"h" * 32).decode()}
    )


async def test_header_or_cookie_and_nothing_else(client: httpx.AsyncClient) -> None:
    with_header = await client.get("/ui/audit", headers=operator_headers("auditor", "acme"))
    assert with_header.status_code == 200 and 'id="empty-log"' in with_header.text
    assert with_header.headers["content-security-policy"].startswith("default-src 'none'")
    assert with_header.headers["cache-control"] == "no-store"
    anonymous = await client.get("/ui/audit")
    assert (anonymous.status_code, anonymous.headers["location"]) == (303, "/ui/login")
    client.cookies.set("kvledger_console", "not-a-token")
    forged = await client.get("/ui/audit")
    client.cookies.clear()
    assert forged.status_code == 401 and 'id="login-error"' in forged.text
    assert forged.headers["set-cookie"].startswith('kvledger_console=""; expires=')
    end_user = await client.get("/ui/audit", headers={"Authorization": "Basic abc"})
    assert end_user.status_code == 401


async def test_login_only_from_the_consoles_own_pages(client: httpx.AsyncClient) -> None:
    token = operator_token("platform-admin", "platform")
    for headers in (
        {"Origin": "https://evil.example"},
        {"Referer": "https://evil.example/x"},
        {"Origin": "null"},
        {},
    ):
        refused = await client.post("/ui/login", data={"token": token}, headers=headers)
        assert refused.status_code == 403 and "set-cookie" not in refused.headers, headers
        assert "cross_site_request" in refused.text
    assert (
        await client.post("/ui/logout", headers={"Origin": "https://evil.example"})
    ).status_code == 403
    accepted = await client.post(
        "/ui/login", data={"token": token}, headers={"Referer": f"{ORIGIN}/ui/login"}
    )
    assert (accepted.status_code, accepted.headers["location"]) == (303, "/ui/")
    cookie = accepted.headers["set-cookie"]
    assert (
        cookie.startswith(f"kvledger_console={token};")
        and "HttpOnly" in cookie
        and "SameSite=strict" in cookie
    )
    assert "Path=/ui" in cookie and "Secure" not in cookie
    assert (await client.get("/ui/audit")).status_code == 200
    logged_out = await client.post("/ui/logout", headers={"Origin": ORIGIN})
    assert logged_out.status_code == 303 and logged_out.headers["set-cookie"].startswith(
        'kvledger_console=""'
    )
    client.cookies.clear()
    wrong = await client.post("/ui/login", data={"token": "x.y.z"}, headers={"Origin": ORIGIN})
    assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
    blank = await client.post("/ui/login", data={"token": " "}, headers={"Origin": ORIGIN})
    assert blank.status_code == 400
    too_big = await client.post(
        "/ui/login", data={"token": "a" * 20_000}, headers={"Origin": ORIGIN}
    )
    assert too_big.status_code == 413


async def test_a_hostile_tenant_id_is_escaped_everywhere(client: httpx.AsyncClient) -> None:
    started = await client.post(
        "/v1/erasures",
        json={
            "tenant_id": HOSTILE_TENANT,
            "subject_id": "s",
            "reason": "<img src=x onerror=alert(2)>",
        },
        headers=operator_headers("privacy-officer", HOSTILE_TENANT),
    )
    assert started.status_code == 202, started.text
    erasure_id = started.json()["id"]
    auditor = operator_headers("auditor", HOSTILE_TENANT)
    for path in ("/ui/erasures", f"/ui/erasures/{erasure_id}", "/ui/invalidations", "/ui/"):
        page = await client.get(path, headers=auditor)
        assert page.status_code == 200, path
        assert "<script" not in page.text and "<img" not in page.text, path
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text, path
    other = await client.get(
        f"/ui/erasures/{erasure_id}", headers=operator_headers("auditor", "acme")
    )
    assert other.status_code == 403 and "tenant_forbidden" in other.text
    missing = await client.get(
        f"/ui/erasures/{uuid.uuid4()}", headers=operator_headers("platform-admin", "platform")
    )
    assert missing.status_code == 404
    malformed = await client.get("/ui/erasures/not-a-uuid", headers=auditor)
    assert malformed.status_code == 400 and "not-a-uuid" not in malformed.text


@pytest.mark.parametrize(
    ("page", "status"),
    [
        ("invalidations", "complete"),
        ("invalidations", ""),
        ("erasures", "partial"),
        ("erasures", ""),
    ],
)
async def test_status_filters_take_the_ledgers_states_or_any(
    client: httpx.AsyncClient, page: str, status: str
) -> None:
    listed = await client.get(
        f"/ui/{page}", params={"status": status}, headers=operator_headers("auditor", "acme")
    )
    assert listed.status_code == 200


@pytest.mark.parametrize("page", ["invalidations", "erasures"])
async def test_a_status_outside_the_ledgers_states_is_refused_without_echoing_it(
    client: httpx.AsyncClient, page: str
) -> None:
    refused = await client.get(
        f"/ui/{page}", params={"status": "acked<b>"}, headers=operator_headers("auditor", "acme")
    )
    assert refused.status_code == 400 and "invalid_parameter" in refused.text
    assert "acked<b>" not in refused.text and "acked&lt;b&gt;" not in refused.text
