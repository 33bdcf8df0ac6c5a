"""``kvledger demo``: the whole story on the embedded stack, narrated step by step (about a minute).

1. the stack: reuse the one ``stack.json`` describes (``--stack``, or ``STATE_DIR/stack.json``
   while its coordinator answers) or start ``kvledger up`` and stop it at the end;
2. a cached hit: the same governed prompt twice, the second reports ``cached_tokens``;
3. a document update: ``DocumentUpdated`` → the old version is refused (409
   ``stale_document_version``), the new one is served and its cache rebuilt;
4. a permission revocation: ``PermissionRevoked`` → a token of the old policy version
   is refused (401 ``stale_authorization``), a new token is served;
5. an erasure: ``POST /v1/erasures`` → every node acks with evidence → the signed receipt
   is fetched and checked offline with the function ``kvledger verify-receipt`` runs.

Each step prints what it did and what it saw; the first expectation that fails ends the
demo with exit status 1. Every run uses a tenant of its own (``demo-<random>``), so it can
run again on the same stack. Nothing raw is printed but the demo's own made-up texts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from coordinator.audit.verifier import verify_served_receipt
from events.kafka.settings import KafkaSettings
from events.schema import DocumentUpdated, PermissionRevoked, make_event
from identity.roles import AUDITOR, PRIVACY_OFFICER
from identity.tokens import issue_token
from kvledger.errors import EXIT_FAILURE, CliError
from kvledger.processes import Process, spawn_cli
from kvledger.publish import producer_signer, publish
from kvledger.tokens import load_stack, operator_key_pem

STACK_START_TIMEOUT_S = 300.0
EXPECTATION_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 60.0
SUBJECT = "alice"
ANSWER_TOKENS = 12
"""Enough of the model's answer to read it (each step prints it), few enough for a CPU."""


class StepFailed(Exception):
    """An expectation of the demo did not hold: the message says what was expected and what was
    seen."""


def say(line: str) -> None:
    print(f"      {line}", flush=True)


def _until(check: Callable[[], Any], what: str, timeout_s: float = EXPECTATION_TIMEOUT_S) -> Any:
    """Poll ``check`` until it returns something truthy; StepFailed naming ``what`` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise StepFailed(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.1)


def _ready(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(f"{url}/readyz").status_code == 200
    except httpx.TransportError:
        return False


class Stack:
    """The stack the demo runs on: reused from a stack file, or started with ``kvledger up`` and
    stopped afterwards."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.process: Process | None = None
        self.info: dict[str, Any] = {}

    def start(self, client: httpx.Client) -> None:
        if self.args.stack:
            self.info = load_stack(self.args.stack)
            if not _ready(client, self.info.get("coordinator_url", "")):
                raise CliError(
                    f"the stack of {self.args.stack} does not answer (is `kvledger up` running?)",
                    EXIT_FAILURE,
                )
            say(f"reusing the stack of {self.args.stack}")
            return
        state_dir = Path(self.args.state_dir)
        stack_file = state_dir / "stack.json"
        if stack_file.exists():
            existing = load_stack(str(stack_file))
            if _ready(client, existing.get("coordinator_url", "")) and all(
                _ready(client, url) for url in existing.get("node_urls", [])
            ):
                self.info = existing
                say(f"reusing the running stack of {stack_file}")
                return
            stack_file.unlink()
        state_dir.mkdir(parents=True, exist_ok=True)
        log = state_dir / "demo-up.log"
        say(f"starting `kvledger up --state-dir {state_dir}` (log: {log})")
        log.write_bytes(b"")  # this start's output only
        self.process = spawn_cli(
            [
                "up",
                "--state-dir",
                str(state_dir),
                "--model",
                self.args.model_dir,
                *(["--tiny"] if self.args.tiny else []),
                "--port",
                str(self.args.port),
            ],
            os.environ,
            log,
            new_session=True,
            dies_with_parent=False,
        )
        shown = 0

        def relay_progress() -> None:
            """Echo ``kvledger up``'s timed progress lines (``[  3.2s] postgres ready``), not its
            warnings."""
            nonlocal shown
            lines = log.read_text(errors="replace").splitlines()
            for line in lines[shown:]:
                if line.startswith("["):
                    say(f"up {line}")
            shown = len(lines)

        deadline = time.monotonic() + STACK_START_TIMEOUT_S
        while not stack_file.exists():
            relay_progress()
            if self.process.poll() is not None:
                raise StepFailed(
                    f"kvledger up exited with status {self.process.returncode} (log: {log})"
                )
            if time.monotonic() > deadline:
                raise StepFailed(
                    f"the stack was not up after {STACK_START_TIMEOUT_S:.0f} s (log: {log})"
                )
            time.sleep(0.2)
        relay_progress()
        self.info = load_stack(str(stack_file))

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


class Story:
    """The demo's tenant, its end user and operators, and the conversation they have with the node."""

    def __init__(self, stack: dict[str, Any], client: httpx.Client, output_dir: Path) -> None:
        self.stack = stack
        self.client = client
        self.output_dir = output_dir
        self.hit_tokens = 0
        """Cached tokens of the repeated prompt in step 2: what a full hit reuses."""
        self.tenant = f"demo-{secrets.token_hex(3)}"
        self.node_url = stack["node_urls"][0]
        self.coordinator_url = stack["coordinator_url"]
        self.model = ""

    def user_token(self, policy_version: int) -> str:
        return issue_token(
            tenant=self.tenant,
            sub=SUBJECT,
            scopes=["hr"],
            pv=policy_version,
            ttl_s=900,
            secret=self.stack["jwt_secret"],
        )

    def operator(self, role: str) -> dict[str, str]:
        token = issue_token(
            tenant=self.tenant,
            sub=f"demo-{role}",
            roles=[role],
            ttl_s=900,
            private_key_pem=operator_key_pem(self.stack),
        )
        return {"Authorization": f"Bearer {token}"}

    def messages(self, document_version: int) -> list[dict[str, Any]]:
        # Worded for the real model (SmolLM2-135M-Instruct): with the question in the same message
        # as the user's introduction and a system prompt that asks for one sentence, it answers from
        # the handbook ("You have 21 vacation days.", then 22 for version 2).
        return [
            # the tenant's name keeps the public prefix this run's own: an earlier run cached the
            # same words
            {
                "role": "system",
                "content": f"You are the HR assistant of {self.tenant}. Answer the employee's question from the handbook in one sentence. "
                * 3,
                "cache_scope": "public",
            },
            {
                "role": "user",
                "content": f"Handbook version {document_version}: every employee has {20 + document_version} vacation days per year. "
                * 6,
                "document": {"id": "handbook", "version": document_version, "auth_scope": "hr"},
            },
            {
                "role": "user",
                "content": "I am Alice from the people team and I plan a long trip in spring next year. "
                * 3
                + "How many vacation days do I have?",
            },
        ]

    def chat(self, token: str, document_version: int) -> httpx.Response:
        return self.client.post(
            f"{self.node_url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {token}"},
            json={
                "model": self.model,
                "messages": self.messages(document_version),
                "max_tokens": ANSWER_TOKENS,
                "temperature": 0,
            },
            timeout=REQUEST_TIMEOUT_S,
        )

    def served(self, token: str, document_version: int, label: str) -> tuple[int, int]:
        """(prompt_tokens, cached_tokens) of a request that must be served."""
        response = self.chat(token, document_version)
        if response.status_code != 200:
            raise StepFailed(
                f"{label}: expected 200, got {response.status_code}: {response.text[:300]}"
            )
        usage = response.json()["usage"]
        prompt_tokens, cached = (
            usage["prompt_tokens"],
            usage["prompt_tokens_details"]["cached_tokens"],
        )
        answer = response.json()["choices"][0]["message"]["content"].strip().replace("\n", " ")
        say(f"{label}: 200, {prompt_tokens} prompt tokens, {cached} cached — {answer!r}")
        return prompt_tokens, cached

    def refused(
        self, token: str, document_version: int, status_code: int, code: str, label: str
    ) -> float:
        """Seconds until a request is refused with ``status_code``/``code`` (the command reaches the
        node)."""
        started = time.monotonic()

        def refused_now() -> httpx.Response | None:
            response = self.chat(token, document_version)
            return response if response.status_code == status_code else None

        response = _until(refused_now, f"{label} to be refused with {status_code}")
        error = response.json()["error"]
        if error["code"] != code:
            raise StepFailed(f"{label}: expected error code {code}, got {error['code']}")
        elapsed_s = time.monotonic() - started
        say(f"{label}: {status_code} {error['code']} after {elapsed_s:.2f} s — {error['message']}")
        return elapsed_s

    def publish(self, payload: Any) -> None:
        envelope = make_event(payload, tenant_id=self.tenant)
        signer = producer_signer(self.stack.get("producer_key_file"))
        asyncio.run(
            publish(KafkaSettings(bootstrap=self.stack["kafka_bootstrap"]), envelope, signer)
        )
        say(f"published {envelope.type} (event {envelope.event_id})")


def step_stack(story: Story) -> None:
    for url in [story.coordinator_url, *story.stack["node_urls"]]:
        if not _ready(story.client, url):
            raise StepFailed(f"{url}/readyz does not answer 200")
    models = story.client.get(
        f"{story.node_url}/v1/models", headers={"Authorization": f"Bearer {story.user_token(1)}"}
    )
    if models.status_code != 200:
        raise StepFailed(f"GET /v1/models answered {models.status_code}")
    story.model = models.json()["data"][0]["id"]
    say(
        f"coordinator {story.coordinator_url} ready; node {story.node_url} ready, serving {story.model}"
    )
    say(
        f"this run's tenant is {story.tenant}; its user {SUBJECT} reads the handbook under auth scope hr, policy version 1"
    )


def step_cached_hit(story: Story) -> None:
    token = story.user_token(1)
    _, first = story.served(token, 1, "first request")
    _, second = story.served(token, 1, "same prompt again")
    if first != 0 or second <= 0:
        raise StepFailed(f"expected 0 cached tokens, then some; saw {first}, then {second}")
    say(f"the prefix was reused: {second} prompt tokens came from the KV cache")
    story.hit_tokens = second


def step_document_update(story: Story) -> None:
    token = story.user_token(1)
    story.publish(DocumentUpdated(doc_id="handbook", version=2))
    story.refused(token, 1, 409, "stale_document_version", "request with handbook v1")
    _, rebuilt = story.served(token, 2, "request with handbook v2")
    _, again = story.served(token, 2, "handbook v2 again")
    if not (rebuilt < story.hit_tokens and again > rebuilt):
        raise StepFailed(
            f"expected the v2 prefix to be computed once and then reused; saw {rebuilt}, then {again} cached"
        )
    say(
        f"the cache was rebuilt for v2: only the public system prompt was reused at first ({rebuilt}), then {again}"
    )


def step_permission_revocation(story: Story) -> None:
    story.publish(PermissionRevoked(auth_scope="hr", policy_version=2))
    story.refused(
        story.user_token(1),
        2,
        401,
        "stale_authorization",
        "request with a token of policy version 1",
    )
    _, cached = story.served(story.user_token(2), 2, "request with a new token (policy version 2)")
    if cached >= story.hit_tokens:
        raise StepFailed(
            f"expected the blocks built under policy version 1 to be gone; {cached} tokens were still reused"
        )
    say(
        f"what was built under policy version 1 is not reused: only the public system prompt ({cached}) was"
    )


def step_erasure(story: Story) -> None:
    coordinator, output_dir = story.coordinator_url, story.output_dir
    started = story.client.post(
        f"{coordinator}/v1/erasures",
        json={
            "tenant_id": story.tenant,
            "subject_id": SUBJECT,
            "reason": "demo: GDPR art. 17 request",
        },
        headers=story.operator(PRIVACY_OFFICER),
    )
    if started.status_code != 202:
        raise StepFailed(
            f"POST /v1/erasures: expected 202, got {started.status_code}: {started.text[:300]}"
        )
    erasure_id = started.json()["id"]
    say(f"requested the erasure of {SUBJECT}: {erasure_id}")
    auditor = story.operator(AUDITOR)

    def verified() -> dict | None:
        erasure = story.client.get(
            f"{coordinator}/v1/erasures/{erasure_id}", headers=auditor
        ).json()
        return erasure if erasure.get("status") == "verified" else None

    began = time.monotonic()
    erasure = _until(verified, "the erasure to be verified")
    say(
        f"verified after {time.monotonic() - began:.2f} s; live copies left: {erasure['live_copies']}"
    )
    for node in erasure["nodes"]:
        removed = ", ".join(
            f"{tier} {cell['removed']} ({'/'.join(cell['methods'])})"
            for tier, cell in node["tiers"].items()
            if cell["removed"]
        )
        say(f"  {node['node_id']}: {node['status']}, removed {removed or 'nothing'}")
    documents = {
        "receipt.json": story.client.get(
            f"{coordinator}/v1/erasures/{erasure_id}/receipt", headers=auditor
        ),
        "keys.json": story.client.get(f"{coordinator}/v1/receipts/keys"),
        "checkpoint.json": story.client.get(f"{coordinator}/v1/audit/checkpoint"),
    }
    for name, response in documents.items():
        if response.status_code != 200:
            raise StepFailed(f"fetching {name}: HTTP {response.status_code}")
    output_dir.mkdir(parents=True, exist_ok=True)
    for name, response in documents.items():
        (output_dir / name).write_text(json.dumps(response.json(), indent=2), encoding="utf-8")
    result = verify_served_receipt(
        documents["receipt.json"].json(),
        documents["keys.json"].json(),
        documents["checkpoint.json"].json(),
    )
    failed = [check.name for check in result.checks if not check.ok]
    if not result.ok:
        raise StepFailed(f"the receipt did not verify offline: {', '.join(failed)}")
    say(
        f"receipt checked offline: {len(result.checks)} checks passed ({', '.join(check.name for check in result.checks)})"
    )
    say(
        f"check it yourself: kvledger verify-receipt {output_dir / 'receipt.json'} --public-key {output_dir / 'keys.json'} "
        f"--checkpoint {output_dir / 'checkpoint.json'}"
    )
    say(f"see it in the console: {coordinator}/ui/erasures/{erasure_id}")


STEPS: tuple[tuple[str, Callable[[Story], None]], ...] = (
    ("a cached hit", step_cached_hit),
    ("a document update: the old version refused, the cache rebuilt", step_document_update),
    ("a permission revocation: the old token refused", step_permission_revocation),
    ("an erasure: a signed receipt, verified offline", step_erasure),
)


def cli(args: argparse.Namespace) -> int:
    """0 when every step saw what it expected; 1 at the first that did not (the stack it started is
    stopped)."""
    began = time.monotonic()
    num_steps = len(STEPS) + 1
    stack = Stack(args)
    output_dir = Path(args.output) if args.output else Path(args.state_dir) / "demo-receipt"
    step = 1
    try:
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
            print(f"[1/{num_steps}] the stack", flush=True)
            step_began = time.monotonic()
            stack.start(client)
            story = Story(stack.info, client, output_dir)
            step_stack(story)
            say(f"ok ({time.monotonic() - step_began:.1f} s)")
            for step, (title, run) in enumerate(STEPS, start=2):
                print(f"[{step}/{num_steps}] {title}", flush=True)
                step_began = time.monotonic()
                run(story)
                say(f"ok ({time.monotonic() - step_began:.1f} s)")
    except StepFailed as failure:
        say(f"FAILED: {failure}")
        print(
            f"kvledger demo: failed at step {step}/{num_steps} after {time.monotonic() - began:.1f} s",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    finally:
        if stack.process is not None:
            say("stopping the stack the demo started")
        stack.stop()
    print(
        f"demo passed: {num_steps}/{num_steps} steps in {time.monotonic() - began:.1f} s",
        flush=True,
    )
    return 0
