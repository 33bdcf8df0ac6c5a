"""Which handler failures are the data's fault (dead-letter the record) and which may pass (retry)."""

from __future__ import annotations

import pytest

from coordinator.handlers.poison import refused_as_data


class _DbError(Exception):
    """Stands for a DBAPI error: asyncpg's and SQLAlchemy's adapted errors carry ``sqlstate``."""

    def __init__(self, sqlstate: str | None) -> None:
        super().__init__("Key (doc_id)=(secret) violates check constraint")
        self.sqlstate = sqlstate


class _Wrapper(Exception):
    """Stands for ``sqlalchemy.exc.DBAPIError``: the driver's error is ``.orig``."""

    def __init__(self, orig: BaseException) -> None:
        super().__init__("wrapped")
        self.orig = orig


@pytest.mark.parametrize(
    "sqlstate", ["22021", "22003", "22P02", "23514", "23505", "23503", "23502"]
)
def test_data_and_integrity_sqlstates_are_the_datas_fault(sqlstate: str) -> None:
    reason = refused_as_data(_Wrapper(_DbError(sqlstate)))
    assert reason == f"_DbError (SQLSTATE {sqlstate})"
    assert "secret" not in reason  # database messages quote values; the reason never does


@pytest.mark.parametrize("sqlstate", ["40001", "40P01", "57P01", "08006", "53300", "42P01", None])
def test_other_database_failures_are_retried(sqlstate: str | None) -> None:
    assert refused_as_data(_Wrapper(_DbError(sqlstate))) is None


def test_a_value_the_driver_cannot_encode_is_the_datas_fault() -> None:
    try:
        raise _Wrapper(_DbError(None)) from OverflowError("value out of int32 range")
    except _Wrapper as exc:
        assert refused_as_data(exc) == "OverflowError (value refused before reaching the database)"


def test_an_error_merely_handled_earlier_does_not_count() -> None:
    try:
        try:
            raise ValueError("parsed something unrelated")
        except ValueError:
            raise ConnectionResetError("connection lost")  # noqa: B904 - implicit __context__, not a cause
    except ConnectionResetError as exc:
        assert refused_as_data(exc) is None
