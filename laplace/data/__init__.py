"""Data: corpus readers, tokenizer training, token shards and the training sampler.

Modules: pydocs (the offline default corpus), readers (units and slices of a corpus: files,
saved datasets, hub streams, read lazily; the documents of a unit) over units (what the readers
share), text_files (byte ranges, text cut into documents), record_files (JSON Lines, JSON,
Parquet) and hub (hub and saved datasets), tokenizer (byte-level BPE, trained on a bounded
seeded sample), tokenize (corpus -> fixed-size token shards with a manifest each, streamed by a
worker pool, resumable) with its phases survey (fingerprints and the tokenizer's sample), encode
(a slice into shards) and assembly (the output swapped in whole), pool (the worker processes
that die with the stage), dask_executor
(the same jobs on a Dask cluster, data.executor: dask), long_records (a huge JSON line read from
its bytes a piece at a time), shards (the shard
writer, and a split as one virtual array over its memory-mapped shards, verified once per job),
sampler (the stateless batch sampler).

docs/data.md explains the layout on disk, the resume protocol and the corpus under DVC.
"""
