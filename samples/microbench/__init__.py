"""Micro-benchmarks of single parts: the runtime's forward (`runtime`), the decoder, the KV-cache
features, the manager's own overhead, the kernels, the packer. Each runs as `python -m
samples.microbench.<name>`."""
