"""Data: corpus readers, tokenizer training, token shards and the training sampler.

Modules: pydocs (the offline default corpus), readers (python-docs, hub, files),
tokenizer (byte-level BPE), tokenize (corpus -> shards + manifest), shards (reading them),
sampler (the stateless batch sampler).

The tokenize stage (`tokenize_corpus`) turns a text corpus into a directory the
trainer reads without ever touching text again:

    tokenizer.json   byte-level BPE (trained on the train split, or copied from tokenizer.path)
    train.bin        flat little-endian token ids, every document followed by <|endoftext|>
    val.bin          the same for the held-out documents
    manifest.json    counts, dtype, checksums; written last, so its presence means "complete"

Training then memory-maps the shards (`open_split`) and draws windows with
`sample_batch`, whose batch depends only on (seed, step): resuming needs no
sampler state and every rank agrees on the global batch.

Corpora (`data.source` in params.yaml):

* ``python-docs`` (default, offline): the Python Language Reference topics and
  the standard library's docstrings, about 1.7 MB of English that ships with
  every Python install.
* ``hub``: any Hugging Face dataset. For FineWeb-Edu::

      data:
        source: hub
        hub_path: HuggingFaceFW/fineweb-edu
        hub_name: sample-10BT
        hub_split: train
        hub_streaming: true
        max_documents: 200000   # required when streaming: how many documents to pull

  Streaming reads only the first ``max_documents`` documents and holds them in
  memory; ``hub_streaming: false`` downloads the whole config into the
  datasets cache and stays disk-backed. ``hub_path`` may also be a local
  directory of .jsonl/.parquet files (works offline).
* ``files``: local .txt (one document per file), .jsonl/.json/.parquet (one
  document per record, column ``data.text_field``) files or globs.
"""
