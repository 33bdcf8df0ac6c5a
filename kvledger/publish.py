"""``kvledger publish``: send a user event (docs/design.md §5) the way any producer would.

Operators use it to tell the cache that a document changed or was deleted, that a
permission was revoked, or that a person asked to be erased. The event is built
and validated with the contract models (``events.schema``), published under its
routed topic and key with ``acks=all``, and its ``event_id`` is printed — the id
to look for in ``GET /v1/invalidations?…`` (``source_event_id``) or in logs.
``docs/events.md`` documents the same JSON for producers in other languages.

The broker comes from ``--kafka-bootstrap``, else ``KVLEDGER_KAFKA_BOOTSTRAP``, else the
``kafka_bootstrap`` of ``.kvledger/stack.json`` written by ``kvledger up``. The event is signed
with the producer key in ``--producer-key``, else ``KVLEDGER_PRODUCER_KEY_FILE``, else the stack's
``producer_key_file``: the coordinator decides only events signed by a key enrolled for their
tenant (``kvledger producers``; docs/security.md, "Signed customer events").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

from aiokafka.errors import KafkaError
from pydantic import ValidationError

from events.kafka.admin import ensure_topics
from events.kafka.producer import EventProducer
from events.kafka.settings import KAFKA_SHARED_ENV, KafkaSettings
from events.schema import (
    DocumentDeleted,
    DocumentUpdated,
    Envelope,
    ErasureRequested,
    EventPayload,
    PermissionRevoked,
    make_event,
)
from events.topics import route
from identity.signing import EnvelopeSigner, load_private_key_pem

STACK_FILE = Path(".kvledger") / "stack.json"
BOOTSTRAP_ENV = "KVLEDGER_KAFKA_BOOTSTRAP"
PRODUCER_KEY_ENV = "KVLEDGER_PRODUCER_KEY_FILE"


def stack_setting(key: str) -> str | None:
    """A value from the dev stack's ``stack.json`` (relative to the working directory), if there is
    one."""
    try:
        value = json.loads(STACK_FILE.read_text()).get(key)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {STACK_FILE}: {exc}") from None
    return value if isinstance(value, str) and value else None


def _bootstrap(args: argparse.Namespace) -> str:
    bootstrap = (
        args.kafka_bootstrap or os.environ.get(BOOTSTRAP_ENV) or stack_setting("kafka_bootstrap")
    )
    if not bootstrap:
        raise ValueError(
            f"no broker: pass --kafka-bootstrap, set {BOOTSTRAP_ENV}, or run `kvledger up` here"
        )
    return bootstrap


def producer_signer(key_file: str | None) -> EnvelopeSigner:
    """The signer of ``key_file``, else of ``KVLEDGER_PRODUCER_KEY_FILE``, else of the stack's producer key.

    ValueError when there is none or it is not an Ed25519 private key; the key is never created
    here (an unenrolled new key would only get every event dead-lettered).
    """
    path = key_file or os.environ.get(PRODUCER_KEY_ENV) or stack_setting("producer_key_file")
    if not path:
        raise ValueError(
            f"no producer key: pass --producer-key, set {PRODUCER_KEY_ENV}, or run `kvledger up` here"
        )
    try:
        return EnvelopeSigner(load_private_key_pem(Path(path).read_bytes()))
    except OSError as exc:
        raise ValueError(f"cannot read the producer key {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise ValueError(f"producer key {path}: {exc}") from None


_SECURITY_FLAGS = (
    "security_protocol",
    "sasl_mechanism",
    "sasl_username",
    "ssl_cafile",
    "ssl_certfile",
    "ssl_keyfile",
)
"""Security settings that have a ``--kafka-*`` flag; the SASL password has none, so it never shows in a process list."""


def kafka_settings(args: argparse.Namespace, bootstrap: str) -> KafkaSettings:
    """The producer's connection: the shared ``KVLEDGER_KAFKA_*`` variables, overridden by
    ``--kafka-*`` flags.

    ValueError names what is inconsistent (e.g. SASL without a password, a missing CA file).
    """
    security = {
        name: os.environ[variable]
        for variable, name in KAFKA_SHARED_ENV.items()
        if os.environ.get(variable)
    }
    for name in _SECURITY_FLAGS:
        value = getattr(args, f"kafka_{name}", None)
        if value is not None:
            security[name] = value
    try:
        return KafkaSettings(bootstrap=bootstrap, client_id="kvledger-publish", **security)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        # A validator's own ValueError travels in ctx; pydantic's msg prefixes it with "Value error,
        # ".
        raise ValueError(
            "; ".join(str(error.get("ctx", {}).get("error", error["msg"])) for error in errors)
        ) from None


def build_event(args: argparse.Namespace) -> Envelope:
    """The envelope for the parsed subcommand. ValueError names what is wrong with the input."""
    payload: EventPayload
    try:
        match args.event_kind:
            case "document-updated":
                payload = DocumentUpdated(doc_id=args.doc, version=args.version)
            case "document-deleted":
                payload = DocumentDeleted(doc_id=args.doc)
            case "permission-revoked":
                payload = PermissionRevoked(
                    auth_scope=args.auth_scope,
                    policy_version=args.policy_version,
                    subject_id=args.subject,
                )
            case "erasure-requested":
                erasure_id = uuid.UUID(args.erasure_id) if args.erasure_id else None
                payload = ErasureRequested(
                    erasure_id=erasure_id, subject_id=args.subject, reason=args.reason
                )
            case _:
                raise ValueError(f"unknown event kind {args.event_kind!r}")
        return make_event(payload, tenant_id=args.tenant)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in error['loc'])}: {error['msg']}"
            for error in exc.errors(include_url=False, include_input=False)
        )
        raise ValueError(problems) from None


async def publish(settings: KafkaSettings, envelope: Envelope, signer: EnvelopeSigner) -> Any:
    topic, _ = route(envelope)
    await ensure_topics(settings, [topic])
    async with EventProducer(settings, sign=signer) as producer:
        return await producer.send(envelope)


def cli(args: argparse.Namespace) -> int:
    try:
        envelope = build_event(args)
        bootstrap = _bootstrap(args)
        settings = kafka_settings(args, bootstrap)
        signer = producer_signer(args.producer_key)
    except ValueError as exc:
        print(f"kvledger publish: error: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(publish(settings, envelope, signer))
    except (KafkaError, OSError, TimeoutError) as exc:
        print(
            f"kvledger publish: error: cannot publish to {bootstrap}: {type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
        return 1
    print(envelope.event_id)
    return 0
