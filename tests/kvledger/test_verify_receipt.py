"""Offline verification of served receipts: the library verdicts and ``kvledger verify-receipt``."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import rfc8785
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from coordinator.audit import merkle
from coordinator.audit.receipts import (
    ReceiptSigner,
    TierErasure,
    audit_leaf_hash,
    build_receipt,
    public_key_document,
    serve_receipt,
    sign_receipt,
    sign_tree_head,
)
from coordinator.audit.verifier import verify_served_receipt
from kvledger.cli import main

REPO = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
BASE_CHECKS = [
    "keys",
    "receipt_format",
    "receipt_signature",
    "scope_coverage",
    "tree_head_at_issue_signature",
    "tree_head_signature",
    "inclusion",
    "consistency",
]


def receipt_body(i: int, count: int = 3, blocks_by_scope: dict | None = None) -> dict:
    """Receipts 0..5 of the log are of the format before per-scope coverage (no
    ``blocks_by_scope``)."""
    return build_receipt(
        receipt_id=f"receipt-{i}",
        erasure_id=f"erasure-{i}",
        tenant_id="acme",
        subject_hash=f"{i:064x}",
        requested_at=T0 + timedelta(minutes=i),
        verified_at=T0 + timedelta(minutes=i, seconds=30),
        tiers=[
            TierErasure("node-a", "device", count, "clear", {"i": i}),
            TierErasure("node-a", "disk", 1, "purge-crypto-erase", {"i": i, "key": "destroyed"}),
        ],
        block_hashes=[f"{i:02x}" * 32],
        key_ids_destroyed=[f"{i:02x}" * 16],
        node_keys=[("node-a", "ab" * 16)],
        blocks_by_scope=blocks_by_scope,
    )


class Log:
    """An in-memory audit log: signed receipts as leaves and a signed tree head after each append."""

    def __init__(self, signer: ReceiptSigner) -> None:
        self.signer = signer
        self.entries: list[dict] = []
        self.heads: list[
            dict
        ] = []  # heads[i] = the tree head signed right after entry i was appended

    @property
    def leaves(self) -> list[bytes]:
        return [audit_leaf_hash(entry) for entry in self.entries]

    def head(self, size: int, at: datetime | None = None) -> dict:
        return sign_tree_head(
            size, merkle.root_hash(size, self.leaves), at or T0 + timedelta(hours=size), self.signer
        )

    def append(self, body: dict) -> int:
        self.entries.append(sign_receipt(body, self.signer))
        self.heads.append(self.head(len(self.entries)))
        return len(self.entries) - 1

    def serve(self, index: int, size: int | None = None) -> dict:
        now = self.heads[-1] if size is None else self.heads[size - 1]
        return serve_receipt(self.entries[index], index, self.heads[index], now, self.leaves)


@pytest.fixture(scope="module")
def signer() -> ReceiptSigner:
    return ReceiptSigner.generate(created_at=T0)


@pytest.fixture(scope="module")
def keys(signer) -> dict:
    return public_key_document([signer])


@pytest.fixture
def log(signer) -> Log:
    log = Log(signer)
    for i in range(6):
        log.append(receipt_body(i))
    return log


def failed(result) -> dict[str, str]:
    return {check.name: check.message for check in result.checks if not check.ok}


# --- the good path ---------------------------------------------------------------------------


@pytest.mark.parametrize("index", range(6))
def test_served_receipt_verifies(log, keys, index):
    result = verify_served_receipt(log.serve(index), keys)
    assert result.ok, failed(result)
    assert [c.name for c in result.checks] == BASE_CHECKS
    assert result.warnings and "checkpoint" in result.warnings[0]


def test_verification_names_the_node_keys_the_evidence_is_signed_with(log, keys):
    result = verify_served_receipt(log.serve(1), keys)
    (receipt_format,) = [check for check in result.checks if check.name == "receipt_format"]
    assert receipt_format.ok and receipt_format.message.endswith(
        "evidence signed by node-a (key " + "ab" * 16 + ")"
    )


def test_served_receipt_verifies_against_matching_checkpoint(log, keys):
    result = verify_served_receipt(log.serve(2), keys, checkpoint=log.heads[-1])
    assert result.ok, failed(result)
    assert [c.name for c in result.checks] == [
        *BASE_CHECKS,
        "checkpoint_signature",
        "checkpoint_matches",
    ]
    assert result.warnings == ()


def test_receipt_served_at_an_older_tree_size_verifies(log, keys):
    assert verify_served_receipt(log.serve(1, size=4), keys, checkpoint=log.heads[3]).ok


def test_verification_survives_a_json_round_trip_with_other_formatting(log, keys):
    document = json.loads(json.dumps(log.serve(3), indent=4, sort_keys=False, ensure_ascii=True))
    assert verify_served_receipt(document, keys).ok


def test_verification_by_hand_as_documented(log, keys):
    """docs/receipts.md "Verifying by hand", with only hashlib, base64, rfc8785, cryptography and an
    RFC 9162 verifier."""
    document, checkpoint = json.loads(json.dumps(log.serve(3))), log.heads[-1]
    entry = next(k for k in keys["keys"] if k["key_id"] == document["signature"]["key_id"])
    raw = base64.b64decode(entry["public_key"])
    assert hashlib.sha256(raw).digest()[:16].hex() == entry["key_id"]
    public = Ed25519PublicKey.from_public_bytes(raw)
    public.verify(
        base64.b64decode(document["signature"]["value"]), rfc8785.dumps(document["receipt"])
    )
    audit = document["audit"]
    for head in (audit["tree_head_at_issue"], audit["tree_head"], checkpoint):
        message = rfc8785.dumps(
            {k: head[k] for k in ("tree_size", "root_hash", "timestamp", "key_id")}
        )
        public.verify(base64.b64decode(head["signature"]), message)
    leaf = hashlib.sha256(
        b"\x00"
        + rfc8785.dumps({"receipt": document["receipt"], "signature": document["signature"]})
    ).digest()
    at_issue, head = audit["tree_head_at_issue"], audit["tree_head"]
    assert audit["leaf_index"] < at_issue["tree_size"]
    assert merkle.verify_inclusion(
        leaf,
        audit["leaf_index"],
        head["tree_size"],
        [bytes.fromhex(h) for h in audit["inclusion_proof"]],
        bytes.fromhex(head["root_hash"]),
    )
    assert merkle.verify_consistency(
        at_issue["tree_size"],
        head["tree_size"],
        bytes.fromhex(at_issue["root_hash"]),
        bytes.fromhex(head["root_hash"]),
        [bytes.fromhex(h) for h in audit["consistency_proof"]],
    )
    assert (checkpoint["tree_size"], checkpoint["root_hash"]) == (
        head["tree_size"],
        head["root_hash"],
    )


# --- tampering and forgery ---------------------------------------------------------------------


def test_tampered_receipt_field_fails_signature_and_inclusion(log, keys):
    document = log.serve(2)
    document["receipt"]["tiers"][0]["count"] += 1
    problems = failed(verify_served_receipt(document, keys))
    assert set(problems) == {"receipt_signature", "inclusion"}
    assert "does not verify" in problems["receipt_signature"]


def test_forged_signature_with_another_key_fails(log, keys):
    forger = ReceiptSigner.generate()
    document = log.serve(2)
    document["receipt"]["tiers"][0]["count"] = 0
    forged = sign_receipt(document["receipt"], forger)
    document["signature"] = forged["signature"]
    problems = failed(verify_served_receipt(document, keys))
    assert "not in the key document" in problems["receipt_signature"]
    # Claiming the real key's id does not help: the signature is checked under that key.
    document["signature"]["key_id"] = log.signer.key_id
    assert "does not verify" in failed(verify_served_receipt(document, keys))["receipt_signature"]


def test_tree_head_size_is_bound_by_its_signature(log, keys):
    document = log.serve(1)
    document["audit"]["tree_head"]["tree_size"] += 1
    problems = failed(verify_served_receipt(document, keys))
    assert "tree_head_signature" in problems


def test_other_signed_object_cannot_pose_as_a_receipt(log, keys):
    head = log.heads[0]
    document = log.serve(0)
    document["receipt"] = {k: head[k] for k in ("tree_size", "root_hash", "timestamp", "key_id")}
    document["signature"] = {
        "key_id": head["key_id"],
        "algorithm": "Ed25519",
        "value": head["signature"],
    }
    problems = failed(verify_served_receipt(document, keys))
    assert "receipt_format" in problems and "receipt_signature" in problems


def test_key_document_with_a_mislabelled_key_fails(log, keys):
    document = copy.deepcopy(keys)
    document["keys"][0]["key_id"] = "00" * 16
    problems = failed(verify_served_receipt(log.serve(0), document))
    assert "not derived from its public key" in problems["keys"]
    assert "receipt_signature" in problems


# --- a rewritten log against an old checkpoint --------------------------------------------------


def rewrite(log: Log, index: int) -> Log:
    """The operator edits entry ``index`` after the fact, re-signs it and every tree head from there
    on."""
    rewritten = Log(log.signer)
    rewritten.entries = list(log.entries)
    rewritten.entries[index] = sign_receipt(receipt_body(index, count=99), log.signer)
    rewritten.heads = list(log.heads[:index]) + [
        rewritten.head(size) for size in range(index + 1, len(log.entries) + 1)
    ]
    return rewritten


def test_rewritten_entry_fails_against_the_old_checkpoint(log, keys):
    checkpoint = log.heads[4]  # an auditor kept the head of size 5
    evil = rewrite(log, 2)
    evil.append(receipt_body(6))

    # The rewritten receipt alone looks fine: every signature is genuine.
    assert verify_served_receipt(evil.serve(2), keys).ok

    # Against the checkpoint: first the size differs, and the verifier says how to ask for the right
    # one...
    problems = failed(verify_served_receipt(evil.serve(2), keys, checkpoint=checkpoint))
    assert set(problems) == {"checkpoint_matches"}
    assert "?tree_size=5" in problems["checkpoint_matches"]
    # ...then, served at that size, the same size has a different root.
    problems = failed(verify_served_receipt(evil.serve(2, size=5), keys, checkpoint=checkpoint))
    assert set(problems) == {"checkpoint_matches"}
    assert "different roots" in problems["checkpoint_matches"]


def test_rewritten_earlier_entry_breaks_consistency_for_later_receipts(log, keys):
    evil = rewrite(log, 2)
    # Receipt 4 was issued under the original head of size 5 (kept in its row); the log now differs
    # below it.
    document = serve_receipt(evil.entries[4], 4, log.heads[4], evil.heads[-1], evil.leaves)
    problems = failed(verify_served_receipt(document, keys))
    assert set(problems) == {"consistency"}
    assert "does not extend" in problems["consistency"]


def test_original_receipt_is_no_longer_included_in_the_rewritten_log(log, keys):
    original = log.serve(2)
    evil = rewrite(log, 2)
    document = copy.deepcopy(evil.serve(2))
    document["receipt"], document["signature"] = original["receipt"], original["signature"]
    document["audit"]["tree_head_at_issue"] = original["audit"]["tree_head_at_issue"]
    problems = failed(verify_served_receipt(document, keys))
    assert {"inclusion", "consistency"} <= set(problems)


# --- checkpoints of another size or signer -------------------------------------------------------


def test_checkpoint_of_a_different_size_says_to_refetch(log, keys):
    problems = failed(verify_served_receipt(log.serve(1), keys, checkpoint=log.heads[3]))
    assert set(problems) == {"checkpoint_matches"}
    assert "checkpoint is for tree size 4" in problems["checkpoint_matches"]
    assert "GET /v1/erasures/erasure-1/receipt?tree_size=4" in problems["checkpoint_matches"]


def test_checkpoint_older_than_the_receipt_says_to_fetch_a_newer_one(log, keys):
    problems = failed(verify_served_receipt(log.serve(4), keys, checkpoint=log.heads[1]))
    assert "newer checkpoint" in problems["checkpoint_matches"]


def test_checkpoint_signed_by_an_unknown_key_fails(log, keys):
    other = ReceiptSigner.generate()
    checkpoint = sign_tree_head(6, merkle.root_hash(6, log.leaves), T0, other)
    problems = failed(verify_served_receipt(log.serve(1), keys, checkpoint=checkpoint))
    assert "not in the key document" in problems["checkpoint_signature"]


# --- garbage in: failed checks, never exceptions
# ---------------------------------------------------


def garbage(log: Log) -> list:
    good = log.serve(1)
    variants: list = [None, [], "receipt", 3, {}, {"receipt": 1, "signature": 2, "audit": 3}]
    mutations = [
        ("audit", "leaf_index", -1),
        ("audit", "leaf_index", "1"),
        ("audit", "leaf_index", 2**70),
        ("audit", "inclusion_proof", ["zz" * 32]),
        ("audit", "inclusion_proof", "not a list"),
        ("audit", "consistency_proof", [None]),
        ("audit", "tree_head", {"tree_size": 1}),
        ("audit", "tree_head_at_issue", None),
        ("signature", "value", "é not base64"),
        ("signature", "value", "AAAA"),
        ("signature", "key_id", ["unhashable"]),
        ("receipt", "tiers", float("nan")),
        ("receipt", "extra", "unsigned"),
        ("audit", "extra", "unproved"),
    ]
    for part, key, value in mutations:
        document = copy.deepcopy(good)
        document[part][key] = value
        variants.append(document)
    huge = copy.deepcopy(good)
    huge["audit"]["tree_head"]["tree_size"] = 2**70
    variants.append(huge)
    return variants


def test_malformed_documents_fail_without_raising(log, keys):
    for document in garbage(log):
        for keys_document in (
            keys,
            None,
            {"keys": [1, {"algorithm": "RSA"}, {"algorithm": "Ed25519", "public_key": "!"}]},
        ):
            for checkpoint in (None, {"tree_size": "x"}, []):
                result = verify_served_receipt(document, keys_document, checkpoint)
                assert not result.ok
                assert all(check.message for check in result.checks)


# --- the command line ---------------------------------------------------------------------------


def write(tmp_path: Path, name: str, value) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(value, indent=2), encoding="utf-8")
    return str(path)


def test_cli_subprocess_verifies_and_rejects(log, keys, tmp_path):
    receipt = write(tmp_path, "receipt.json", log.serve(2))
    keys_file = write(tmp_path, "keys.json", keys)
    checkpoint = write(tmp_path, "checkpoint.json", log.heads[-1])
    command = [
        sys.executable,
        "-m",
        "kvledger.cli",
        "verify-receipt",
        receipt,
        "--checkpoint",
        checkpoint,
        "--public-key",
        keys_file,
    ]
    run = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, encoding="utf-8", timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "✓ inclusion:" in run.stdout and "✓ checkpoint_matches:" in run.stdout
    assert run.stdout.strip().endswith("receipt verified")

    tampered = log.serve(2)
    tampered["receipt"]["tenant_id"] = "other"
    write(tmp_path, "receipt.json", tampered)
    run = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, encoding="utf-8", timeout=120
    )
    assert run.returncode == 1
    assert "✗ receipt_signature:" in run.stdout


# --- per-scope coverage ------------------------------------------------------------------------

COVERAGE = {"public": 0, "tenant": 1, "user": 0, "unrecorded": 0}


def test_a_receipt_without_per_scope_coverage_still_verifies_and_says_so(log, keys):
    result = verify_served_receipt(log.serve(0), keys)
    (coverage,) = [check for check in result.checks if check.name == "scope_coverage"]
    assert result.ok and coverage.message.startswith("not stated")


def test_per_scope_coverage_is_signed_checked_and_printed(log, keys, tmp_path):
    index = log.append(receipt_body(6, blocks_by_scope=COVERAGE))
    result = verify_served_receipt(log.serve(index), keys, checkpoint=log.heads[-1])
    assert result.ok, failed(result)
    (coverage,) = [check for check in result.checks if check.name == "scope_coverage"]
    assert coverage.message == "erased blocks by scope: public 0, tenant 1, user 0, unrecorded 0"
    receipt = write(tmp_path, "receipt.json", log.serve(index))
    keys_file = write(tmp_path, "keys.json", keys)
    command = [
        sys.executable,
        "-m",
        "kvledger.cli",
        "verify-receipt",
        receipt,
        "--public-key",
        keys_file,
    ]
    run = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, encoding="utf-8", timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert (
        "✓ scope_coverage: erased blocks by scope: public 0, tenant 1, user 0, unrecorded 0"
        in run.stdout
    )

    # Altered after signing: the signature fails.
    tampered = log.serve(index)
    tampered["receipt"]["blocks_by_scope"]["user"] = 0
    tampered["receipt"]["blocks_by_scope"]["public"] = 1
    assert "receipt_signature" in failed(verify_served_receipt(tampered, keys))


@pytest.mark.parametrize(
    "coverage, message",
    [
        ({**COVERAGE, "tenant": 2}, "adds up to 2"),
        ({"public": 0, "tenant": 1, "user": 0}, "lacks unrecorded"),
        ({**COVERAGE, "shared": 0}, "nothing signs or proves: shared"),
        ({**COVERAGE, "tenant": "1"}, "not a non-negative integer"),
        ([1], "not a JSON object"),
    ],
)
def test_signed_but_inconsistent_coverage_fails_its_check(log, keys, coverage, message):
    body = receipt_body(6, blocks_by_scope=COVERAGE)
    body["blocks_by_scope"] = coverage  # signed as is: only the coverage check can catch it
    index = log.append(body)
    problems = failed(verify_served_receipt(log.serve(index), keys))
    assert list(problems) == ["scope_coverage"] and message in problems["scope_coverage"]


def test_cli_without_public_key_cannot_verify(log, tmp_path, capsys):
    receipt = write(tmp_path, "receipt.json", log.serve(0))
    assert main(["verify-receipt", receipt]) == 2
    assert "--public-key" in capsys.readouterr().err


@pytest.mark.parametrize(
    "content",
    ['{"receipt": 1, "receipt": 2}', "{not json", '{"x": NaN}', ""],
)
def test_cli_unreadable_documents_exit_2(keys, tmp_path, capsys, content):
    receipt = tmp_path / "receipt.json"
    receipt.write_text(content, encoding="utf-8")
    assert (
        main(["verify-receipt", str(receipt), "--public-key", write(tmp_path, "keys.json", keys)])
        == 2
    )
    assert "cannot verify" in capsys.readouterr().err


def test_cli_missing_file_exits_2(keys, tmp_path, capsys):
    assert (
        main(
            [
                "verify-receipt",
                str(tmp_path / "absent.json"),
                "--public-key",
                write(tmp_path, "keys.json", keys),
            ]
        )
        == 2
    )


def test_cli_reports_checkpoint_size_mismatch(log, keys, tmp_path, capsys):
    receipt = write(tmp_path, "receipt.json", log.serve(1))
    code = main(
        [
            "verify-receipt",
            receipt,
            "--checkpoint",
            write(tmp_path, "checkpoint.json", log.heads[2]),
            "--public-key",
            write(tmp_path, "keys.json", keys),
        ]
    )
    out = capsys.readouterr().out
    assert code == 1
    assert "✗ checkpoint_matches:" in out and "?tree_size=3" in out
    assert out.strip().endswith("receipt NOT verified")


def test_cli_json_reports_every_check(log, keys, tmp_path, capsys):
    receipt = write(tmp_path, "receipt.json", log.serve(2))
    keys_file = write(tmp_path, "keys.json", keys)
    checkpoint = write(tmp_path, "checkpoint.json", log.heads[-1])
    assert (
        main(
            [
                "verify-receipt",
                receipt,
                "--checkpoint",
                checkpoint,
                "--public-key",
                keys_file,
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True
    assert {"inclusion", "checkpoint_matches", "receipt_signature"} <= {
        check["name"] for check in report["checks"]
    }
    assert all(check["ok"] for check in report["checks"])

    tampered = log.serve(2)
    tampered["receipt"]["tenant_id"] = "other"
    write(tmp_path, "receipt.json", tampered)
    assert (
        main(
            [
                "verify-receipt",
                receipt,
                "--checkpoint",
                checkpoint,
                "--public-key",
                keys_file,
                "--json",
            ]
        )
        == 1
    )
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert [check["name"] for check in report["checks"] if not check["ok"]][
        0
    ] == "receipt_signature"
