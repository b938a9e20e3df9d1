"""Serving: the decode engine (sole owner of slots, buckets, widths and the dummy slot),
sampling, compile warmup, seeded workloads and their replay on a virtual clock."""
