"""What makes a block reusable, and for whom: the request-level prefix cache above the pool.

``kv_cache_manager`` looks up, references and commits a request's blocks; ``namespace`` says which
KV is compatible; ``peers`` pulls a prefix from the peer that holds it; ``kv_memory`` sizes the
tiers in bytes; ``layout_sampler`` records, without content, where prompts leave the cached
prefix. The pure key derivation and the version registry it builds on live in ``prefix_keys``,
shared with the router.
"""
