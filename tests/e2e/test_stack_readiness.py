"""`kvledger up` reports the stack ready only once the coordinator's consumers consume.

Before, the coordinator's ``/readyz`` checked the database alone: the stack printed its
URLs while the consumer groups were still joining, and a document update published right
then was decided seconds later — a request in between was served from the old version.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import httpx
import pytest
from helpers.stack import Up

from events import schema
from events.kafka.producer import EventProducer
from events.kafka.settings import KafkaSettings
from identity.tokens import issue_token
from kvledger.publish import producer_signer

pytestmark = pytest.mark.e2e

DECIDED_WITHIN_S = 3.0


async def _publish_update(bootstrap: str, tenant: str, producer_key_file: str) -> None:
    """A DocumentUpdated signed with the stack's producer key, as ``kvledger publish`` signs it."""
    async with EventProducer(
        KafkaSettings(bootstrap=bootstrap), sign=producer_signer(producer_key_file)
    ) as producer:
        await producer.send(
            schema.make_event(
                schema.DocumentUpdated(doc_id="handbook", version=2), tenant_id=tenant
            )
        )


def test_an_update_published_as_soon_as_the_stack_is_up_is_decided_at_once(
    tiny_model_dir, tmp_path, fork_server
):
    up = Up.start(tmp_path, tiny_model_dir, fork_server=fork_server)
    try:
        stack = up.wait_ready()
        published = time.monotonic()
        assert (
            os.stat(stack["producer_key_file"]).st_mode & 0o777 == 0o600
        )  # the stack's dev producer key, enrolled for all tenants
        asyncio.run(_publish_update(stack["kafka_bootstrap"], "acme", stack["producer_key_file"]))
        ready = httpx.get(f"{stack['coordinator_url']}/readyz")
        assert ready.status_code == 200, ready.text

        # Minted in-process from the stack's operator key: a CLI start (seconds on a loaded machine)
        # would count against the decision time (test_stack covers ``kvledger token``).
        operator_key = Path(stack["operator_private_key_file"]).read_bytes()
        admin = issue_token(
            tenant="platform",
            sub="operator",
            roles=["platform-admin"],
            ttl_s=600,
            private_key_pem=operator_key,
        )

        def decided():
            response = httpx.get(
                f"{stack['coordinator_url']}/v1/invalidations",
                params={"tenant": "acme", "kind": "document"},
                headers={"Authorization": f"Bearer {admin}"},
            )
            assert response.status_code == 200, response.text
            return response.json()["invalidations"]

        (invalidation,) = up.wait_for(decided, "the update's decision", 60)
        decided_after_s = time.monotonic() - published
        assert invalidation["predicate"] == {
            "kind": "document",
            "tenant": "acme",
            "doc_id": "handbook",
            "below_version": 2,
        }
        assert decided_after_s < DECIDED_WITHIN_S, (
            f"decided {decided_after_s:.1f}s after the stack said ready"
        )
    finally:
        status = up.terminate()
    assert status == 0, up.log.read_text()[-4000:]
