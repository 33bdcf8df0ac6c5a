"""Keys the coordinator holds or trusts: tenants' data keys, nodes' and producers' public keys.

``data_keys`` serves and destroys the per-scope keys nodes seal blocks under (a destroyed key is
a crypto-erase); ``node_keys`` and ``producer_keys`` are the enrolled Ed25519 keys whose
signatures on kv-events, acks and customer events are checked. Only the ledger below it.
"""
