"""Which handler failures are the data's fault: the input to
:class:`events.kafka.consumer.BatchConsumer`'s bisection.

A record the database refuses *as data* fails the same way on every retry, so retrying
it would stall its partition forever; it is isolated and dead-lettered instead. Every
other failure may pass (a dropped connection, a serialization failure or deadlock, a
timeout, the database restarting) and is retried with backoff.

Refused as data:

* SQLSTATE class ``22`` (data exception: out of range, invalid text encoding, NUL in
  text, bad datetime …) and class ``23`` (integrity: CHECK, NOT NULL, foreign key,
  unique violated by the record's own values);
* a value the driver cannot even encode (asyncpg raises a ``ValueError`` subclass, e.g.
  an integer outside BIGINT, a lone surrogate) and any ``ValueError`` the handler raises
  about the event — this project's signal for bad caller input.

The reason names the exception type and SQLSTATE only: database messages quote values
("Key (doc_id)=(…)"), which may be personal data and must not reach the dead-letter topic.
"""

from __future__ import annotations

DATA_SQLSTATE_CLASSES = frozenset({"22", "23"})


def _chain(exc: BaseException):
    """``exc``, the DBAPI error SQLAlchemy wraps (``.orig``) and their explicit causes, each once.

    Not ``__context__``: an unrelated error handled earlier must not make a transient failure look
    like data."""
    seen: set[int] = set()
    pending = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending.extend((getattr(current, "orig", None), current.__cause__))


def refused_as_data(exc: BaseException) -> str | None:
    """A reason when ``exc`` means the database (or its driver) refused the events' data; else
    ``None``."""
    for error in _chain(exc):
        sqlstate = getattr(error, "sqlstate", None)
        if isinstance(sqlstate, str) and sqlstate[:2] in DATA_SQLSTATE_CLASSES:
            return f"{type(error).__name__} (SQLSTATE {sqlstate})"
    for error in _chain(exc):
        if isinstance(error, (ValueError, OverflowError)):
            return f"{type(error).__name__} (value refused before reaching the database)"
    return None
