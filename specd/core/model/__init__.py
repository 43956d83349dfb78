"""Models: the KV-cached runner, the session pool, loading, the checkpoint format, tensor parallelism, the catalog, the emulated accelerator."""
