"""End users' tokens never act as operators or nodes; JWKS verification of the customer's IdP.

* Every coordinator route (taken from the app itself, so a new route is covered the day it
  is added) refuses tokens signed with the end users' secret, whatever roles they claim;
  only the documented open routes answer without a token. The node's snapshot endpoint
  refuses them too.
* JWKS from a file and over real HTTP: EdDSA, ES256 and RS256 keys verify by ``kid``; an
  unknown ``kid`` makes one (rate-limited) refetch and then 401; ``alg`` outside the
  allow-list, ``none``, an ``alg`` that does not match the key, wrong ``iss``/``aud`` → 401;
  a rotated-in key verifies once the JWKS changes.
* A configuration where the operator issuer shares the end users' key is refused.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from helpers.ledger import (
    JWT_SECRET,
    OPERATOR_AUTH,
    OPERATOR_PUBLIC_KEY_FILE,
    coordinator_settings,
    fresh_database,
    operator_headers,
)
from pydantic import ValidationError
from starlette.routing import Route

from coordinator.api.app import create_app as create_coordinator_app
from coordinator.settings import CoordinatorSettings
from gpu_node.engine.async_engine import AsyncEngine
from gpu_node.entrypoints.routes import create_app as create_node_app
from gpu_node.settings import NodeSettings
from identity.settings import IssuerSettings
from identity.tokens import JWT_SECRET_ENV, AuthError, TokenVerifier, issue_token

OPEN_ROUTES = {
    ("GET", "/openapi.json"),  # the API's description: routes and shapes, no data
    ("GET", "/docs"),
    ("GET", "/docs/oauth2-redirect"),
    ("GET", "/redoc"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
    ("GET", "/v1/receipts/keys"),
    ("GET", "/v1/audit/checkpoint"),
}
DATA_KEY_ROUTES = {
    ("POST", "/v1/keys/resolve"),
    ("GET", "/v1/keys/{key_id}"),
    ("GET", "/v1/governance"),
    ("GET", "/v1/nodes/peer-keys/{key_id}"),
}
"""The nodes' endpoints (data keys, governance state, a peer's key): they take only node credentials
(tests/security/test_node_enrollment.py, tests/gpu_node/governance/test_governance_sync.py,
tests/gpu_node/cache/test_replicas.py), so operators are
refused there too; end users get the same 401 as everywhere else."""
CONSOLE_PREFIX = "/ui"
CONSOLE_OPEN_ROUTES = {("GET", "/ui/login"), ("GET", "/ui/static/console.css")}
"""The console answers in HTML, not the API's JSON error shape: it is checked on its own below."""
CLAIMED_ROLES = (
    ["admin"],
    ["platform-admin"],
    ["tenant-admin"],
    ["privacy-officer"],
    ["auditor"],
    ["node"],
    ["platform-admin", "node"],
)
PATH_VALUES = {
    "erasure_id": str(uuid.uuid4()),
    "receipt_id": str(uuid.uuid4()),
    "command_id": str(uuid.uuid4()),
    "namespace": "ns-x",
    "key_id": "0" * 32,
    "dead_letter_id": "0-0",
}
BODIES = {
    "/v1/erasures": {"tenant_id": "acme", "subject_id": "alice", "reason": "r"},
    "/v1/keys/resolve": {"tenant_id": "acme"},
}


def _error(response: httpx.Response) -> tuple[int, str]:
    body = response.json()
    # The node's errors are OpenAI's shape, which adds "param".
    assert set(body) == {"error"} and set(body["error"]) - {"param"} == {
        "message",
        "type",
        "code",
    }, response.text
    return response.status_code, body["error"]["code"]


def _walk(routes, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(method, path) of every route, into included routers; an unknown kind of route fails the
    test."""
    for route in routes:
        if isinstance(route, Route):
            yield from (
                (method, prefix + route.path) for method in route.methods if method != "HEAD"
            )
        elif hasattr(route, "original_router"):  # FastAPI's included router
            yield from _walk(route.original_router.routes, prefix + route.include_context.prefix)
        else:
            raise AssertionError(
                f"a route of unknown kind {type(route).__name__}: extend this walk"
            )


# --------------------------------------------------------------------------- coordinator routes


@pytest.fixture(scope="module")
async def coordinator(
    database_url: str, ledger_template: str
) -> AsyncIterator[tuple[httpx.AsyncClient, list[tuple[str, str]]]]:
    async with fresh_database(database_url, ledger_template) as url:
        settings = coordinator_settings(url)
        app = create_coordinator_app(settings)
        routes = sorted(
            route for route in set(_walk(app.routes)) if not route[1].startswith(CONSOLE_PREFIX)
        )
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://c") as client,
        ):
            yield client, routes


async def _call(
    client: httpx.AsyncClient, method: str, path: str, headers: dict[str, str]
) -> httpx.Response:
    url = path.format(**PATH_VALUES)
    return await client.request(
        method, url, headers=headers, json=BODIES.get(path) if method == "POST" else None
    )


async def test_only_the_documented_routes_are_open(coordinator) -> None:
    client, routes = coordinator
    assert OPEN_ROUTES | DATA_KEY_ROUTES <= set(routes)
    for method, path in routes:
        response = await _call(client, method, path, {})
        if (method, path) in OPEN_ROUTES:
            assert response.status_code in (200, 404), (
                method,
                path,
                response.text,
            )  # 404: no checkpoint yet
        else:
            assert _error(response) == (401, "missing_token"), (method, path)


@pytest.mark.parametrize("roles", CLAIMED_ROLES, ids="+".join)
async def test_end_user_tokens_act_at_no_coordinator_route(coordinator, roles) -> None:
    client, routes = coordinator
    for tenant in ("acme", "platform"):
        token = issue_token(
            tenant=tenant, sub="mallory", scopes=["hr"], roles=roles, secret=JWT_SECRET
        )
        for method, path in routes:
            if (method, path) in OPEN_ROUTES:
                continue
            response = await _call(client, method, path, {"Authorization": f"Bearer {token}"})
            assert _error(response) == (401, "invalid_token"), (method, path)


async def test_the_same_routes_take_operator_tokens(coordinator) -> None:
    """Positive control: the refusals above are about the issuer, not a broken route."""
    client, routes = coordinator
    headers = operator_headers("platform-admin", "platform")
    for method, path in routes:
        if (method, path) in OPEN_ROUTES | DATA_KEY_ROUTES:
            continue
        response = await _call(client, method, path, headers)
        assert response.status_code not in (401, 403), (method, path, response.text)


async def test_console_pages_need_an_operator_token(
    database_url: str, ledger_template: str
) -> None:
    """Every console page sends a visitor without a token to the login form and refuses an end user's token."""
    async with fresh_database(database_url, ledger_template) as url:
        app = create_coordinator_app(coordinator_settings(url))
        pages = sorted(
            route
            for route in set(_walk(app.routes))
            if route[1].startswith(CONSOLE_PREFIX) and route[0] == "GET"
        )
        assert CONSOLE_OPEN_ROUTES <= set(pages) and len(pages) > len(CONSOLE_OPEN_ROUTES)
        end_user = issue_token(
            tenant="acme", sub="mallory", scopes=["hr"], roles=["platform-admin"], secret=JWT_SECRET
        )
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://c") as client,
        ):
            for method, path in pages:
                anonymous = await _call(client, method, path, {})
                if (method, path) in CONSOLE_OPEN_ROUTES:
                    assert anonymous.status_code == 200, path
                    continue
                assert (anonymous.status_code, anonymous.headers["location"]) == (
                    303,
                    "/ui/login",
                ), path
                refused = await _call(client, method, path, {"Authorization": f"Bearer {end_user}"})
                assert (
                    refused.status_code == 401 and "text/html" in refused.headers["content-type"]
                ), path
                admitted = await _call(
                    client, method, path, operator_headers("platform-admin", "platform")
                )
                assert admitted.status_code not in (401, 403), (path, admitted.text)


# --------------------------------------------------------------------------- the node's operator
# endpoint


async def test_node_snapshot_endpoint_refuses_end_user_tokens(tiny_model_dir, tmp_path) -> None:
    settings = NodeSettings(
        model_dir=tiny_model_dir,
        data_dir=tmp_path,
        auth={"jwt_secret": JWT_SECRET},
        operator_auth=OPERATOR_AUTH,
    )
    engine = AsyncEngine.from_settings(settings)  # never started: the node is not ready
    app = create_node_app(
        engine,
        TokenVerifier(settings.auth),
        operator_verifier=TokenVerifier(settings.operator_auth, secret_env=None),
    )
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://n"
    ) as client:
        for roles in CLAIMED_ROLES:
            token = issue_token(tenant="acme", sub="mallory", roles=roles, secret=JWT_SECRET)
            response = await client.post(
                "/v1/cache/snapshots", headers={"Authorization": f"Bearer {token}"}
            )
            assert _error(response) == (401, "invalid_token"), roles
        tenant_admin = await client.post(
            "/v1/cache/snapshots", headers=operator_headers("tenant-admin")
        )
        assert _error(tenant_admin) == (403, "insufficient_role")
        # A platform admin passes authentication and meets the not-ready node.
        admin = await client.post(
            "/v1/cache/snapshots", headers=operator_headers("platform-admin", "platform")
        )
        assert _error(admin) == (503, "not_ready")
        unconfigured = create_node_app(engine, TokenVerifier(settings.auth))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=unconfigured), base_url="http://n"
    ) as client:
        response = await client.post(
            "/v1/cache/snapshots", headers=operator_headers("platform-admin", "platform")
        )
        assert _error(response) == (403, "operator_auth_not_configured")


# --------------------------------------------------------------------------- configuration


def test_operator_issuer_must_not_share_the_end_user_key(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(JWT_SECRET_ENV, raising=False)
    shared = "a-shared-secret-of-at-least-32-bytes!!"
    copy = tmp_path / "copy.pub.pem"
    copy.write_bytes(Path(OPERATOR_PUBLIC_KEY_FILE).read_bytes())
    for auth, operator_auth in (
        ({"jwt_secret": shared}, {"jwt_secret": shared}),
        ({"jwt_public_key_file": OPERATOR_PUBLIC_KEY_FILE}, {"jwt_public_key_file": str(copy)}),
        ({"jwks_url": "https://idp.example/jwks"}, {"jwks_url": "https://idp.example/jwks"}),
    ):
        for settings_class in (CoordinatorSettings, NodeSettings):
            with pytest.raises(
                ValidationError, match="operator_auth must not use the end users' key"
            ):
                settings_class(auth=auth, operator_auth=operator_auth)
    monkeypatch.setenv(JWT_SECRET_ENV, shared)
    with pytest.raises(ValidationError, match="operator_auth must not use the end users' key"):
        CoordinatorSettings(operator_auth={"jwt_secret": shared})


def test_coordinator_never_falls_back_to_the_end_user_secret(monkeypatch) -> None:
    monkeypatch.setenv(JWT_SECRET_ENV, JWT_SECRET)
    with pytest.raises(ValueError, match="configure operator_auth"):
        create_coordinator_app(CoordinatorSettings())


# --------------------------------------------------------------------------- JWKS


def _key_pair(algorithm: str):
    key = {
        "EdDSA": ed25519.Ed25519PrivateKey.generate,
        "ES256": lambda: ec.generate_private_key(ec.SECP256R1()),
        "RS256": lambda: rsa.generate_private_key(public_exponent=65537, key_size=2048),
    }[algorithm]()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return key, pem


def _jwk(key, kid: str, algorithm: str) -> dict:
    jwk = json.loads(jwt.get_algorithm_by_name(algorithm).to_jwk(key.public_key()))
    return {**jwk, "kid": kid, "use": "sig"}


class JwksServer:
    """A JWKS document served over real HTTP on loopback; counts the fetches."""

    def __init__(self) -> None:
        self.document: dict = {"keys": []}
        self.num_fetches = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                server.num_fetches += 1
                body = json.dumps(server.document).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/.well-known/jwks.json"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def jwks_server() -> Iterator[JwksServer]:
    server = JwksServer()
    yield server
    server.close()


ISSUER, AUDIENCE = "https://idp.example", "kvledger"


def _user_token(pem: bytes, kid: str, **overrides) -> str:
    claims = {
        "tenant": "acme",
        "sub": "alice",
        "scopes": ["hr"],
        "pv": 3,
        "private_key_pem": pem,
        "kid": kid,
    }
    claims |= {"issuer": ISSUER, "audience": AUDIENCE} | overrides
    return issue_token(**claims)


def _refused(verifier: TokenVerifier, token: str) -> str:
    with pytest.raises(AuthError) as refused:
        verifier.verify(token)
    assert refused.value.code == "invalid_token"
    return refused.value.message


@pytest.mark.parametrize("algorithm", ["EdDSA", "ES256", "RS256"])
def test_jwks_url_verifies_each_allowed_algorithm(jwks_server, algorithm) -> None:
    key, pem = _key_pair(algorithm)
    jwks_server.document = {"keys": [_jwk(key, "k1", algorithm)]}
    verifier = TokenVerifier(
        IssuerSettings(jwks_url=jwks_server.url, issuer=ISSUER, audience=AUDIENCE)
    )
    principal = verifier.verify(_user_token(pem, "k1"))
    assert (
        principal.tenant_id,
        principal.subject_id,
        principal.scopes,
        principal.policy_version("hr"),
    ) == (
        "acme",
        "alice",
        frozenset({"hr"}),
        3,
    )
    assert jwks_server.num_fetches == 1


def test_jwks_unknown_kid_refetches_once_per_interval_then_401(jwks_server) -> None:
    key, pem = _key_pair("EdDSA")
    jwks_server.document = {"keys": [_jwk(key, "k1", "EdDSA")]}
    verifier = TokenVerifier(IssuerSettings(jwks_url=jwks_server.url, jwks_refetch_interval_s=3600))
    assert verifier.verify(_user_token(pem, "k1", issuer=None, audience=None)).subject_id == "alice"
    assert jwks_server.num_fetches == 1
    # The cache is fresh, but kid k9 is unknown... and the refetch interval has not passed: no
    # flood.
    assert _refused(verifier, _user_token(pem, "k9", issuer=None, audience=None)).endswith(
        "unknown key id (kid)"
    )
    assert jwks_server.num_fetches == 1

    eager = TokenVerifier(IssuerSettings(jwks_url=jwks_server.url, jwks_refetch_interval_s=0))
    assert jwks_server.num_fetches == 2
    assert _refused(eager, _user_token(pem, "k9", issuer=None, audience=None)).endswith(
        "unknown key id (kid)"
    )
    assert jwks_server.num_fetches == 3  # one refetch, then refused


def test_jwks_rotation_over_http(jwks_server) -> None:
    old, old_pem = _key_pair("ES256")
    new, new_pem = _key_pair("RS256")
    jwks_server.document = {"keys": [_jwk(old, "2026-11", "ES256")]}
    verifier = TokenVerifier(
        IssuerSettings(
            jwks_url=jwks_server.url, jwks_refetch_interval_s=0, issuer=ISSUER, audience=AUDIENCE
        )
    )
    assert verifier.verify(_user_token(old_pem, "2026-11")).subject_id == "alice"
    jwks_server.document = {"keys": [_jwk(new, "2026-12", "RS256")]}
    assert verifier.verify(_user_token(new_pem, "2026-12")).subject_id == "alice"
    # The old key is still cached until the TTL; a verifier with an expired cache drops it.
    short = TokenVerifier(
        IssuerSettings(
            jwks_url=jwks_server.url, jwks_cache_ttl_s=0.001, issuer=ISSUER, audience=AUDIENCE
        )
    )
    time.sleep(0.01)
    assert _refused(short, _user_token(old_pem, "2026-11")).endswith("unknown key id (kid)")


def test_jwks_file_rotation(tmp_path) -> None:
    old, old_pem = _key_pair("EdDSA")
    new, new_pem = _key_pair("EdDSA")
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps({"keys": [_jwk(old, "a", "EdDSA")]}))
    verifier = TokenVerifier(
        IssuerSettings(jwks_file=path, jwks_refetch_interval_s=0, issuer=ISSUER, audience=AUDIENCE)
    )
    assert verifier.verify(_user_token(old_pem, "a")).subject_id == "alice"
    _refused(verifier, _user_token(new_pem, "b"))
    path.write_text(json.dumps({"keys": [_jwk(old, "a", "EdDSA"), _jwk(new, "b", "EdDSA")]}))
    assert verifier.verify(_user_token(new_pem, "b")).subject_id == "alice"


def test_jwks_refuses_algorithms_outside_the_allow_list_and_mismatched_keys(jwks_server) -> None:
    ed_key, ed_pem = _key_pair("EdDSA")
    ec_key, _ = _key_pair("ES256")
    rsa_key, rsa_pem = _key_pair("RS256")
    jwks_server.document = {
        "keys": [
            _jwk(ed_key, "ed", "EdDSA"),
            _jwk(ec_key, "ec", "ES256"),
            _jwk(rsa_key, "rsa", "RS256"),
        ]
    }
    verifier = TokenVerifier(
        IssuerSettings(jwks_url=jwks_server.url, issuer=ISSUER, audience=AUDIENCE)
    )
    claims = {
        "tenant": "acme",
        "sub": "alice",
        "iss": ISSUER,
        "aud": AUDIENCE,
        "exp": int(time.time()) + 60,
    }
    # HS256 keyed with public material of a JWK (the classic confusion), and alg none.
    hs256 = jwt.encode(
        claims,
        base64.urlsafe_b64decode(_jwk(ed_key, "ed", "EdDSA")["x"] + "=="),
        algorithm="HS256",
        headers={"kid": "ed"},
    )
    assert "algorithm not allowed" in _refused(verifier, hs256)
    unsigned = jwt.encode(claims, None, algorithm="none", headers={"kid": "ed"})
    assert "algorithm not allowed" in _refused(verifier, unsigned)
    # An EdDSA signature presented under the EC key's kid: the alg must be the one the key implies.
    assert _refused(verifier, _user_token(ed_pem, "ec")).endswith(
        "the algorithm does not match the key"
    )
    # RS256 is allowed by default, not once the allow-list drops it.
    assert verifier.verify(_user_token(rsa_pem, "rsa")).subject_id == "alice"
    eddsa_only = TokenVerifier(
        IssuerSettings(
            jwks_url=jwks_server.url, algorithms=["EdDSA"], issuer=ISSUER, audience=AUDIENCE
        )
    )
    assert "algorithm not allowed" in _refused(eddsa_only, _user_token(rsa_pem, "rsa"))
    assert "names no key id" in _refused(
        verifier,
        issue_token(
            tenant="acme", sub="alice", private_key_pem=ed_pem, issuer=ISSUER, audience=AUDIENCE
        ),
    )


def test_jwks_checks_issuer_and_audience(jwks_server) -> None:
    key, pem = _key_pair("EdDSA")
    jwks_server.document = {"keys": [_jwk(key, "k", "EdDSA")]}
    verifier = TokenVerifier(
        IssuerSettings(jwks_url=jwks_server.url, issuer=ISSUER, audience=AUDIENCE)
    )
    assert verifier.verify(_user_token(pem, "k")).subject_id == "alice"
    assert (
        _refused(verifier, _user_token(pem, "k", issuer="https://evil.example"))
        == "invalid bearer token: Invalid issuer"
    )
    assert (
        _refused(verifier, _user_token(pem, "k", issuer=None))
        == "bearer token lacks the required claim 'iss'"
    )
    assert (
        _refused(verifier, _user_token(pem, "k", audience="someone-else"))
        == "invalid bearer token: Audience doesn't match"
    )
    assert (
        _refused(verifier, _user_token(pem, "k", audience=None))
        == "bearer token lacks the required claim 'aud'"
    )


def test_jwks_tokens_claiming_operator_roles_stay_end_users(jwks_server) -> None:
    key, pem = _key_pair("EdDSA")
    jwks_server.document = {"keys": [_jwk(key, "k", "EdDSA")]}
    verifier = TokenVerifier(IssuerSettings(jwks_url=jwks_server.url))
    principal = verifier.verify(
        issue_token(
            tenant="acme", sub="alice", roles=["platform-admin"], private_key_pem=pem, kid="k"
        )
    )
    assert not hasattr(principal, "roles")
    # And the operator issuer (another key) refuses the same token outright.
    operators = TokenVerifier(IssuerSettings(**OPERATOR_AUTH), secret_env=None)
    with pytest.raises(AuthError):
        operators.verify_operator(
            issue_token(
                tenant="acme", sub="alice", roles=["platform-admin"], private_key_pem=pem, kid="k"
            )
        )


def test_unusable_jwks_is_a_configuration_error(jwks_server, tmp_path) -> None:
    jwks_server.document = {"keys": [{"kty": "oct", "k": "c2VjcmV0", "kid": "hmac"}]}
    with pytest.raises(ValueError, match="holds no usable signing key"):
        TokenVerifier(IssuerSettings(jwks_url=jwks_server.url))
    with pytest.raises(ValueError, match="cannot load the JWKS"):
        TokenVerifier(IssuerSettings(jwks_file=tmp_path / "absent.json"))
