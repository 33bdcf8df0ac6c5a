"""The pull hint a fleet router sends a node with a request (docs/architecture.md "Replicas").

Both sides of one HTTP hop agree on it: the router (``router.scoring.pull_hint``) sets it, the node
(``gpu_node.entrypoints.routes``) reads it. It names a node id and a block count, never an address:
the node resolves the id in its own trusted peer list, so no request can make a node connect
anywhere."""

from __future__ import annotations

PULL_FROM_HEADER = "x-kvledger-pull-from"
"""The node id said to hold the request's first blocks."""
PULL_BLOCKS_HEADER = "x-kvledger-pull-blocks"
"""How many of the request's first blocks it holds: a decimal in 1..:data:`MAX_HINT_BLOCKS`."""
MAX_HINT_BLOCKS = 65_536
