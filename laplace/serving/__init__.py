"""Serving: sampling (pure tensor functions), the decode engine above it (whose parts own what
they hold: the scheduler the requests and widths, the model runner the graphs and buckets, the
cache manager the slots and the dummy slot), generation above the engine, compile warmup,
seeded workloads and their replay on a virtual clock, and `laplace serve`."""
