"""The node's side of the ledger: commands in, events and acks out, versions enforced.

``commands`` applies signed invalidations and acks them with evidence; ``publisher`` signs and sends
pool events and inventories; ``sync`` fetches the governance state a starting node must enforce
(into a ``prefix_keys.versions`` registry); ``usage`` counts what each tenant was served. Never
computes KV."""
