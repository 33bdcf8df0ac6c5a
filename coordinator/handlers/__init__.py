"""What the coordinator does with each record: ingest kv-events, decide, apply acks, erase.

One module per path (``ingest``, ``decisions``, ``invalidation``, ``acks``, ``erasure``, ``resend``,
``outbox``, ``pruning``, ``poison``). Handlers run inside ledger transactions and return when
they committed; they never speak HTTP and never poll Kafka themselves (``coordinator.consumers``
does).
"""
