"""What makes a block reusable, and for whom: the request-level prefix cache above the pool.

``kv_cache_manager`` looks up, references and commits a request's blocks; ``versions`` holds the
document and policy versions a request is admitted against; ``namespace`` says which KV is
compatible; ``kv_memory`` sizes the tiers in bytes; ``layout_sampler`` records, without content,
where prompts leave the cached prefix. The pure key derivation it
builds on lives in ``prefix_keys``, shared with the router.
"""
