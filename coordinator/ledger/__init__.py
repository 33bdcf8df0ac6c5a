"""The ledger's storage: tables, states, the database session and how ledger transactions lock.

Owns the schema every other part reads and writes (``models``, ``states``), the one database
engine and session factory (``db``), the inbox that makes handlers idempotent, the lock order
of ledger-writing transactions (``transactions``) and running the migrations.
Must never import handlers, the API or Kafka: it is what they stand on.
"""
