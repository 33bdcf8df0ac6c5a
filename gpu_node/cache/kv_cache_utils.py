"""The node's own block identities, beside the shared key derivation of :mod:`prefix_keys.blocks`.

Block keys are derived in ``prefix_keys`` because a router must compute them too. What only a
node needs stays here: the shadow hashes that explain its cache misses. (The KV layout version,
part of the namespace's KV format, is the block geometry's: ``gpu_node.pool.kv_spec``.)
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from prefix_keys.blocks import DEFAULT_BLOCK_SIZE, hash_block, pack_token_ids

SHADOW_ROOT = hashlib.sha256(b"kvledger/shadow/v1").digest()


def compute_shadow_hashes(
    token_ids: Sequence[int], num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE
) -> list[bytes]:
    """Scope-free, namespace-free chained hashes of the token prefix.

    They feed the shadow index that explains misses (same tokens cached under
    another namespace or salt → MODEL_VERSION_MISMATCH / AUTH_SCOPE_MISMATCH …).
    Kept out of :func:`prefix_keys.blocks.compute_block_keys` because only misses need them,
    so a full hit pays nothing for diagnostics.
    """
    packed = pack_token_ids(token_ids[: num_blocks * block_size])
    hashes: list[bytes] = []
    parent = SHADOW_ROOT
    for index in range(num_blocks):
        parent = hash_block(
            parent, b"", packed[index * block_size * 4 : (index + 1) * block_size * 4], b""
        )
        hashes.append(parent)
    return hashes
