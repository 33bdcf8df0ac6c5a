"""One module per API resource (ledger reads, invalidations, erasures, keys, dead letters, router
feed, usage); each declares its roles next to its routes."""
