"""``.venv/bin/python bench/memory.py [options]`` = ``pagedllm bench memory [options]``.

The implementation lives in ``pagedllm/benchmarks/memory.py`` so that the installed
``pagedllm`` command has it too.
"""

import sys

from pagedllm.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "memory", *sys.argv[1:]]))
