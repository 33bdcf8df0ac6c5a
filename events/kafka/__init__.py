"""Kafka plumbing shared by nodes and coordinator: settings, topic creation, producer, batch consumer.

Delivery model: **at-least-once delivery + an idempotent handler = effectively once.**
Kafka transactions are not used (the embedded Tansu broker does not support the
idempotent/transactional producer, and exactly-once across Kafka *and* Postgres needs
the database anyway). Instead:

* the producer waits for ``acks=all``, so an acknowledged record survives a broker loss;
* :class:`BatchConsumer` commits a partition's offset only after the handler has
  returned, and the handler returns only after its database transaction committed —
  so a crash at any point re-delivers, never loses;
* the handler records each ``event_id`` in an inbox table in that same transaction,
  so a re-delivered record is a no-op.
"""
