"""Byte encoding of record values and keys.

Values are compact UTF-8 JSON envelopes (no whitespace, so the same event always
encodes to the same bytes). Keys are UTF-8 strings. Dead-letter values wrap the
*raw* bytes of the failed record in base64, because a record that failed to decode
may not be valid UTF-8 or JSON at all, and must be kept byte-exact for replay.
"""

from __future__ import annotations

import base64
from datetime import UTC, datetime

from pydantic import AwareDatetime, BaseModel, ConfigDict

from events.schema import Envelope, EventValidationError, parse_event


def encode_event(envelope: Envelope) -> bytes:
    return envelope.model_dump_json().encode()


def decode_event(value: bytes | None) -> Envelope:
    """Validate one record value; a tombstone (``None``) is malformed too."""
    if value is None:
        raise EventValidationError("record has no value")
    return parse_event(value)


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


class DeadLetter(BaseModel):
    """Value of a ``kvledger.dead-letter`` record: where the bad record was, its raw bytes and why it failed."""

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
    ) -> DeadLetter:
        return cls(
            topic=topic,
            partition=partition,
            offset=offset,
            timestamp_ms=timestamp_ms,
            key_b64=_b64(key),
            value_b64=_b64(value),
            error=error,
            group_id=group_id,
            dead_lettered_at=datetime.now(UTC),
        )

    def raw_value(self) -> bytes | None:
        return None if self.value_b64 is None else base64.b64decode(self.value_b64)

    def raw_key(self) -> bytes | None:
        return None if self.key_b64 is None else base64.b64decode(self.key_b64)

    def encode(self) -> bytes:
        return self.model_dump_json().encode()
