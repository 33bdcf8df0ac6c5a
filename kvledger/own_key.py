"""``kvledger nodes key`` and ``kvledger producers key``: a party's own Ed25519 key, made once, shown as its public half.

Both parties hold a key of the same kind (a node signs kv-events and acks, a producer signs customer
events) and enroll its public half at the coordinator, so one function serves both commands.
"""

from __future__ import annotations

import sys
from pathlib import Path

from identity.signing import key_id, load_or_create_private_key, public_key_pem


def print_public_key(key_file: Path, command: str) -> int:
    """Load the key at ``key_file`` (created, mode 0600, when missing); print its public key PEM, its id on stderr.

    Exit status 2 with one line naming ``command`` and the file when it cannot be read or written.
    """
    try:
        private_key = load_or_create_private_key(key_file)
    except (OSError, ValueError) as error:
        print(f"kvledger {command}: error: {key_file}: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(public_key_pem(private_key.public_key()).decode())
    print(f"key id {key_id(private_key.public_key())} ({key_file})", file=sys.stderr)
    return 0
