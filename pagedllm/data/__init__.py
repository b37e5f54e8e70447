"""Data shipped with pagedllm: ``public_domain.txt``, the text benchmark workloads are cut from,
``pagedllm bench accuracy`` scores and ``w8a8`` calibrates on (``models/quantize.py``)."""

from pathlib import Path

TEXT_PATH = Path(__file__).with_name("public_domain.txt")
