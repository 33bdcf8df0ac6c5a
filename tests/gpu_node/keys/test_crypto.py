"""AES-256-GCM sealing and the local data-key store."""

from __future__ import annotations

import json
import os
import stat

import pytest

from events.schema import subject_digest
from gpu_node.keys.crypto import LocalKeyStore, overwrite_and_unlink, seal, unseal
from identity.sealing import KEY_BYTES, KEY_ID_HEX_CHARS, NONCE_BYTES, TAG_BYTES
from prefix_keys.blocks import CacheProvenance, CacheScope

KEY = bytes(range(32))
BLOCK_HASH = b"\x11" * 32
KEY_ID = "ab" * 16


def provenance(
    scope: CacheScope, tenant: str | None = "acme", subject: str | None = "alice", auth: tuple = ()
) -> CacheProvenance:
    return CacheProvenance(
        namespace="ns-test",
        tenant_id=None if scope == CacheScope.PUBLIC else tenant,
        scope=scope,
        auth_scopes=auth,
        subject_id=subject if scope == CacheScope.USER else None,
        documents=(),
        created_at=0.0,
    )


def test_seal_round_trip_and_layout():
    sealed = seal(KEY, KEY_ID, BLOCK_HASH, b"kv bytes")
    assert len(sealed) == NONCE_BYTES + len(b"kv bytes") + TAG_BYTES
    assert unseal(KEY, KEY_ID, BLOCK_HASH, sealed) == b"kv bytes"


def test_a_header_goes_before_the_nonce_and_is_not_sealed():
    sealed = seal(KEY, KEY_ID, BLOCK_HASH, b"kv bytes", header=b"HEAD")
    assert sealed[:4] == b"HEAD"
    assert len(sealed) == 4 + NONCE_BYTES + len(b"kv bytes") + TAG_BYTES
    assert unseal(KEY, KEY_ID, BLOCK_HASH, sealed[4:]) == b"kv bytes"


def test_each_seal_uses_a_fresh_nonce():
    first, second = seal(KEY, KEY_ID, BLOCK_HASH, b"same"), seal(KEY, KEY_ID, BLOCK_HASH, b"same")
    assert first[:NONCE_BYTES] != second[:NONCE_BYTES]
    assert first != second


@pytest.mark.parametrize(
    "key, key_id, block_hash",
    [
        (bytes(32), KEY_ID, BLOCK_HASH),  # wrong key
        (KEY, "cd" * 16, BLOCK_HASH),  # AAD: another key id
        (KEY, KEY_ID, b"\x22" * 32),  # AAD: another block
    ],
)
def test_unseal_refuses_any_other_key_or_binding(key, key_id, block_hash):
    sealed = seal(KEY, KEY_ID, BLOCK_HASH, b"kv bytes")
    assert unseal(key, key_id, block_hash, sealed) is None


def test_unseal_refuses_tampered_or_truncated_ciphertext():
    sealed = bytearray(seal(KEY, KEY_ID, BLOCK_HASH, b"kv bytes"))
    sealed[NONCE_BYTES] ^= 0x01
    assert unseal(KEY, KEY_ID, BLOCK_HASH, bytes(sealed)) is None
    assert unseal(KEY, KEY_ID, BLOCK_HASH, b"\x00" * (NONCE_BYTES + TAG_BYTES - 1)) is None


def test_keys_must_be_256_bit():
    with pytest.raises(ValueError):
        seal(b"short", KEY_ID, BLOCK_HASH, b"x")
    with pytest.raises(ValueError):
        unseal(b"short", KEY_ID, BLOCK_HASH, b"x" * 40)


def test_public_scope_has_no_key(tmp_path):
    store = LocalKeyStore(tmp_path / "keys.json")
    assert store.key_for(provenance(CacheScope.PUBLIC)) is None


def test_one_key_per_tenant_and_one_per_subject(tmp_path):
    store = LocalKeyStore(tmp_path / "keys.json")
    tenant_a = store.key_for(provenance(CacheScope.TENANT, auth=(("hr", 1),)))
    tenant_b = store.key_for(provenance(CacheScope.TENANT, auth=(("legal", 4),)))
    other_tenant = store.key_for(provenance(CacheScope.TENANT, tenant="globex"))
    alice = store.key_for(provenance(CacheScope.USER, subject="alice"))
    bob = store.key_for(provenance(CacheScope.USER, subject="bob"))
    assert tenant_a == tenant_b
    assert len({tenant_a[0], other_tenant[0], alice[0], bob[0]}) == 4
    for key_id, key in (tenant_a, other_tenant, alice, bob):
        assert len(key) == KEY_BYTES
        assert len(key_id) == KEY_ID_HEX_CHARS and int(key_id, 16) >= 0
        assert store.key_by_id(key_id) == key
    assert store.current_key_id("acme") == tenant_a[0]
    assert store.current_key_id("acme", "alice") == alice[0]
    assert store.current_key_id("acme", "carol") is None


def test_key_file_is_private_and_names_nobody(tmp_path):
    path = tmp_path / "node" / "keys.json"
    store = LocalKeyStore(path)
    store.key_for(provenance(CacheScope.USER, tenant="acme-corp", subject="alice@example.com"))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    text = path.read_text()
    assert "acme-corp" not in text and "alice@example.com" not in text


def test_keys_survive_a_restart(tmp_path):
    path = tmp_path / "keys.json"
    key_id, key = LocalKeyStore(path).key_for(provenance(CacheScope.USER))
    reopened = LocalKeyStore(path)
    assert reopened.key_for(provenance(CacheScope.USER)) == (key_id, key)
    assert reopened.key_by_id(key_id) == key


def test_destroy_erases_the_key_from_memory_and_file(tmp_path):
    path = tmp_path / "keys.json"
    store = LocalKeyStore(path)
    key_id, key = store.key_for(provenance(CacheScope.USER))
    kept_id, kept = store.key_for(provenance(CacheScope.USER, subject="bob"))

    assert store.destroy(key_id) is True
    assert store.key_by_id(key_id) is None
    assert store.current_key_id("acme", "alice") is None
    assert key.hex() not in path.read_text()
    assert LocalKeyStore(path).key_by_id(key_id) is None
    assert LocalKeyStore(path).key_by_id(kept_id) == kept
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert store.destroy(key_id) is False
    assert store.destroy("00" * 16) is False


def test_a_destroyed_scope_gets_a_new_key_id(tmp_path):
    path = tmp_path / "keys.json"
    store = LocalKeyStore(path)
    old_id, old_key = store.key_for(provenance(CacheScope.USER))
    store.destroy(old_id)
    new_id, new_key = store.key_for(provenance(CacheScope.USER))
    assert new_id != old_id and new_key != old_key
    assert store.key_by_id(old_id) is None
    # The bumped generation is persisted: a restarted store does not resurrect the old id.
    assert LocalKeyStore(path).key_for(provenance(CacheScope.USER)) == (new_id, new_key)
    assert sorted(json.loads(path.read_text())["keys"]) == [new_id]


def test_overwrite_and_unlink(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(b"secret" * 100)
    assert overwrite_and_unlink(path) is True
    assert not path.exists()
    assert overwrite_and_unlink(path) is True


def test_subject_keys_are_found_by_keyed_digest_only_with_the_subject_key(tmp_path):
    subject_key = b"crypto-test-subject-key-0123456"
    digest = subject_digest(subject_key, "acme", "alice")
    store = LocalKeyStore(tmp_path / "keys.json", subject_key)
    key_id, _ = store.key_for(provenance(CacheScope.USER))
    store.key_for(provenance(CacheScope.TENANT))
    assert store.subject_key_ids("acme", digest) == [key_id]
    assert store.subject_key_ids("globex", digest) == []
    assert (
        "alice" not in (tmp_path / "keys.json").read_text()
        and digest not in (tmp_path / "keys.json").read_text()
    )
    reopened = LocalKeyStore(tmp_path / "keys.json", subject_key)
    assert reopened.subject_key_ids("acme", digest) == [key_id]
    assert reopened.destroy(key_id)
    assert reopened.subject_key_ids("acme", digest) == []
    assert LocalKeyStore(tmp_path / "plain.json").key_for(provenance(CacheScope.USER)) is not None
    assert LocalKeyStore(tmp_path / "plain.json").subject_key_ids("acme", digest) == []
    with pytest.raises(ValueError):
        LocalKeyStore(tmp_path / "short.json", b"short")
