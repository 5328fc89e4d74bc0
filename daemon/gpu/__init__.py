"""Device memory: KV pools, page allocators, pool export to engines, device<->host copies."""
