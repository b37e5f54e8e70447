"""The package version (one place; ``pagedllm.__version__`` and the server report it)."""

__version__ = "0.1.0"
