"""The pieces of ``events.http_server`` a process test cannot reach: settings checks, the file
descriptor budget, and how refusals and out-of-resource loop errors reach the log (counted, never a
traceback each)."""

from __future__ import annotations

import asyncio
import errno
import logging
import resource

import pytest
from helpers.ledger import eventually
from pydantic import ValidationError

from events.http_server import (
    LISTEN_BACKLOG,
    NUM_SPARE_FILES,
    HttpServerLimits,
    RefusalLog,
    connection_bound,
    raise_file_limit,
    summarize_resource_errors,
)


def test_limits_must_be_consistent():
    with pytest.raises(ValidationError, match="max_url_bytes"):
        HttpServerLimits(max_url_bytes=128 * 1024, max_header_bytes=64 * 1024)
    with pytest.raises(ValidationError, match="num_probe_connections"):
        HttpServerLimits(max_connections=16, num_probe_connections=16)


def test_connection_bound_fits_the_file_descriptor_limit():
    limits = HttpServerLimits(max_connections=1024)
    roomy = LISTEN_BACKLOG + NUM_SPARE_FILES + 1024
    assert connection_bound(limits, roomy) == 1024
    assert connection_bound(limits, roomy - 100) == 924
    with pytest.raises(ValueError, match="ulimit"):
        connection_bound(limits, LISTEN_BACKLOG + NUM_SPARE_FILES + limits.num_probe_connections)


def test_file_limit_is_raised_to_the_hard_limit():
    soft = raise_file_limit()
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == soft
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert hard == resource.RLIM_INFINITY or soft == hard


async def test_refusals_are_logged_once_then_counted(caplog: pytest.LogCaptureFixture):
    logger = logging.getLogger("test.http_refusals")
    refusals = RefusalLog(logger, interval_s=0.2)
    with caplog.at_level(logging.WARNING, logger=logger.name):
        for _ in range(500):
            refusals.record("connection refused")
        refusals.record("request refused: 431")

        def summarized() -> bool:
            return any("499 more" in record.getMessage() for record in caplog.records)

        await eventually(summarized, timeout_s=10, what="the summary of the held-back refusals")
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 3, messages
    assert sum("connection refused" in message for message in messages) == 2
    assert not any(record.exc_info for record in caplog.records)


async def test_out_of_resource_loop_errors_are_counted_not_traced(caplog: pytest.LogCaptureFixture):
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    summarize_resource_errors(loop)
    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(100):
                error = OSError(errno.EMFILE, "Too many open files")
                loop.call_exception_handler(
                    {"message": "socket.accept() out of system resource", "exception": error}
                )
            loop.call_exception_handler(
                {"message": "something else", "exception": RuntimeError("boom")}
            )
    finally:
        loop.set_exception_handler(previous)
    emfile = [record for record in caplog.records if "EMFILE" in record.getMessage()]
    assert len(emfile) == 1 and emfile[0].exc_info is None
    other = [record for record in caplog.records if "something else" in record.getMessage()]
    assert len(other) == 1 and other[0].exc_info is not None, (
        "other loop errors keep the default handler"
    )
