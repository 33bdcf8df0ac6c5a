"""The node's side of the ledger: commands in, events and acks out, versions enforced.

``commands`` consumes signed commands (replays, re-acks, acks in parts); ``applier`` applies one
invalidation (``predicates`` says what it names, ``erasure`` rewrites snapshots and destroys a
subject's keys) and gathers its evidence; ``publisher`` signs and sends pool events and
inventories; ``sync`` fetches the governance state a starting node must enforce; ``usage`` counts
what each tenant was served. Never computes KV.
"""
