"""Hugging Face model directories: open one by its headers (`model_dir`), the rules its index and shard
headers must keep, as findings (`checks`), find one (`hub`), the files
a derived model carries (`carry`), what its config says (`config`), new shards and their index
(`shards`), file names and the weight-file rule (`names`)."""
