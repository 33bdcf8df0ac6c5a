"""Sizes of the AES-256-GCM sealing that node and coordinator must agree on.

A node seals blocks at rest under data keys (``gpu_node/keys/crypto.py``); the
coordinator creates, wraps and serves those keys (``coordinator/keys/data_keys.py``) and
checks key ids on its HTTP routes (``coordinator/api/routes/keys.py``). Both sides must
use the same key length, nonce length and key-id format, and neither side may
import the other (docs/architecture.md, "Boundaries"), so the numbers live here.
"""

from __future__ import annotations

KEY_BYTES = 32
"""AES-256: a data key is 32 bytes."""

NONCE_BYTES = 12
"""The 96-bit GCM nonce, stored in front of each ciphertext."""

TAG_BYTES = 16
"""The GCM authentication tag, stored after each ciphertext."""

KEY_ID_HEX_CHARS = 32
"""A key id is 32 lowercase hex digits (128 bits); it names neither tenant nor subject."""
