"""Serving: sampling (pure tensor functions), the decode engine (sole owner of slots, buckets,
widths and the dummy slot) above it, generation above the engine, compile warmup, seeded
workloads and their replay on a virtual clock."""
