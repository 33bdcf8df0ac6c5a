"""Byte encoding of record values and keys.

Values are compact UTF-8 JSON envelopes (no whitespace, so the same event always
encodes to the same bytes). Keys are UTF-8 strings. Dead-letter values wrap the
*raw* bytes of the failed record in base64, because a record that failed to decode
may not be valid UTF-8 or JSON at all, and must be kept byte-exact for replay — or,
when the record is too large for its dead letter to fit one producer request, refer to
it *by reference* (coordinates, size, SHA-256 and a bounded prefix; see
``events.kafka.dead_letters.dead_letter_record``).
"""

from __future__ import annotations

import base64
import hashlib
from datetime import UTC, datetime
from typing import Any

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from events.kv_decoder import decode_kv_event
from events.schema import Envelope, EventValidationError


def encode_event(envelope: Envelope) -> bytes:
    return envelope.model_dump_json().encode()


def decode_event(value: bytes | None) -> Envelope:
    """Validate one record value; a tombstone (``None``) is malformed too.

    kv-events types are read by the compiled decoder (``events.kv_decoder``), which yields what
    ``events.schema.parse_event`` yields and leaves every refusal, and its message, to it.
    """
    if value is None:
        raise EventValidationError("record has no value")
    return decode_kv_event(value)


def encode_key(key: str) -> bytes:
    return key.encode()


def decode_key(key: bytes | None) -> str | None:
    if key is None:
        return None
    try:
        return key.decode()
    except UnicodeDecodeError:
        raise EventValidationError("record key is not UTF-8") from None


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


MAX_DEAD_LETTER_ERROR_CHARS = 2048
"""The longest error a dead letter carries: a record with thousands of invalid fields has as many
validation errors, and its letter must still fit one producer request."""
MAX_REFERENCE_PREFIX_BYTES = 1024
"""How much of a record's value (and at most of its key) a by-reference dead letter keeps: enough to
recognise the record, small enough that the letter always fits."""


class LetterSignature(BaseModel):
    """The coordinator's signature over a dead letter (``identity.signing.sign_dead_letter``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kid: str = Field(max_length=64)
    sig: str = Field(max_length=128)


def bounded_error(error: str) -> str:
    """``error`` cut to :data:`MAX_DEAD_LETTER_ERROR_CHARS` (marked with an ellipsis when cut)."""
    if len(error) <= MAX_DEAD_LETTER_ERROR_CHARS:
        return error
    return error[: MAX_DEAD_LETTER_ERROR_CHARS - 1] + "…"


class DeadLetter(BaseModel):
    """Value of a dead-letter record: where the bad record was, its raw bytes (or a reference to them) and why it failed.

    ``by_reference`` letters hold no replayable bytes: the record was too large for its letter to
    fit one producer request, so only ``num_value_bytes``, ``value_sha256`` and a bounded
    ``value_prefix_b64`` travel (the original stays on its source topic until retention deletes it).
    ``signature`` is the coordinator's (``identity.signing``); replay refuses a letter without a
    valid one. The fields after ``dead_lettered_at`` are optional: older letters stay valid.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    topic: str
    partition: int
    offset: int
    timestamp_ms: int | None
    key_b64: str | None
    value_b64: str | None
    error: str
    group_id: str | None
    dead_lettered_at: AwareDatetime
    by_reference: bool = False
    num_value_bytes: int | None = None
    value_sha256: str | None = None
    value_prefix_b64: str | None = None
    signature: LetterSignature | None = None

    @classmethod
    def of(
        cls,
        *,
        topic: str,
        partition: int,
        offset: int,
        timestamp_ms: int | None,
        key: bytes | None,
        value: bytes | None,
        error: str,
        group_id: str | None,
        by_reference: bool = False,
    ) -> DeadLetter:
        """The letter of one record: its bytes whole, or (``by_reference``) its size, hash and prefixes only."""
        if by_reference:
            prefix = None if value is None else value[:MAX_REFERENCE_PREFIX_BYTES]
            key = (
                key
                if key is None or len(key) <= MAX_REFERENCE_PREFIX_BYTES
                else key[:MAX_REFERENCE_PREFIX_BYTES]
            )
        return cls(
            topic=topic,
            partition=partition,
            offset=offset,
            timestamp_ms=timestamp_ms,
            key_b64=_b64(key),
            value_b64=None if by_reference else _b64(value),
            error=bounded_error(error),
            group_id=group_id,
            dead_lettered_at=datetime.now(UTC),
            by_reference=by_reference,
            num_value_bytes=None if value is None else len(value),
            value_sha256=None if value is None else hashlib.sha256(value).hexdigest(),
            value_prefix_b64=_b64(prefix) if by_reference else None,
        )

    def raw_value(self) -> bytes | None:
        return None if self.value_b64 is None else base64.b64decode(self.value_b64)

    def raw_key(self) -> bytes | None:
        return None if self.key_b64 is None else base64.b64decode(self.key_b64)

    def signed_content(self) -> dict[str, Any]:
        """What the coordinator's signature covers: every field but ``signature``, as JSON values."""
        return self.model_dump(mode="json", exclude={"signature"})

    def encode(self) -> bytes:
        return self.model_dump_json().encode()
