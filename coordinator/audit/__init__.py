"""What proves an erasure afterwards: signed receipts, the Merkle audit log and its verifier.

Receipts are built and signed here and checked offline by ``kvledger verify-receipt``, which
imports this package without a database. Never imports handlers or the API: evidence flows
in from the erasure handler, never the other way.
"""
