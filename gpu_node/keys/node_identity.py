"""The node's own signing key and the coordinator's pinned command key, from
``NodeSettings.identity``."""

from __future__ import annotations

from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from gpu_node.settings import NodeSettings
from identity.signing import load_or_create_private_key, load_public_key_file

NODE_KEY_FILE = "node_key.pem"


def node_key_path(settings: NodeSettings) -> Path:
    return settings.identity.key_file or Path(settings.data_dir) / NODE_KEY_FILE


def node_signing_key(settings: NodeSettings) -> Ed25519PrivateKey:
    """The node's Ed25519 key: the configured file, else ``node_key.pem`` in the data dir, created
    (0600) if missing."""
    return load_or_create_private_key(node_key_path(settings))


def pinned_command_key(settings: NodeSettings) -> Ed25519PublicKey:
    """The coordinator's command public key; ValueError when none is pinned — a node never applies
    unverified commands."""
    path = settings.identity.coordinator_public_key_file
    if path is None:
        raise ValueError(
            "a node on Kafka needs the coordinator's command public key: set identity.coordinator_public_key_file"
            " (KVLEDGER_NODE_IDENTITY__COORDINATOR_PUBLIC_KEY_FILE); it refuses to apply unsigned commands"
        )
    try:
        return load_public_key_file(path)
    except OSError as error:
        raise ValueError(
            f"cannot read the coordinator's command public key {path}: {error.strerror}"
        ) from None
