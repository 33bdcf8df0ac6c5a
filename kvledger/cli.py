"""The ``kvledger`` command line. Each subcommand lives in the module that owns the feature;
this file only wires argparse to them (imports are lazy so ``kvledger token`` does not load torch)."""

from __future__ import annotations

import argparse
import importlib
import sys


def _lazy(target: str):
    module_name, function_name = target.split(":")

    def run(args: argparse.Namespace) -> int | None:
        return getattr(importlib.import_module(module_name), function_name)(args)

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

    token = commands.add_parser("token", help="print a signed JWT for local use")
    token.add_argument("--tenant", required=True)
    token.add_argument("--sub", required=True)
    token.add_argument("--scopes", default="", help="comma-separated auth scopes")
    token.add_argument("--pv", type=int, default=0, help="policy version")
    token.add_argument("--role", action="append", default=[], help="role claim (repeatable)")
    token.add_argument("--ttl-s", type=int, default=3600)
    token.add_argument("--private-key", help="Ed25519 private key (PEM) to sign with instead of KVLEDGER_JWT_SECRET")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
