"""What an erasure does beyond the pool: snapshots rewritten without the matches, and the subject's
data keys destroyed (crypto-erase), so a copy made off the node no longer decrypts here."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from events import schema
from gpu_node.keys.crypto import DataKeyProvider
from gpu_node.pool import snapshots
from prefix_keys.blocks import CacheProvenance

if TYPE_CHECKING:
    pass


@dataclass(frozen=True, slots=True)
class SnapshotRemoval:
    """Blocks one snapshot no longer holds; ``verified``: every replaced shard file is absent.

    ``key_ids``: the data keys that sealed the matching records removed.
    """

    snapshot_id: str
    block_hashes: tuple[bytes, ...]
    verified: bool
    key_ids: frozenset[str] = frozenset()


def fetch_snapshot_keys(root: Path, key_provider: DataKeyProvider) -> None:
    """Ask ``key_provider`` (a blocking view) for every data key that sealed a snapshot under ``root``.

    Blocking, and meant for a thread: run before :func:`remove_from_snapshots`,
    it leaves the keys in memory, so the pass on the model worker waits on the
    key service only for a snapshot written in between. Raises
    :class:`gpu_node.keys.crypto.KeyServiceUnavailable` when a key can be neither
    fetched nor known destroyed: the command fails and is retried, its
    snapshots untouched.
    """
    for directory in snapshots.complete_snapshots(root):
        for key_id in sorted(snapshots.sealing_key_ids(directory)):
            key_provider.key_by_id(key_id)


def remove_from_snapshots(
    root: Path,
    predicates: Sequence[Callable[[CacheProvenance], bool]],
    key_provider: DataKeyProvider,
) -> list[list[SnapshotRemoval]]:
    """Rewrite every snapshot under ``root`` without blocks any predicate matches; per predicate, what it removed.

    Blocking: reads every shard once, whatever the number of predicates — a
    batch of commands costs one pass, not one per command. Each removed record
    is attributed to every predicate matching its provenance; a record removed
    because it could no longer be decoded (see
    :func:`snapshots.remove_from_snapshot`) to the first predicate, the one
    that would have removed it had the commands been applied one by one.
    """
    removals: list[list[SnapshotRemoval]] = [[] for _ in predicates]
    if not predicates:
        return removals
    for directory in snapshots.complete_snapshots(root):
        before = snapshots.read_manifest(directory)
        records = snapshots.remove_from_snapshot(
            directory, lambda p: any(match(p) for match in predicates), key_provider
        )
        if not records:
            continue
        live_shards = set(snapshots.read_manifest(directory).shards)
        verified = all(
            not (directory / name).exists() for name in before.shards if name not in live_shards
        )
        for index, match in enumerate(predicates):
            mine = [
                r
                for r in records
                if (match(r.provenance) if r.provenance is not None else index == 0)
            ]
            if mine:
                hashes = tuple(dict.fromkeys(r.block_hash for r in mine))
                key_ids = frozenset(r.key_id for r in mine if r.key_id is not None)
                removals[index].append(
                    SnapshotRemoval(before.snapshot_id, hashes, verified, key_ids)
                )
    return removals


# --------------------------------------------------------------------------- crypto-erase


@dataclass(frozen=True, slots=True)
class CryptoErasure:
    """Data keys destroyed for one subject; ``verified``: none of them can be obtained any more."""

    key_ids: tuple[str, ...]
    verified: bool


def crypto_erase_subject(
    key_provider: DataKeyProvider, predicate: schema.SubjectPredicate, sealed_key_ids: set[str]
) -> CryptoErasure:
    """Destroy the subject's keys in ``key_provider`` and check each is gone (blocking: a local store fsyncs).

    The keys are the ones the provider can attribute to the subject's digest
    plus ``sealed_key_ids``, read from the headers of the subject's removed
    sealed copies — a provider that fetched a key by id to read a file does
    not know whose it is. With the coordinator's key service the authoritative
    destruction is the coordinator's; what the node destroys is its cached
    copy, after which it refuses to fetch the key again.
    """
    candidates = sorted(
        set(key_provider.subject_key_ids(predicate.tenant, predicate.subject_id)) | sealed_key_ids
    )
    # A key that survives destroy() is one its authority still serves (issued after the erasure
    # started, for the subject's newer data): not destroyed, so never reported as destroyed.
    key_ids = [
        key_id
        for key_id in candidates
        if key_provider.destroy(key_id) or key_provider.key_by_id(key_id) is None
    ]
    return CryptoErasure(
        tuple(key_ids), all(key_provider.key_by_id(key_id) is None for key_id in key_ids)
    )


# --------------------------------------------------------------------------- invalidation
