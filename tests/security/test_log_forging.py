"""No log line, and no line of the CLI's output, can be forged through a Kafka record.

A record's validation error names its fields by the sender's JSON key names. A key such as
``"\\x1b[8m\\n<a whole log line>\\n"`` used to reach coordinator.log raw (a standalone, forged
``INFO coordinator.handlers.erasure … verified`` line, the real one hidden by an ANSI "conceal") and
``kvledger dead-letters list``. Now the text formatter every process logs through escapes control,
ANSI, line-separator and bidi characters, the validation error bounds and escapes each key name,
and the CLI prints record-derived fields escaped.

Real Postgres, the session's broker, the coordinator's consumers in-process logging through the
processes' own handler (``events.logs.make_handler``), its API over real HTTP and ``kvledger`` as a
process."""

from __future__ import annotations

import io
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime

import pytest
from aiokafka import AIOKafkaProducer
from helpers.cli import kvledger, served_stack
from helpers.ledger import (
    RunningConsumers,
    eventually,
    operator_headers,
    running_consumers,
    settings_at_topic_ends,
)
from pydantic import BaseModel, ConfigDict, ValidationError

from coordinator.settings import CoordinatorSettings
from events.logs import JsonFormatter, escape_control, make_handler
from events.schema import MAX_DESCRIBED_ERRORS, MAX_LOCATION_PART_CHARS, describe_validation_error
from events.topics import ERASURES

ADMIN = operator_headers("platform-admin")
FORGED_LINE = "INFO coordinator.handlers.erasure: verified"
RAW_UNSAFE = re.compile(
    "[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]"
)
"""What must never appear in output (newline aside, which ends a line)."""


@pytest.fixture(scope="module")
async def settings(ledger_url: str, kafka_bootstrap: str) -> CoordinatorSettings:
    return await settings_at_topic_ends(ledger_url, kafka_bootstrap)


@pytest.fixture(scope="module")
async def consumers(settings: CoordinatorSettings) -> AsyncIterator[RunningConsumers]:
    async with running_consumers(settings) as running:
        yield running


@pytest.fixture
def text_log() -> Iterator[io.StringIO]:
    """What the root logger writes in the text format of every kvledger process."""
    stream = io.StringIO()
    handler = make_handler("text", stream)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield stream
    finally:
        root.removeHandler(handler)


async def publish_forging_record(bootstrap: str, marker: str) -> None:
    key_name = (
        marker + "\x1b[8m\n" + FORGED_LINE + "\n\u2028\u202e"
    )  # within MAX_LOCATION_PART_CHARS
    value = json.dumps({key_name: 1}).encode()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(ERASURES, value, key=b"acme:subject")
    finally:
        await producer.stop()


async def test_a_key_name_that_forges_a_line_yields_one_escaped_log_line_and_escaped_cli_output(
    consumers: RunningConsumers,
    settings: CoordinatorSettings,
    text_log: io.StringIO,
    kafka_bootstrap: str,
    tmp_path,
) -> None:
    since = datetime.now(UTC).isoformat()
    marker = uuid.uuid4().hex[:12]
    await publish_forging_record(kafka_bootstrap, marker)
    await eventually(
        lambda: marker in text_log.getvalue(), what="the record's dead-letter line logged"
    )

    lines = [line for line in text_log.getvalue().splitlines() if marker in line]
    assert len(lines) == 1, lines  # exactly one line, the dead-letter one; nothing standalone
    (line,) = lines
    assert " ERROR events.kafka.dead_letters " in line and "dead-lettered kvledger.erasures" in line
    assert f"{marker}\\x1b[8m\\n{FORGED_LINE}\\n\\u2028\\u202e" in line
    assert not RAW_UNSAFE.search(text_log.getvalue())
    assert not any(each.startswith(FORGED_LINE) for each in text_log.getvalue().splitlines())

    out = await _cli_listing(settings, tmp_path, since)
    listed = [row for row in out.splitlines() if marker in row]
    assert len(listed) == 1 and "\\x1b[8m\\n" in listed[0], out
    assert not RAW_UNSAFE.search(out)


async def _cli_listing(settings: CoordinatorSettings, tmp_path, since: str) -> str:
    """``kvledger dead-letters list`` (text) against the coordinator's API over real HTTP."""
    async with served_stack(settings, tmp_path) as stack:
        status, out, err = await kvledger(
            "dead-letters", "list", "--topic", ERASURES, "--since", since, "--stack", str(stack)
        )
    assert status == 0, err
    return out


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def test_validation_errors_bound_and_escape_the_senders_key_names() -> None:
    with pytest.raises(ValidationError) as raised:
        _Strict.model_validate({"k" * 5000 + "\n": 1, **{f"extra-{n}\x1b": n for n in range(50)}})
    described = describe_validation_error(raised.value)
    assert "\n" not in described and "\x1b" not in described and "\\x1b" in described
    assert "k" * MAX_LOCATION_PART_CHARS not in described and "…" in described
    assert described.count("Extra inputs are not permitted") == MAX_DESCRIBED_ERRORS
    assert described.endswith(f"and {51 - MAX_DESCRIBED_ERRORS} more errors")


def test_every_line_breaking_hiding_or_reordering_character_is_escaped_in_text_and_json_logs() -> (
    None
):
    hostile = "a\nb\rc\x1b[31md\x00e\x7ff\x85g\x9bh\u2028i\u2029j\u200ek\u200fl\u202am\u202en\u2066o\u2069p\ufeffq"
    escaped = escape_control(hostile)
    assert escaped == (
        "a\\nb\\rc\\x1b[31md\\x00e\\x7ff\\x85g\\x9bh\\u2028i\\u2029j\\u200ek\\u200fl\\u202am\\u202en\\u2066o\\u2069p\\ufeffq"
    )
    stream = io.StringIO()
    logger = logging.getLogger(f"test.forging.{uuid.uuid4().hex}")
    logger.propagate = False
    logger.addHandler(make_handler("text", stream))
    try:
        raise ValueError("boom\nINFO coordinator.handlers.erasure forged")
    except ValueError:
        logger.exception("record %s refused", hostile)
    lines = stream.getvalue().splitlines()
    assert lines[0].endswith(f"record {escaped} refused")
    assert all(line.startswith("    ") for line in lines[1:]) and not RAW_UNSAFE.search(
        stream.getvalue()
    )
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "%s", (hostile,), None)
    as_json = JsonFormatter().format(record)
    assert json.loads(as_json)["message"] == hostile and not RAW_UNSAFE.search(as_json)
