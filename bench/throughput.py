"""``.venv/bin/python bench/throughput.py [options]`` = ``pagedllm bench throughput [options]``.

The implementation lives in ``pagedllm/benchmarks/throughput.py`` so that the installed
``pagedllm`` command has it too.
"""

import sys

from pagedllm.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "throughput", *sys.argv[1:]]))
