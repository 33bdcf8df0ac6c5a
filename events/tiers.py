"""The storage tiers, one vocabulary for the node, the wire contract and the ledger.

A block lives on a node in GPU memory (``device``), host memory (``host``) or on local
disk (``disk``); the ledger also tracks the copies inside a node's snapshots
(``snapshot``). The ledger's ``placements.tier`` CHECK constraint allows exactly these
values, and the wire models (``events.schema``) validate and serialize them by value, so
they never change spelling: a new tier needs a migration that widens the constraint.
Members are ``str``s: rows and JSON read back as plain strings compare equal to them.
"""

from __future__ import annotations

import typing
from enum import StrEnum
from typing import Literal


class Tier(StrEnum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
    SNAPSHOT = "snapshot"
    """Not a place a block is served from: the copies kept in a node's snapshots."""


StorageTier = Literal[Tier.DEVICE, Tier.HOST, Tier.DISK]
"""The tiers a single block lives in on a node, as a type: block events name only these."""
STORAGE_TIERS: tuple[StorageTier, ...] = typing.get_args(StorageTier)
VOLATILE_TIERS = (Tier.DEVICE, Tier.HOST)
"""Tiers whose bytes do not survive a node restart."""
