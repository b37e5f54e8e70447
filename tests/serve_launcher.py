"""``pagedllm serve`` over an engine factory, for the tests that run a server process over a
tiny random model:

    python -m tests.serve_launcher MODULE:FUNCTION [pagedllm serve options]

``FUNCTION(EngineArgs) -> LLMEngine`` builds each engine (``cmd_serve``'s ``engine_factory``;
with ``--replicas``, Ray pickles it to every replica). The production CLI has no such option:
it never imports code by name.
"""

from __future__ import annotations

import importlib
import logging
import sys

from pagedllm.entrypoints.cli import build_parser, cmd_serve


def main(argv: list[str]) -> int:
    factory_name, *serve_argv = argv
    module_name, _, function_name = factory_name.partition(":")
    engine_factory = getattr(importlib.import_module(module_name), function_name)
    args = build_parser().parse_args(["serve", *serve_argv])
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return cmd_serve(args, engine_factory)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
