"""Ed25519 keys as PEM files, key ids, and signed Kafka envelopes.

Who signs what (``docs/security.md``, "Node identity and signed records"): the
coordinator signs every command it writes to the outbox with its command key; a
node signs its kv-events and acks with its own node key. A signature covers the
RFC 8785 canonical JSON of the envelope *without* its ``signature`` field, so it
survives any re-encoding that keeps the values (both ends serialize through the
same :class:`events.schema.Envelope` model) and breaks when any value changes —
a relabelled node id, a tampered predicate, a moved epoch.

A key id is the hex of the first 16 bytes of SHA-256 over the raw 32-byte public
key: receivers look keys up by it, and it names nobody.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import rfc8785
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from events.codec import DeadLetter, LetterSignature
from events.schema import Envelope, RecordSignature

PUBLIC_KEY_BYTES = 32

SIGNATURE_ERROR = "signature: "
"""Prefix of the dead-letter error of a record refused for its signature; one of the reasons below
follows."""
UNSIGNED = "unsigned"
UNKNOWN_KEY = "unknown_key"
"""Signed by a key the receiver does not trust for it (not enrolled, revoked, not the pinned command
key)."""
WRONG_NODE = "wrong_node"
"""Signed by an enrolled key of another node than the one the record names (a relabelled copy)."""
BAD_SIGNATURE = "bad_signature"
"""Signed under a trusted key id, but the signature does not match the content (tampered or forged)."""


def raw_public_key(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(public_key: Ed25519PublicKey) -> str:
    """Hex of the first 16 bytes of SHA-256 over the raw public key."""
    return hashlib.sha256(raw_public_key(public_key)).digest()[:16].hex()


def public_key_from_raw(data: bytes) -> Ed25519PublicKey:
    """ValueError unless ``data`` is a raw 32-byte Ed25519 public key."""
    if len(data) != PUBLIC_KEY_BYTES:
        raise ValueError(f"an Ed25519 public key is {PUBLIC_KEY_BYTES} bytes, got {len(data)}")
    return Ed25519PublicKey.from_public_bytes(data)


def private_key_pem(private_key: Ed25519PrivateKey) -> bytes:
    """Unencrypted PKCS#8 PEM: the file's 0600 mode is what protects it."""
    return private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def public_key_pem(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def load_private_key_pem(data: bytes) -> Ed25519PrivateKey:
    """An Ed25519 private key from unencrypted PEM; ValueError (never echoing the material)
    otherwise."""
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise ValueError("not an unencrypted PEM private key") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"expected an Ed25519 private key, got {type(key).__name__}")
    return key


def load_public_key_pem(data: bytes) -> Ed25519PublicKey:
    """An Ed25519 public key from PEM (SubjectPublicKeyInfo); ValueError otherwise."""
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError):
        raise ValueError("not a PEM public key") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"expected an Ed25519 public key, got {type(key).__name__}")
    return key


def load_public_key_file(path: Path) -> Ed25519PublicKey:
    """The PEM Ed25519 public key in ``path``; ValueError when it holds anything else."""
    return load_public_key_pem(Path(path).read_bytes())


def load_or_create_private_key(path: Path) -> Ed25519PrivateKey:
    """The Ed25519 key in ``path``, generated first if the file does not exist.

    The file is created with mode 0600 before any key material is written, and
    exclusively (``O_EXCL``): two processes starting at once never end up with
    different keys, the loser reads the winner's.
    """
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        key = Ed25519PrivateKey.generate()
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(descriptor, "wb") as file:
                file.write(private_key_pem(key))
            return key
    return load_private_key_pem(path.read_bytes())


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _from_b64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


_SAFE_INTEGER = 2**53 - 1
"""RFC 8785 numbers are IEEE 754 doubles: integers beyond this have no exact canonical form."""


def _same_as_stdlib_json(value: object) -> bool:
    """Whether :func:`json.dumps` (sorted keys, no whitespace, no ASCII escaping) writes ``value``
    exactly as RFC 8785 does.

    Both escape the same characters the same way (``"``, ``\\``, the C0 controls; short forms for
    ``\\b\\f\\n\\r\\t``, else lowercase ``\\u00xx``) and write strings and safe integers alike. They
    differ only in float formatting, in key order for non-ASCII keys (UTF-16 code units vs code
    points) and in how integers beyond the double range fail; such values go through ``rfc8785``.
    """
    pending = [value]
    while pending:
        item = pending.pop()
        if item is None or item is True or item is False or type(item) is str:
            continue
        if type(item) is int:
            if -_SAFE_INTEGER <= item <= _SAFE_INTEGER:
                continue
            return False
        if type(item) is list:
            pending.extend(item)
        elif type(item) is dict:
            if not all(type(key) is str and key.isascii() for key in item):
                return False
            pending.extend(item.values())
        else:
            return False
    return True


def canonical_json(value: Any) -> bytes:
    """RFC 8785 canonical JSON of ``value`` (a ``model_dump(mode="json")`` result).

    The pure-Python ``rfc8785`` serializer was the largest cost of signing and verifying a
    kv-events record (about 85 % of :func:`signed_bytes` for 50 blocks), so values the C
    encoder of :mod:`json` writes byte-identically take that path; the rest (floats,
    non-ASCII keys, unsafe integers) keep ``rfc8785``. Text that is not valid Unicode (a lone
    surrogate) fails either way: ``rfc8785`` raises its ``CanonicalizationError``.
    """
    if _same_as_stdlib_json(value):
        try:
            return json.dumps(
                value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
            ).encode()
        except UnicodeEncodeError:
            pass
    return rfc8785.dumps(value)


def signed_bytes(envelope: Envelope) -> bytes:
    """What a signature covers: the RFC 8785 canonical JSON of the envelope without ``signature``."""
    return canonical_json(envelope.model_dump(mode="json", exclude={"signature"}))


def sign_envelope(envelope: Envelope, private_key: Ed25519PrivateKey) -> Envelope:
    """A copy of ``envelope`` carrying ``private_key``'s signature (any previous one is replaced)."""
    signature = private_key.sign(signed_bytes(envelope))
    return envelope.model_copy(
        update={
            "signature": RecordSignature(
                kid=key_id(private_key.public_key()), sig=_b64url(signature)
            )
        }
    )


def verify_envelope(envelope: Envelope, public_key: Ed25519PublicKey) -> bool:
    """True when ``envelope`` carries a valid signature by ``public_key``; False when unsigned, by
    another key, or its content changed after signing."""
    signature = envelope.signature
    if signature is None or signature.kid != key_id(public_key):
        return False
    try:
        public_key.verify(_from_b64url(signature.sig), signed_bytes(envelope))
    except (InvalidSignature, binascii.Error, ValueError):
        return False
    return True


@dataclass(frozen=True, slots=True)
class EnrolledKey:
    """A node key enrolled at the coordinator (``coordinator.keys.node_keys``): what that node's
    records are checked against."""

    key_id: str
    node_id: str
    public_key: Ed25519PublicKey


def record_problem(envelope: Envelope, enrolled: Mapping[str, EnrolledKey]) -> str | None:
    """Why ``envelope`` may not be trusted as its node's record (a reason label), or None when it may.

    ``enrolled``: the enrolled, unrevoked node keys by key id. The node is the one the payload
    names: the signature must be by a key enrolled for exactly that node id, so a copy relabelled
    with another node's id fails. The coordinator's consumers and the router check kv-events and
    acks with this one function.
    """
    if envelope.signature is None:
        return UNSIGNED
    key = enrolled.get(envelope.signature.kid)
    if key is not None and key.node_id != getattr(envelope.payload, "node_id", None):
        return WRONG_NODE
    return signature_problem(envelope, None if key is None else key.public_key)


def signature_problem(envelope: Envelope, public_key: Ed25519PublicKey | None) -> str | None:
    """Why ``envelope`` is not signed by ``public_key`` (a reason constant), or None when it is.

    ``public_key`` is the key the receiver trusts under the envelope's ``kid`` (None: none).
    """
    if envelope.signature is None:
        return UNSIGNED
    if public_key is None or key_id(public_key) != envelope.signature.kid:
        return UNKNOWN_KEY
    if not verify_envelope(envelope, public_key):
        return BAD_SIGNATURE
    return None


@dataclass(frozen=True, slots=True)
class EnvelopeSigner:
    """A private key bound as a ``Envelope → Envelope`` signing function (what producers take)."""

    private_key: Ed25519PrivateKey

    @property
    def key_id(self) -> str:
        return key_id(self.private_key.public_key())

    def __call__(self, envelope: Envelope) -> Envelope:
        return sign_envelope(envelope, self.private_key)

    def sign_dead_letter(self, letter: DeadLetter) -> DeadLetter:
        """``letter`` signed with this key (:func:`sign_dead_letter`): what the coordinator's consumers seal letters with."""
        return sign_dead_letter(letter, self.private_key)


GOVERNANCE_CONTEXT = b"kvledger/governance-state/v1\x00"
"""The context of the command key's signature over a governance state answer
(``coordinator.api.routes.governance``)."""


DEAD_LETTER_CONTEXT = b"kvledger/dead-letter/v1\x00"
"""The context of the coordinator's signature over a dead letter it wrote.

The coordinator signs its dead letters with its command key (the key nodes already pin):
replay republishes a letter's bytes with the coordinator's credentials, so only letters
the coordinator itself wrote may be replayed. The context keeps such a signature from
ever passing as a command's (an envelope's signed bytes have no context) or a governance
state's."""


def sign_dead_letter(letter: DeadLetter, private_key: Ed25519PrivateKey) -> DeadLetter:
    """A copy of ``letter`` carrying ``private_key``'s signature over its content
    (:data:`DEAD_LETTER_CONTEXT`)."""
    signature = sign_document(letter.signed_content(), private_key, DEAD_LETTER_CONTEXT)
    return letter.model_copy(update={"signature": LetterSignature(**signature)})


def dead_letter_signature_problem(letter: DeadLetter, public_key: Ed25519PublicKey) -> str | None:
    """Why ``letter`` is not signed by ``public_key`` (a reason constant: unsigned, by another key,
    tampered); None when it is."""
    signature = None if letter.signature is None else letter.signature.model_dump()
    return document_signature_problem(
        letter.signed_content(), signature, public_key, DEAD_LETTER_CONTEXT
    )


def sign_document(document: dict, private_key: Ed25519PrivateKey, context: bytes) -> dict:
    """``{"kid", "sig"}``: ``private_key``'s signature over ``context`` + the RFC 8785 canonical JSON of ``document``.

    For signed HTTP answers (the coordinator's governance state, ``coordinator.api.routes.governance``).
    ``context`` names what is signed, so a signed document can never pass as a signed envelope
    or as another kind of document signed by the same key.
    """
    signature = private_key.sign(context + canonical_json(document))
    return {"kid": key_id(private_key.public_key()), "sig": _b64url(signature)}


def document_signature_problem(
    document: dict, signature: object, public_key: Ed25519PublicKey, context: bytes
) -> str | None:
    """Why ``signature`` (as received) is not ``public_key``'s :func:`sign_document` signature of
    ``document``; None when it is."""
    if not isinstance(signature, dict) or not isinstance(signature.get("sig"), str):
        return UNSIGNED
    if signature.get("kid") != key_id(public_key):
        return UNKNOWN_KEY
    try:
        public_key.verify(_from_b64url(signature["sig"]), context + canonical_json(document))
    except (InvalidSignature, binascii.Error, ValueError, TypeError):
        return BAD_SIGNATURE
    return None
