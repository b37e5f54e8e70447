"""Benchmarks shipped with the package (``pagedllm bench ...``)."""
