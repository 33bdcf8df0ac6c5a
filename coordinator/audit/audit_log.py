"""The erasure audit log's storage: receipt signing keys, receipts as leaves, signed tree heads
(docs/design.md §6).

Beside :mod:`coordinator.audit.receipts` (the receipt and tree-head documents, signing and
offline verification) and :mod:`coordinator.audit.merkle` (the tree and its proofs), this
module keeps them in the ledger: :class:`ReceiptKeys` finds or makes the signing key,
:func:`append_receipt` stores a signed receipt as the next leaf and signs the new tree
head, and :func:`latest_tree_head`/:func:`leaf_hashes` read the log back for proofs.
Appends hold the audit log's own advisory lock, so the log never forks even when two
coordinators verify erasures at once.
"""

from __future__ import annotations

import logging
import uuid
from datetime import datetime
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from pydantic import SecretStr
from sqlalchemy import func, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from coordinator.audit import merkle, receipts
from coordinator.keys.data_keys import unwrap_secret, wrap_secret
from coordinator.ledger.models import AuditLogEntry, Receipt, ReceiptKey, TreeHead

log = logging.getLogger(__name__)

_AUDIT_LOG_LOCK_KEY = 0x6B766C2D617564  # "kvl-aud"; arbitrary, constant across releases
_RECEIPT_KEY_LABEL = b"kvledger-receipt-key:"
"""AAD prefix of a wrapped receipt key, so it can never be unwrapped as a data key (or the reverse)."""


class AuditLogCorrupted(RuntimeError):
    """The stored leaves no longer hash to a signed tree head: nothing more may be signed over them."""


class ReceiptKeyUnavailable(RuntimeError):
    """No signing key is configured and none can be generated (no master key to store it under)."""


class ReceiptKeys:
    """The receipt signing key: from settings (PEM), else generated once and stored wrapped under the master key.

    Only used inside the audit log lock, so two coordinators without a configured key
    never generate two keys: the second finds the first one's row.
    """

    def __init__(self, signing_key: SecretStr | None, master_key: bytes | None) -> None:
        self._configured = (
            None if signing_key is None else receipts.ReceiptSigner.from_pem(signing_key)
        )
        self._master = None if master_key is None else AESGCM(master_key)
        self._signer: receipts.ReceiptSigner | None = None

    async def signer(self, session: AsyncSession) -> receipts.ReceiptSigner:
        if self._signer is not None:
            return self._signer
        if self._configured is not None:
            public = self._configured.public_key
            await session.execute(
                pg_insert(ReceiptKey)
                .values(key_id=public.key_id, public_key=public.raw)
                .on_conflict_do_nothing()
            )
            # A configured key takes over from any key generated before it; retired keys stay
            # listed.
            await session.execute(
                update(ReceiptKey)
                .where(ReceiptKey.key_id != public.key_id, ReceiptKey.retired_at.is_(None))
                .values(retired_at=func.now())
            )
            self._signer = self._configured
            return self._signer
        if self._master is None:
            raise ReceiptKeyUnavailable(
                "no receipt signing key: set KVLEDGER_RECEIPT_SIGNING_KEY, or KVLEDGER_MASTER_KEY to let the "
                "coordinator generate and store one"
            )
        row = await session.scalar(
            select(ReceiptKey)
            .where(ReceiptKey.private_key.is_not(None), ReceiptKey.retired_at.is_(None))
            .order_by(ReceiptKey.created_at.desc())
            .limit(1)
        )
        if row is not None:
            raw = unwrap_secret(
                self._master,
                _RECEIPT_KEY_LABEL + row.key_id.encode(),
                row.private_key,
                "receipt key",
            )
            self._signer = receipts.ReceiptSigner(Ed25519PrivateKey.from_private_bytes(raw))
            return self._signer
        private_key = Ed25519PrivateKey.generate()
        signer = receipts.ReceiptSigner(private_key)
        raw = private_key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        session.add(
            ReceiptKey(
                key_id=signer.key_id,
                public_key=signer.public_key.raw,
                private_key=wrap_secret(
                    self._master, _RECEIPT_KEY_LABEL + signer.key_id.encode(), raw
                ),
            )
        )
        await session.flush()
        log.info(
            "generated receipt signing key %s (stored wrapped under the master key)", signer.key_id
        )
        self._signer = signer
        return signer


def tree_head_document(head: TreeHead) -> dict[str, Any]:
    """A stored tree head in the shape ``sign_tree_head`` made it (and ``verify_served_receipt``
    takes)."""
    return {
        "tree_size": head.tree_size,
        "root_hash": head.root_hash.hex(),
        "timestamp": receipts.rfc3339(head.timestamp),
        "key_id": head.key_id,
        "signature": head.signature,
    }


async def leaf_hashes(session: AsyncSession, tree_size: int) -> list[bytes]:
    """The first ``tree_size`` leaf hashes; :class:`AuditLogCorrupted` when some are missing."""
    leaves = list(
        (
            await session.scalars(
                select(AuditLogEntry.leaf_hash)
                .where(AuditLogEntry.leaf_index < tree_size)
                .order_by(AuditLogEntry.leaf_index)
            )
        ).all()
    )
    if len(leaves) != tree_size:
        raise AuditLogCorrupted(
            f"the audit log holds {len(leaves)} of the {tree_size} leaves its tree head signed"
        )
    return leaves


async def latest_tree_head(session: AsyncSession) -> TreeHead | None:
    return await session.scalar(select(TreeHead).order_by(TreeHead.tree_size.desc()).limit(1))


async def append_receipt(
    session: AsyncSession,
    signed: dict[str, Any],
    erasure_id: uuid.UUID,
    signer: receipts.ReceiptSigner,
    now: datetime,
) -> tuple[Receipt, TreeHead]:
    """Store ``signed``, append its leaf and sign the new tree head, under the audit log lock.

    Before signing anything the stored leaves are checked against the latest signed
    head: a log rewritten in the database must never be countersigned by a new head.
    """
    await session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _AUDIT_LOG_LOCK_KEY})
    head = await latest_tree_head(session)
    size = 0 if head is None else head.tree_size
    leaves = await leaf_hashes(session, size)
    if head is not None and merkle.root_hash(size, leaves) != head.root_hash:
        raise AuditLogCorrupted(
            f"the stored audit log no longer hashes to its signed tree head of size {size}"
        )
    leaves.append(receipts.audit_leaf_hash(signed))
    timestamp = now.replace(
        microsecond=now.microsecond // 1000 * 1000
    )  # the signed form has milliseconds
    sth = receipts.sign_tree_head(size + 1, merkle.root_hash(size + 1, leaves), timestamp, signer)
    receipt = Receipt(
        receipt_id=uuid.UUID(signed["receipt"]["receipt_id"]),
        erasure_id=erasure_id,
        document=signed,
        leaf_index=size,
    )
    session.add(receipt)
    await session.flush()
    session.add(AuditLogEntry(leaf_index=size, leaf_hash=leaves[-1], receipt_id=receipt.receipt_id))
    new_head = TreeHead(
        tree_size=size + 1,
        root_hash=bytes.fromhex(sth["root_hash"]),
        timestamp=timestamp,
        key_id=signer.key_id,
        signature=sth["signature"],
    )
    session.add(new_head)
    await session.flush()
    return receipt, new_head
