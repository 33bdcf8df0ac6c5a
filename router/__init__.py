"""The fleet router: sends each chat request to the node holding the longest cached prefix of its block keys.

``index`` is the exact, in-memory block index (block hash → {node: tier}) fed by kv-events and
rebuilt from the ledger; ``scoring`` ranks nodes against it and their load; ``health`` keeps the
circuit breakers; ``feed`` consumes kv-events and commands and reads the ledger; ``keying``
computes a request's block keys as its node will; ``proxy`` and ``api`` serve the OpenAI-compatible
front door; ``server`` is ``kvledger router``. Base install only: no torch, numpy or transformers
(import-linter contract ``router-no-ml``), and never the node's or the coordinator's code.
"""
