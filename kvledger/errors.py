"""What a ``kvledger`` command raises for a failure the user can fix, and the exit statuses.

Its own module, not ``kvledger.cli``: run as ``python -m kvledger.cli`` the CLI is
``__main__``, and a class defined there would not be the one commands import.
"""

from __future__ import annotations

EXIT_FAILURE = 1
"""A service could not be reached or refused, or a check failed."""
EXIT_USAGE = 2
"""Bad flags, bad input, a missing or unreadable file: nothing was attempted."""


class CliError(Exception):
    """An expected failure whose message is the whole story: printed as one line, exit
    ``exit_status``."""

    def __init__(self, message: str, exit_status: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.exit_status = exit_status
