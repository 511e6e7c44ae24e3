"""Engine caches: per-layer tensors (layer_caches.py), allocators (allocators.py) and the
`CacheManager` that owns them all (manager.py)."""
