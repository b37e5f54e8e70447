"""``.venv/bin/python bench/accuracy.py [options]`` = ``pagedllm bench accuracy [options]``.

The implementation lives in ``pagedllm/benchmarks/accuracy.py`` so that the installed
``pagedllm`` command has it too.
"""

import sys

from pagedllm.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "accuracy", *sys.argv[1:]]))
