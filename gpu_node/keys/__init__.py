"""The node's keys: its own signing identity, the coordinator's pinned command key, and the
per-scope data keys that seal blocks at rest (fetched from the coordinator's key service).

Nothing here decides what to seal or delete; the pool and the governance code ask.
"""
