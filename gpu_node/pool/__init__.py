"""The block pool: where a node's KV blocks live (device, host, disk), how they move and how they are deleted.

Owns the pool's state and its parts (reads, demotion, removal, warm start, sequences'
device slots), the eviction order, the at-rest record format, the disk tier's files and
snapshots. It answers to whoever holds it (the cache manager, paged KV, the command
applier) and must never import them: no engine, scheduler, model, HTTP, Kafka or
governance code here. Every change of bytes is reported as a pool event; publishing it
is the node's. Import names from their modules; this package re-exports nothing.
"""
