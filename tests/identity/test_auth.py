"""Bearer-token verification: the principal it yields is what salts cache keys, so every malformed
token must fail.

JWKS verification over real HTTP, key rotation and the end-user/operator split are in
tests/security/test_end_user_tokens.py."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from identity.settings import IssuerSettings
from identity.tokens import JWT_SECRET_ENV, MAX_VERSION, AuthError, TokenVerifier, issue_token
from kvledger import tokens

SECRET = "unit-test-secret-0123456789abcdef0123"
OTHER_SECRET = "another-secret-0123456789abcdef01234567"


@pytest.fixture(scope="module")
def ed25519_pem(tmp_path_factory) -> tuple[bytes, object]:
    """(private PEM, path of the public PEM file)."""
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_path = tmp_path_factory.mktemp("keys") / "jwt.pub.pem"
    public_path.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private_pem, public_path


@pytest.fixture()
def hs_verifier() -> TokenVerifier:
    return TokenVerifier(IssuerSettings(jwt_secret=SECRET))


def raw(claims: dict, secret: str = SECRET) -> str:
    return jwt.encode(claims, secret.encode(), algorithm="HS256")


def base_claims(**overrides) -> dict:
    claims = {
        "sub": "alice",
        "tenant": "acme",
        "scopes": ["hr"],
        "pv": 3,
        "exp": int(time.time()) + 600,
    }
    claims.update(overrides)
    return claims


def test_hs256_round_trip(hs_verifier):
    token = issue_token(tenant="acme", sub="alice", scopes=["hr", "eng"], pv=7, secret=SECRET)
    principal = hs_verifier.verify(token)
    assert principal.tenant_id == "acme"
    assert principal.subject_id == "alice"
    assert principal.scopes == frozenset({"hr", "eng"})
    assert principal.policy_version("hr") == 7


def test_end_user_principal_has_no_roles(hs_verifier):
    """Roles claimed by an end user's token are not part of the principal at all."""
    token = issue_token(tenant="acme", sub="alice", roles=["platform-admin", "node"], secret=SECRET)
    principal = hs_verifier.verify(token)
    assert not hasattr(principal, "roles")
    assert hs_verifier.verify_operator(token).roles == frozenset({"platform-admin", "node"})


def test_eddsa_round_trip(ed25519_pem):
    private_pem, public_path = ed25519_pem
    verifier = TokenVerifier(IssuerSettings(jwt_public_key_file=public_path))
    principal = verifier.verify(
        issue_token(tenant="acme", sub="bob", scopes=["eng"], private_key_pem=private_pem)
    )
    assert (principal.tenant_id, principal.subject_id, principal.scopes) == (
        "acme",
        "bob",
        frozenset({"eng"}),
    )


def test_eddsa_verifier_rejects_other_key_and_hs256(ed25519_pem):
    _, public_path = ed25519_pem
    verifier = TokenVerifier(IssuerSettings(jwt_public_key_file=public_path))
    other = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    with pytest.raises(AuthError) as wrong_key:
        verifier.verify(issue_token(tenant="acme", sub="bob", private_key_pem=other))
    assert wrong_key.value.code == "invalid_token"
    # An HS256 token must not be accepted by an EdDSA node (no algorithm confusion).
    with pytest.raises(AuthError) as wrong_alg:
        verifier.verify(issue_token(tenant="acme", sub="bob", secret=SECRET))
    assert wrong_alg.value.code == "invalid_token"


def test_hs256_verifier_rejects_eddsa_token(hs_verifier, ed25519_pem):
    private_pem, _ = ed25519_pem
    with pytest.raises(AuthError) as excinfo:
        hs_verifier.verify(issue_token(tenant="acme", sub="bob", private_key_pem=private_pem))
    assert excinfo.value.code == "invalid_token"


def test_wrong_secret(hs_verifier):
    with pytest.raises(AuthError) as excinfo:
        hs_verifier.verify(issue_token(tenant="acme", sub="alice", secret=OTHER_SECRET))
    assert excinfo.value.code == "invalid_token"
    assert isinstance(excinfo.value, ValueError)


def test_expired_beyond_leeway(hs_verifier):
    token = issue_token(tenant="acme", sub="alice", ttl_s=60, secret=SECRET, now=time.time() - 120)
    with pytest.raises(AuthError) as excinfo:
        hs_verifier.verify(token)
    assert excinfo.value.code == "token_expired"


def test_expiry_within_leeway_is_accepted():
    verifier = TokenVerifier(IssuerSettings(jwt_secret=SECRET, leeway_s=30))
    token = raw(base_claims(exp=int(time.time()) - 10))
    assert verifier.verify(token).subject_id == "alice"


@pytest.mark.parametrize("claim", ["exp", "sub", "tenant"])
def test_missing_required_claim(hs_verifier, claim):
    claims = base_claims()
    del claims[claim]
    with pytest.raises(AuthError) as excinfo:
        hs_verifier.verify(raw(claims))
    assert excinfo.value.code == "invalid_token"
    assert claim in excinfo.value.message


@pytest.mark.parametrize(
    "overrides",
    [
        {"tenant": ""},
        {"tenant": 5},
        {"tenant": "a" * 257},
        {"tenant": "acme\n"},
        {"tenant": "ac\x00me"},
        {"sub": ""},
        {"sub": "alice\x7f"},
        {"sub": "alice\x85"},
        {"sub": "  "},
        {"tenant": " "},
        {"scopes": [" "]},
        {"scopes": "hr"},
        {"scopes": ["hr", 3]},
        {"scopes": ["h" * 257]},
        {"scopes": ["hr\tx"]},
        {"scopes": ["s"] * 257},
        {"pv": "3"},
        {"pv": True},
        {"pv": -1},
        {"pv": MAX_VERSION + 1},
        {"pv": {"hr": "2"}},
        {"pv": {"hr": MAX_VERSION + 1}},
        {"pv": {"hr\n": 1}},
        {"pv": [1]},
    ],
)
def test_malformed_claims_are_refused(hs_verifier, overrides):
    with pytest.raises(AuthError) as excinfo:
        hs_verifier.verify(raw(base_claims(**overrides)))
    assert excinfo.value.code == "invalid_token"


def test_claims_at_their_bounds_are_accepted(hs_verifier):
    principal = hs_verifier.verify(
        raw(base_claims(tenant="t" * 256, sub="ü" * 256, scopes=["s"] * 256, pv=MAX_VERSION))
    )
    assert (
        len(principal.tenant_id),
        len(principal.subject_id),
        principal.default_policy_version,
    ) == (256, 256, MAX_VERSION)


@pytest.mark.parametrize(
    "overrides",
    [{"roles": "admin"}, {"role": ["admin"]}, {"roles": ["x" * 257]}, {"roles": ["a\nb"]}],
)
def test_malformed_operator_roles_are_refused(hs_verifier, overrides):
    with pytest.raises(AuthError) as excinfo:
        hs_verifier.verify_operator(raw(base_claims(**overrides)))
    assert excinfo.value.code == "invalid_token"


def test_pv_map_and_single_role(hs_verifier):
    token = raw(base_claims(pv={"hr": 4, "eng": 9}, role="auditor"))
    principal = hs_verifier.verify(token)
    assert principal.policy_version("hr") == 4
    assert principal.policy_version("eng") == 9
    assert principal.policy_version("legal") == 0
    assert hs_verifier.verify_operator(token).roles == frozenset({"auditor"})


def test_optional_claims_default(hs_verifier):
    token = raw({"sub": "u", "tenant": "t", "exp": int(time.time()) + 60})
    principal = hs_verifier.verify(token)
    assert principal.scopes == frozenset()
    assert principal.policy_version("anything") == 0
    assert hs_verifier.verify_operator(token).roles == frozenset()


def test_missing_and_garbage_tokens(hs_verifier):
    for bearer in (None, ""):
        with pytest.raises(AuthError) as excinfo:
            hs_verifier.verify(bearer)
        assert excinfo.value.code == "missing_token"
    with pytest.raises(AuthError) as excinfo:
        hs_verifier.verify("not.a.jwt")
    assert excinfo.value.code == "invalid_token"


def test_audience_is_enforced_when_configured():
    verifier = TokenVerifier(IssuerSettings(jwt_secret=SECRET, audience="kvledger-node"))
    good = issue_token(tenant="t", sub="u", secret=SECRET, audience="kvledger-node")
    assert verifier.verify(good).subject_id == "u"
    with pytest.raises(AuthError):
        verifier.verify(issue_token(tenant="t", sub="u", secret=SECRET, audience="someone-else"))
    with pytest.raises(AuthError):
        verifier.verify(issue_token(tenant="t", sub="u", secret=SECRET))


def test_secret_from_environment(monkeypatch):
    monkeypatch.setenv(JWT_SECRET_ENV, SECRET)
    verifier = TokenVerifier(IssuerSettings())
    assert verifier.verify(issue_token(tenant="t", sub="u", secret=SECRET)).tenant_id == "t"


def test_configuration_errors(monkeypatch, ed25519_pem):
    monkeypatch.delenv(JWT_SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match="no JWT key configured"):
        TokenVerifier(IssuerSettings())
    with pytest.raises(ValueError, match="at least 32 bytes"):
        TokenVerifier(IssuerSettings(jwt_secret="short"))
    with pytest.raises(ValueError, match="one key source per issuer"):
        TokenVerifier(IssuerSettings(jwt_secret=SECRET, jwt_public_key_file=ed25519_pem[1]))
    with pytest.raises(
        ValueError,
        match="no JWT key configured: set jwt_secret, jwt_public_key_file, jwks_file or jwks_url$",
    ):
        TokenVerifier(IssuerSettings(), secret_env=None)
    with pytest.raises(ValueError, match="exactly one"):
        issue_token(tenant="t", sub="u")


def _token_args(**overrides) -> argparse.Namespace:
    values = {
        "tenant": "acme",
        "sub": "alice",
        "scopes": "hr, eng",
        "pv": 2,
        "role": [],
        "ttl_s": 60,
    }
    values["private_key"] = None
    values["stack"] = None
    values.update(overrides)
    return argparse.Namespace(**values)


@pytest.fixture()
def no_stack(monkeypatch, tmp_path):
    """Run the CLI where there is no ``.kvledger/stack.json`` and no end-user secret in the
    environment."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(JWT_SECRET_ENV, raising=False)


def test_token_cli_hs256(no_stack, monkeypatch, capsys):
    monkeypatch.setenv(JWT_SECRET_ENV, SECRET)
    assert tokens.cli(_token_args()) == 0
    principal = TokenVerifier(IssuerSettings(jwt_secret=SECRET)).verify(
        capsys.readouterr().out.strip()
    )
    assert principal.scopes == frozenset({"hr", "eng"})
    assert principal.policy_version("hr") == 2


def test_token_cli_private_key(no_stack, capsys, ed25519_pem, tmp_path):
    private_pem, public_path = ed25519_pem
    key_file = tmp_path / "jwt.pem"
    key_file.write_bytes(private_pem)
    assert tokens.cli(_token_args(private_key=str(key_file))) == 0
    principal = TokenVerifier(IssuerSettings(jwt_public_key_file=public_path)).verify(
        capsys.readouterr().out.strip()
    )
    assert principal.subject_id == "alice"


def test_token_cli_without_key_fails_clearly(no_stack, capsys):
    assert tokens.cli(_token_args()) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"kvledger token: error: set {JWT_SECRET_ENV}, run `kvledger up` here, or pass --stack or --private-key\n"
    )


def _stack_dir(tmp_path, ed25519_pem) -> str:
    private_pem, _ = ed25519_pem
    key_file = tmp_path / "operator_key.pem"
    key_file.write_bytes(private_pem)
    (tmp_path / "stack.json").write_text(
        json.dumps({"jwt_secret": SECRET, "operator_private_key_file": str(key_file)})
    )
    return str(tmp_path)


def test_token_cli_signs_operator_roles_with_the_stack_operator_key(
    no_stack, capsys, ed25519_pem, tmp_path
):
    stack = _stack_dir(tmp_path, ed25519_pem)
    assert tokens.cli(_token_args(role=["privacy-officer"], stack=stack)) == 0
    token = capsys.readouterr().out.strip()
    operator = TokenVerifier(IssuerSettings(jwt_public_key_file=ed25519_pem[1])).verify_operator(
        token
    )
    assert (operator.tenant_id, operator.subject_id, operator.roles) == (
        "acme",
        "alice",
        frozenset({"privacy-officer"}),
    )
    # The end users' secret does not verify it: the two issuers are distinct.
    with pytest.raises(AuthError):
        TokenVerifier(IssuerSettings(jwt_secret=SECRET)).verify(token)
    # Without a role the same stack gives an end-user token under its jwt_secret.
    assert tokens.cli(_token_args(stack=stack)) == 0
    assert (
        TokenVerifier(IssuerSettings(jwt_secret=SECRET))
        .verify(capsys.readouterr().out.strip())
        .tenant_id
        == "acme"
    )


@pytest.mark.parametrize("roles", [["node"], ["admin"], ["platform-admin", "node"]])
def test_token_cli_refuses_roles_that_are_not_operator_roles(
    no_stack, capsys, ed25519_pem, tmp_path, roles
):
    stack = _stack_dir(tmp_path, ed25519_pem)
    assert tokens.cli(_token_args(role=roles, stack=stack)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    refused = ", ".join(sorted(set(roles) - {"platform-admin"}))
    assert captured.err == (
        f"kvledger token: error: role {refused} is not an operator role "
        "(auditor, platform-admin, privacy-officer, router, tenant-admin); "
        "no command mints node credentials from a user or operator key\n"
    )


def test_token_cli_operator_role_without_operator_key(no_stack, monkeypatch, capsys):
    monkeypatch.setenv(JWT_SECRET_ENV, SECRET)
    assert tokens.cli(_token_args(role=["platform-admin"])) == 2
    assert capsys.readouterr().err == (
        "kvledger token: error: no operator key: run `kvledger up` in this directory or pass --stack\n"
    )


def test_identity_imports_neither_side():
    """identity/ is shared by nodes, coordinator and CLI, so it must not pull any of them in (the wire
    contract in events/ is below it and allowed; pyproject's import-linter layers say the same)."""
    probe = (
        "import sys, identity.tokens, identity.settings, identity.roles; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'gpu_node', 'coordinator', 'kvledger'}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]"
