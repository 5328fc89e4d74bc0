"""Tiers below the device: the host pool (L2) and the Redis tier (L3), coming."""
