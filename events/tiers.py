"""The storage tiers, one vocabulary for the node, the wire contract and the ledger.

A block lives on a node in GPU memory (``device``), host memory (``host``) or on local
disk (``disk``); the ledger also tracks the copies inside a node's snapshots
(``snapshot``). The ledger's ``placements.tier`` CHECK constraint allows exactly these
values, so they never change spelling: a new tier needs a migration that widens it.
Members are ``str``s: rows and JSON read back as plain strings compare equal to them.
"""

from __future__ import annotations

from enum import StrEnum


class Tier(StrEnum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
    SNAPSHOT = "snapshot"
    """Not a place a block is served from: the copies kept in a node's snapshots."""


STORAGE_TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)
"""The tiers a single block lives in on a node."""
VOLATILE_TIERS = (Tier.DEVICE, Tier.HOST)
"""Tiers whose bytes do not survive a node restart."""
