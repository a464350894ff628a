"""Memory the runtime allocates for weights, KV caches and pinned staging, through one function (allocation.py)."""
