"""Named fault points: test-only places where a process can be made to die by ``SIGKILL``
(docs/operations.md, "Fault points").

Code that must survive a crash at a precise step calls
``fault_point("coordinator.after_decision_commit")`` there. Normally that call does nothing and
costs one comparison: the environment is read once, at import. A process started with
``KVLEDGER_FAULT_POINT=<name>`` kills itself with ``SIGKILL`` the first time it reaches ``<name>``;
``KVLEDGER_FAULT_POINT=<name>:<n>`` waits for the ``n``-th time. ``SIGKILL`` rather than an
exception or ``sys.exit``: nothing of the process (``finally`` blocks, atexit hooks, buffered
writes, the Kafka client's pending sends) gets a chance to run, which is what a power cut or the OOM
killer does.

A few faults are not deaths: :func:`fault_triggered` names a point whose caller simulates the fault
itself when it returns True (e.g. a send the broker took, reported to the client as timed out).

Living in ``events`` (the contract shared by both sides) lets the node and the coordinator use it
without either importing the other.
"""

from __future__ import annotations

import os
import signal

ENV_VAR = "KVLEDGER_FAULT_POINT"

POINTS = frozenset(
    {
        "coordinator.after_decision_commit",
        "coordinator.after_publish",
        "coordinator.mid_ack_batch",
        "coordinator.mid_erasure_verification",
        "coordinator.during_receipt_issue",
        "node.between_tombstone_and_delete",
        "node.between_delete_and_ack",
        "node.during_snapshot_write",
    }
)
"""Every name passed to :func:`fault_point`; a setting naming anything else is a configuration
error."""
SIMULATED = frozenset({"node.kv_events_send_timed_out"})
"""Every name passed to :func:`fault_triggered`."""


def parse(setting: str | None) -> tuple[str, int] | None:
    """``"<name>"`` or ``"<name>:<n>"`` → (name, n); None when unset or empty; ValueError for anything else."""
    if not setting:
        return None
    name, _, count = setting.partition(":")
    if name not in POINTS | SIMULATED:
        raise ValueError(
            f"{ENV_VAR}={setting!r}: unknown fault point; expected one of {', '.join(sorted(POINTS | SIMULATED))}"
        )
    if not count:
        return name, 1
    if not count.isdigit() or int(count) < 1:
        raise ValueError(f"{ENV_VAR}={setting!r}: the hit number must be a positive integer")
    return name, int(count)


_ARMED = parse(os.environ.get(ENV_VAR))
_hits = 0


def fault_point(name: str) -> None:
    """SIGKILL this process if it was started with ``KVLEDGER_FAULT_POINT`` naming ``name`` and this is the chosen hit."""
    global _hits
    if _ARMED is None or _ARMED[0] != name:
        return
    _hits += 1
    if _hits >= _ARMED[1]:
        os.kill(os.getpid(), signal.SIGKILL)


def fault_triggered(name: str) -> bool:
    """True once, at the chosen hit, if this process was started with ``KVLEDGER_FAULT_POINT`` naming ``name``;
    the caller then simulates the fault. False otherwise (one comparison when unset)."""
    global _hits
    if _ARMED is None or _ARMED[0] != name:
        return False
    _hits += 1
    return _hits == _ARMED[1]
