"""The web console in a real browser: headless Chromium (the distribution's package) driven by
Playwright.

A real coordinator — its consumers and its HTTP app on uvicorn — over a fresh database and
the session's broker. Two nodes are played by this module (signed kv-events and acks, as
in ``tests/coordinator/handlers/test_ledger_erasure.py``): they hold blocks in several tiers, a
document update invalidates some, an erasure removes a person's and gets its receipt. The
browser then logs in through the form and reads every page; each test asserts what the page
shows (exact node ids, states, counts) and writes a screenshot to ``$KVLEDGER_SCREENSHOT_DIR``
(default ``tests/browser/screenshots/``, ignored by git), printing its path.

Without a Chromium binary the module is skipped, saying so (``.ci/run`` installs one).
Playwright never downloads a browser here: it launches the system's ``chromium``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from helpers.ledger import (
    SUBJECT_KEY,
    RunningConsumers,
    coordinator_settings,
    eventually,
    operator_headers,
    operator_token,
    stored,
)
from helpers.node import Served

from bench.common import start_groups_at_end
from coordinator.api.app import create_app
from coordinator.audit.verifier import verify_served_receipt
from coordinator.consumers import consumer_groups
from coordinator.settings import CoordinatorSettings, kafka_settings
from events.kafka.admin import ensure_topics
from events.kafka.producer import EventProducer
from events.schema import (
    BlockStored,
    CommandAck,
    DocumentUpdated,
    NodeStarted,
    TierEvidence,
    make_event,
    subject_digest,
)

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip(
        "no chromium binary on PATH (Debian: apt-get install chromium; .ci/run installs it)",
        allow_module_level=True,
    )
playwright_api = pytest.importorskip(
    "playwright.async_api", reason="playwright is not installed (the [test] extra)"
)

TENANT_A, TENANT_B = "console-acme", "console-globex"
NODE_A, NODE_B = "console-node-a", "console-node-b"
SCRIPT_DOC = "<script>alert('doc')</script>"
SCRIPT_REASON = "gdpr-art17 <script>alert('reason')</script>"
SUBJECT = "alice@example.com"
MASTER_KEY = base64.b64encode(b"c" * 32).decode()
SCREENSHOTS = Path(
    os.environ.get("KVLEDGER_SCREENSHOT_DIR") or Path(__file__).parent / "screenshots"
)
TIMEOUT_MS = 15_000


@pytest.fixture(scope="module")
def settings(ledger_url: str, kafka_bootstrap: str) -> CoordinatorSettings:
    return coordinator_settings(
        ledger_url,
        kafka_bootstrap,
        ledger={
            "erasure_verify_interval_s": 0.2,
            # the nodes played here send no heartbeats; they must read "alive" for the whole module
            "heartbeat_timeout_s": 3600,
        },
        keys={"master_key": MASTER_KEY},
    )


@pytest.fixture(scope="module")
async def console(settings: CoordinatorSettings) -> AsyncIterator[str]:
    """The coordinator's consumers (starting at the end of the shared topics) and its app on uvicorn; yields the base URL."""
    await ensure_topics(kafka_settings(settings))
    await start_groups_at_end(settings.kafka.bootstrap, consumer_groups(settings.kafka.group_id))
    consumers = await RunningConsumers(settings).start()
    served = await Served(create_app(settings)).start()
    try:
        yield served.url
    finally:
        await served.stop()
        await consumers.stop()


def _evidence(
    tier: str, hashes: list[str], method: str = "overwrite", check: str = "readback_zero"
) -> TierEvidence:
    return TierEvidence(
        tier=tier,
        removed=len(hashes),
        block_hashes=hashes,
        method=method,
        post_check=check,
        verified=True,
    )


async def _ack(
    producer: EventProducer, command_id: uuid.UUID, node_id: str, *evidence: TierEvidence
) -> None:
    await producer.send(
        make_event(
            CommandAck(command_id=command_id, node_id=node_id, epoch=1, evidence=list(evidence))
        )
    )


async def _get(client: httpx.AsyncClient, path: str, role: str, tenant: str, **params: str) -> dict:
    response = await client.get(path, params=params, headers=operator_headers(role, tenant))
    assert response.status_code == 200, response.text
    return response.json()


async def _complete(client: httpx.AsyncClient, doc_id: str) -> dict:
    """The document invalidation of ``doc_id`` once decided (as the API lists it)."""

    async def decided() -> bool:
        return bool(
            (await _get(client, "/v1/invalidations", "auditor", TENANT_A, doc_id=doc_id))[
                "invalidations"
            ]
        )

    await eventually(decided, what=f"the invalidation of {doc_id!r}")
    return (await _get(client, "/v1/invalidations", "auditor", TENANT_A, doc_id=doc_id))[
        "invalidations"
    ][0]


@pytest.fixture(scope="module")
async def story(console: str, producer: EventProducer) -> dict:
    """Two nodes' blocks, a document update and an invalidation of an id holding ``<script>``, all
    acked; a verified erasure."""
    user = {
        "tenant_id": TENANT_A,
        "scope": "user",
        "subject_id": subject_digest(SUBJECT_KEY.encode(), TENANT_A, SUBJECT),
    }
    handbook = {"tenant_id": TENANT_A, "scope": "tenant", "documents": ["handbook@1"]}
    blocks = {
        NODE_A: [
            stored("console/system", "device"),
            stored("console/faq", "host", tenant_id=TENANT_A, scope="tenant", documents=["faq@1"]),
            stored("console/handbook-a", "device", **handbook),
            stored("console/alice-device", "device", **user),
            stored("console/alice-host", "host", **user),
        ],
        NODE_B: [
            stored("console/system-b", "disk"),
            stored("console/handbook-b", "disk", **handbook),
            stored("console/alice-disk", "disk", **user),
        ],
    }
    hashes = {block.block_hash: block for node_blocks in blocks.values() for block in node_blocks}
    by_label = {
        label: block.block_hash
        for label, block in zip(
            [
                "system",
                "faq",
                "handbook-a",
                "alice-device",
                "alice-host",
                "system-b",
                "handbook-b",
                "alice-disk",
            ],
            hashes.values(),
            strict=True,
        )
    }
    for node_id, node_blocks in blocks.items():
        await producer.send(
            make_event(NodeStarted(node_id=node_id, epoch=1, seq=0, namespace="ns-console"))
        )
        await producer.send(
            make_event(BlockStored(node_id=node_id, epoch=1, seq=1, blocks=node_blocks))
        )

    async with httpx.AsyncClient(base_url=console, timeout=30) as client:

        async def ledger_has_blocks() -> bool:
            nodes = (await _get(client, "/v1/nodes", "platform-admin", "platform"))["nodes"]
            return sum(sum(node["num_live_placements"].values()) for node in nodes) == len(hashes)

        await eventually(ledger_has_blocks, what="both nodes' blocks in the ledger")

        await producer.send(
            make_event(DocumentUpdated(doc_id="handbook", version=2), tenant_id=TENANT_A)
        )
        handbook_update = await _complete(client, "handbook")
        command = uuid.UUID(handbook_update["command_id"])
        await _ack(producer, command, NODE_A, _evidence("device", [by_label["handbook-a"]]))
        await _ack(
            producer,
            command,
            NODE_B,
            _evidence("disk", [by_label["handbook-b"]], "crypto_erase", "key_destroyed"),
        )

        await producer.send(
            make_event(DocumentUpdated(doc_id=SCRIPT_DOC, version=3), tenant_id=TENANT_A)
        )
        script_update = await _complete(client, SCRIPT_DOC)
        for node_id in (NODE_A, NODE_B):
            await _ack(producer, uuid.UUID(script_update["command_id"]), node_id)

        started = await client.post(
            "/v1/erasures",
            json={"tenant_id": TENANT_A, "subject_id": SUBJECT, "reason": SCRIPT_REASON},
            headers=operator_headers("privacy-officer", TENANT_A),
        )
        assert started.status_code == 202, started.text
        erasure_id = started.json()["id"]
        erasure = await _get(client, f"/v1/erasures/{erasure_id}", "auditor", TENANT_A)
        erasure_command = uuid.UUID(erasure["commands"][0]["command_id"])
        await _ack(
            producer,
            erasure_command,
            NODE_A,
            _evidence("device", [by_label["alice-device"]]),
            _evidence("host", [by_label["alice-host"]]),
        )
        await _ack(
            producer,
            erasure_command,
            NODE_B,
            _evidence("disk", [by_label["alice-disk"]], "crypto_erase", "key_destroyed"),
        )

        async def settled() -> bool:
            verified = (await _get(client, f"/v1/erasures/{erasure_id}", "auditor", TENANT_A))[
                "status"
            ] == "verified"
            listed = (await _get(client, "/v1/invalidations", "platform-admin", "platform"))[
                "invalidations"
            ]
            return verified and {item["status"] for item in listed} == {"complete"}

        await eventually(settled, what="the erasure verified and every invalidation complete")
    return {
        "url": console,
        "erasure_id": erasure_id,
        "handbook_command": str(command),
        "script_command": script_update["command_id"],
    }


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[object]:
    async with playwright_api.async_playwright() as driver:
        launched = await driver.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield launched
        finally:
            await launched.close()


async def _logged_in(browser, url: str, role: str, tenant: str):
    """A fresh browser context (its own cookie jar) logged in through the form as ``role`` of
    ``tenant``."""
    context = await browser.new_context(
        accept_downloads=True, viewport={"width": 1400, "height": 900}
    )
    page = await context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: dialogs.append(dialog.message))
    page.dialogs = dialogs
    await page.goto(f"{url}/ui/")
    assert page.url == f"{url}/ui/login", "an anonymous visit must land on the login form"
    await page.fill("#token", operator_token(role, tenant, sub=f"{role}-1"))
    await page.click("#login")
    await page.wait_for_url(f"{url}/ui/")
    return context, page


async def _screenshot(page, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    await page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path


async def _cells(page, selector: str) -> list[list[str]]:
    rows = []
    for row in await page.locator(selector).all():
        rows.append([" ".join(text.split()) for text in await row.locator("td").all_inner_texts()])
    return rows


async def test_login_overview_and_logout(story: dict, browser) -> None:
    """Login form → cookie (HttpOnly, SameSite=Strict, not Secure over http) → overview with exact
    nodes, tiers, backlog → logout."""
    url = story["url"]
    context, page = await _logged_in(browser, url, "platform-admin", "platform")
    (cookie,) = await context.cookies()
    assert (
        cookie["name"],
        cookie["httpOnly"],
        cookie["sameSite"],
        cookie["secure"],
        cookie["path"],
    ) == (
        "kvledger_console",
        True,
        "Strict",
        False,
        "/ui",
    )
    assert await page.inner_text("#who") == "platform-admin-1 · platform-admin · tenant platform"

    async def drained() -> bool:
        await page.reload()
        return await page.inner_text("#outbox-pending") == "0 pending"

    await eventually(drained, what="the outbox drained on the overview")
    # node, alive, status, epoch, namespace, last seen, device, host, disk, snapshot
    rows = await _cells(page, "#nodes tbody tr")
    assert [row[:5] + row[6:] for row in rows] == [
        [NODE_A, "alive", "active", "1", "ns-console", "1", "1", "0", "0"],
        [NODE_B, "alive", "active", "1", "ns-console", "0", "0", "1", "0"],
    ]
    assert await page.inner_text("#dead-letters") == "0"
    assert await page.inner_text("#invalidations-open") == "0 pending · 0 failed"
    assert await page.inner_text("#erasures-unverified") == "0 pending · 0 partial · 0 failed"
    assert re.fullmatch(
        r"\d+\.\d{3} s mean over [1-9]\d* events ingested by this process",
        await page.inner_text("#ingest-lag"),
    )
    await _screenshot(page, "overview-platform-admin")

    await page.click("text=Log out")
    await page.wait_for_url(f"{url}/ui/login")
    assert await context.cookies() == []
    await page.goto(f"{url}/ui/audit")
    assert page.url == f"{url}/ui/login"
    await context.close()


async def test_invalidations_list_filter_and_detail(story: dict, browser) -> None:
    """The list (newest first), the document filter, and the per node × tier timings and evidence of
    one command."""
    url = story["url"]
    context, page = await _logged_in(browser, url, "platform-admin", "platform")
    await page.click("header >> text=Invalidations")
    # seq, kind, predicate, trigger, status, acks, latency, requested
    rows = await _cells(page, "#invalidations tbody tr")
    assert [(row[0], row[1], row[2], row[3], row[4], row[5]) for row in rows] == [
        (
            "3",
            "subject",
            f"tenant={TENANT_A} subject_id={subject_digest(SUBJECT_KEY.encode(), TENANT_A, SUBJECT)}",
            "api",
            "complete",
            "2/2",
        ),
        (
            "2",
            "document",
            f"doc_id={SCRIPT_DOC} tenant={TENANT_A} below_version=3",
            "event",
            "complete",
            "2/2",
        ),
        (
            "1",
            "document",
            f"doc_id=handbook tenant={TENANT_A} below_version=2",
            "event",
            "complete",
            "2/2",
        ),
    ]
    await _screenshot(page, "invalidations")

    await page.fill("input[name=doc_id]", "handbook")
    await page.click("text=Filter")
    await page.wait_for_url(re.compile(r".*doc_id=handbook.*"))
    rows = await _cells(page, "#invalidations tbody tr")
    assert [row[0] for row in rows] == ["1"]

    await page.click("#invalidations >> text=1")
    await page.wait_for_url(f"{url}/ui/invalidations/{story['handbook_command']}")
    assert await page.inner_text("#status") == "complete"
    # node, status, acked, latency, device, host, disk, snapshot
    targets = await _cells(page, "#targets tbody tr")
    assert [row[0:2] for row in targets] == [[NODE_A, "acked"], [NODE_B, "acked"]]
    for row in targets:
        assert re.fullmatch(r"\d+\.\d ms", row[3]), row
    assert targets[0][4:] == [
        "verified removed 1 (overwrite) ledger: 0 live, 1 deleted",
        "untouched ledger: 0 live, 0 deleted",
        "untouched ledger: 0 live, 0 deleted",
        "untouched ledger: 0 live, 0 deleted",
    ]
    assert targets[1][6] == "verified removed 1 (crypto_erase) ledger: 0 live, 1 deleted"
    await _screenshot(page, "invalidation-detail")
    await context.close()


async def test_an_id_holding_a_script_is_shown_as_text(story: dict, browser) -> None:
    """``<script>`` in a document id and an erasure reason is rendered escaped: visible as text, no
    element, no dialog."""
    url = story["url"]
    context, page = await _logged_in(browser, url, "auditor", TENANT_A)
    escaped = {
        "&lt;script&gt;alert(&#39;doc&#39;)&lt;/script&gt;",
        "&lt;script&gt;alert(&#39;reason&#39;)&lt;/script&gt;",
    }
    for path in (
        "/ui/invalidations",
        f"/ui/invalidations/{story['script_command']}",
        "/ui/erasures",
        f"/ui/erasures/{story['erasure_id']}",
    ):
        response = await page.goto(f"{url}{path}")
        assert response.status == 200, path
        html = await response.text()
        assert "<script" not in html, path
        assert any(text in html for text in escaped), path
        assert await page.locator("script").count() == 0, path
        assert "default-src 'none'" in response.headers["content-security-policy"]
    await page.goto(f"{url}/ui/invalidations/{story['script_command']}")
    assert (
        await page.inner_text("#predicate")
        == f"doc_id={SCRIPT_DOC} tenant={TENANT_A} below_version=3"
    )
    await page.goto(f"{url}/ui/erasures/{story['erasure_id']}")
    assert await page.inner_text("#reason") == SCRIPT_REASON
    assert page.dialogs == []
    await _screenshot(page, "escaped-script-id")
    await context.close()


async def test_erasure_detail_receipt_download_verifies_offline(
    story: dict, browser, tmp_path: Path
) -> None:
    """Per node × tier evidence, the three downloads, and the command the page shows, run as shown."""
    url, erasure_id = story["url"], story["erasure_id"]
    context, page = await _logged_in(browser, url, "auditor", TENANT_A)
    await page.click("header >> text=Erasures")
    rows = await _cells(page, "#erasures tbody tr")
    assert [row[:4] for row in rows] == [[erasure_id, TENANT_A, SCRIPT_REASON, "verified"]]
    await page.click(f"text={erasure_id}")
    await page.wait_for_url(f"{url}/ui/erasures/{erasure_id}")
    assert (await page.inner_text("#status"), await page.inner_text("#live-copies")) == (
        "verified",
        "0",
    )
    # node, status, device, host, disk, snapshot
    assert await _cells(page, "#evidence tbody tr") == [
        [
            NODE_A,
            "acked",
            "removed 1 (overwrite) verified 0 live",
            "removed 1 (overwrite) verified 0 live",
            "removed 0 0 live",
            "removed 0 0 live",
        ],
        [
            NODE_B,
            "acked",
            "removed 0 0 live",
            "removed 0 0 live",
            "removed 1 (crypto_erase) verified 0 live",
            "removed 0 0 live",
        ],
    ]
    receipt_file = f"receipt-{erasure_id}.json"
    verify_command = f"kvledger verify-receipt {receipt_file} --public-key receipt-keys.json --checkpoint checkpoint.json"
    assert await page.inner_text("#verify-command") == verify_command
    assert (
        await page.inner_text("#fetch-command")
        == f"kvledger erasure receipt {erasure_id} --tenant {TENANT_A} --output receipt-{erasure_id}"
    )
    await _screenshot(page, "erasure-detail")

    documents = {}
    for link, name in (
        ("#download-receipt", receipt_file),
        ("#download-keys", "receipt-keys.json"),
        ("#download-checkpoint", "checkpoint.json"),
    ):
        async with page.expect_download() as started:
            await page.click(link)
        download = await started.value
        assert download.suggested_filename == name
        await download.save_as(tmp_path / name)
        documents[name] = json.loads((tmp_path / name).read_text())
    assert documents[receipt_file]["receipt"]["erasure_id"] == erasure_id
    result = verify_served_receipt(
        documents[receipt_file], documents["receipt-keys.json"], documents["checkpoint.json"]
    )
    assert result.ok, [check for check in result.checks if not check.ok]
    kvledger = [sys.executable, "-m", "kvledger.cli"]
    shown = shlex.split(verify_command)
    checked = await asyncio.to_thread(
        subprocess.run,
        kvledger + shown[1:],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    await context.close()


async def test_audit_log_shows_the_current_checkpoint(story: dict, browser) -> None:
    url = story["url"]
    context, page = await _logged_in(browser, url, "auditor", TENANT_A)
    await page.click("header >> text=Audit log")
    async with httpx.AsyncClient(base_url=url) as client:
        checkpoint = (await client.get("/v1/audit/checkpoint")).json()
    assert checkpoint["tree_size"] == 1
    assert (
        await page.inner_text("#tree-size"),
        await page.inner_text("#root-hash"),
        await page.inner_text("#key-id"),
    ) == (
        "1",
        checkpoint["root_hash"],
        checkpoint["key_id"],
    )
    await _screenshot(page, "audit-log")
    await context.close()


async def test_each_role_sees_what_its_api_allows(story: dict, browser) -> None:
    """A tenant-B auditor: none of tenant A's erasures, 403 pages for A's erasure, receipt and list; no nodes."""
    url, erasure_id = story["url"], story["erasure_id"]
    context, page = await _logged_in(browser, url, "auditor", TENANT_B)
    assert await page.locator("#nodes").count() == 0
    assert "platform-admin" in await page.inner_text("#tenant-scope")
    await page.goto(f"{url}/ui/erasures")
    assert await _cells(page, "#erasures tbody tr") == [["No erasure matches."]]
    await page.goto(f"{url}/ui/invalidations")
    assert await _cells(page, "#invalidations tbody tr") == [["No invalidation matches."]]
    for path in (
        f"/ui/erasures/{erasure_id}",
        f"/ui/erasures/{erasure_id}/receipt.json",
        f"/ui/erasures/{uuid.uuid4()}",  # one that does not exist looks the same
        f"/ui/invalidations/{story['handbook_command']}",
        f"/ui/erasures?tenant={TENANT_A}",
    ):
        response = await page.goto(f"{url}{path}")
        assert response.status == 403, path
        assert await page.inner_text("#error-title") == "Forbidden"
        assert (
            await page.inner_text("#error-message")
            == "operators act only inside the tenant of their token (tenant_forbidden)"
        )
    await page.goto(f"{url}/ui/erasures/{erasure_id}")
    await _screenshot(page, "forbidden-tenant-b")
    await context.close()
