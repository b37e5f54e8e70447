"""``ServerArgs``: the options of ``pagedllm serve`` besides the engine's, for one server and
for Ray Serve replicas (vLLM ``vllm/entrypoints/openai/cli_args.py``).

Each field's metadata is its flag's help, so ``add_cli_args`` (``config.add_dataclass_cli_args``,
as ``EngineArgs``' flags) and the docs (``docs/gen_cli.py``) say what the field says. The CLI
parses into ``ServerArgs`` and ``EngineArgs`` (``parse_serve_args``); everything below
(``api_server.run_server``, ``build_app``, ``serve_ray.app``) takes the dataclasses.
Imports neither FastAPI nor Ray: ``pagedllm --help`` builds this parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from pagedllm import envs
from pagedllm.config import DEFAULT_MAX_REQUEST_BODY_BYTES, EngineArgs, add_dataclass_cli_args
from pagedllm.entrypoints.openai.api_keys import DEFAULT_KEY_NAME, APIKey, load_api_keys, parse_api_keys
from pagedllm.lora.request import LoRARequest

ROUTERS = ("prefix", "pow2")
_REPLICAS_GROUP = "replicas (Ray Serve; pip install -e '.[ray]')"


def _server_option(default: Any, help: str, **cli: Any) -> Any:
    """A field of ``ServerArgs``: its default, its flag's help and what
    ``add_dataclass_cli_args`` reads beyond them (``metavar``, ``nargs``, ``group``, ...)."""
    return field(default=default, metadata={"help": help, **cli})


def _replicas_option(default: Any, help: str, **cli: Any) -> Any:
    return _server_option(default, help, group=_REPLICAS_GROUP, **cli)


def parse_lora_modules(values: Sequence[str]) -> list[tuple[str, str]]:
    """``--lora-modules`` values as ``(name, path)``: ``name=path``, or vLLM's JSON form
    ``{"name": ..., "path": ...}``.

    Raises:
        ValueError: another form, an empty name or path, or a name given twice.
    """
    modules: list[tuple[str, str]] = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                entry = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--lora-modules {value!r}: not valid JSON: {exc.msg}") from None
            name, path = entry.get("name"), entry.get("path")
        else:
            name, _, path = value.partition("=")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"--lora-modules {value!r}: give name=path or {{\"name\": ..., \"path\": ...}}")
        if any(name == known for known, _ in modules):
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        modules.append((name, path))
    return modules


@dataclass
class ServerArgs:
    """The server's options (``pagedllm serve``; vLLM's names where vLLM has the option).

    ``served_model_name`` None means the model's: ``served_model_names`` resolves it.
    """

    host: str = _server_option("127.0.0.1", "address to listen on")
    port: int = _server_option(8000, "port to listen on")
    api_key: Optional[str] = _server_option(
        None, "require 'Authorization: Bearer KEY' on the API (default: $PAGEDLLM_API_KEY)")
    api_keys_file: Optional[str] = _server_option(
        None, "JSON list of keys with names and limits: name, key, requests_per_minute, tokens_per_minute, "
              "max_concurrent_requests, priority (default: the same JSON in $PAGEDLLM_API_KEYS; see "
              "docs/serving.md)", metavar="PATH")
    served_model_name: Optional[list[str]] = _server_option(
        None, "model name(s) clients use; the first is reported (default: the model path)", nargs="+")
    max_waiting_requests: Optional[int] = _server_option(
        None, "answer 429 when this many sequences wait beyond the free seats of --max-num-seqs "
        "(default: no limit)")
    request_timeout: Optional[float] = _server_option(
        None, "abort requests running longer than this many seconds (default: never)")
    max_queue_wait: Optional[float] = _server_option(
        None, "answer 503 at once when a new request's estimated wait to start exceeds this (or "
              "--request-timeout) (default: only --request-timeout)", metavar="SECONDS")
    max_request_body_bytes: int = _server_option(
        DEFAULT_MAX_REQUEST_BODY_BYTES, "refuse a larger request body with 413 before reading the rest",
        metavar="BYTES")
    drain_timeout: float = _server_option(
        30.0, "on SIGTERM, seconds open requests may still run (default 30)", show_default=False)
    disable_dashboard: bool = _server_option(
        False, "do not serve the live KV block-pool view (/dashboard, /debug/kv, /debug/kv/stream)",
        store_true=True)
    request_log: Optional[str] = _server_option(
        None, "append one JSON line per finished request (arrival, prompt and output token counts, "
              "cached-prefix hash): a trace for `pagedllm plan --trace`", metavar="PATH")
    lora_modules: Optional[list[str]] = _server_option(
        None, "LoRA adapters (PEFT folders) to load at start, each served as the model NAME (needs "
              "--enable-lora; vLLM's JSON form {\"name\": ..., \"path\": ...} works too)",
        nargs="+", metavar="NAME=PATH")
    allow_runtime_lora_updating: bool = _server_option(
        False, "serve /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
               "VLLM_ALLOW_RUNTIME_LORA_UPDATING): clients then make the server read adapter folders by path",
        store_true=True)
    replicas: Optional[int] = _replicas_option(
        None, "serve N engine replicas behind Ray Serve (starts a local Ray); with --max-replicas, the "
              "fewest the autoscaler keeps (default: one process, no Ray)", metavar="N")
    max_replicas: Optional[int] = _replicas_option(
        None, "autoscale between --replicas and M replicas on queue length (default: no autoscaling)",
        metavar="M")
    target_ongoing_requests: Optional[float] = _replicas_option(
        None, "autoscaling target: requests in flight per replica (default: --max-num-seqs)", metavar="R")
    threads_per_replica: Optional[int] = _replicas_option(
        None, "torch threads (and Ray CPUs) per replica (default: cores // max replicas, >= 1)", metavar="T")
    router: str = _replicas_option(
        "prefix", "prefix: to the replica holding the prompt's prefix unless it is overloaded, else the "
                  "least loaded (default); pow2: Serve's default power of two choices",
        choices=ROUTERS, show_default=False)
    routing_stats_period: float = _replicas_option(
        0.5, "how often replicas report load and prefix keys to the router", metavar="SECONDS")
    ray_address: Optional[str] = _replicas_option(
        None, "join this Ray cluster instead of starting a local one (e.g. 'auto')")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add the ``server`` and ``replicas`` argument groups, one flag per field."""
        add_dataclass_cli_args(parser, cls, "server")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        """The options ``add_cli_args`` added, from the parsed ``args`` (not verified)."""
        return cls(**{option.name: getattr(args, option.name) for option in dataclasses.fields(cls)})

    def verify(self, engine_args: Optional[EngineArgs] = None) -> None:
        """Check every option alone, and with ``engine_args`` what depends on the engine's.

        Raises:
            ValueError: naming the option, its value and the allowed range; ``lora_modules``
                that do not parse, collide with a served name or come without
                ``enable_lora``; LoRA options with ``replicas`` (replicas serve no adapters).
        """
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0 seconds, got {self.drain_timeout}")
        if self.max_queue_wait is not None and not self.max_queue_wait > 0:
            raise ValueError(f"max_queue_wait must be > 0 seconds, got {self.max_queue_wait!r}")
        if not self.max_request_body_bytes >= 1:
            raise ValueError(f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes!r}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {self.router!r}")
        if self.served_model_name is not None and not self.served_model_name:
            raise ValueError("served_model_name must hold at least one name")
        lora_modules = parse_lora_modules(self.lora_modules or [])
        if self.replicas is not None and (lora_modules or self.allow_runtime_lora_updating):
            raise ValueError("LoRA adapters are not served by Ray Serve replicas: drop --lora-modules and "
                             "--allow-runtime-lora-updating, or --replicas")
        if engine_args is None:
            return
        if lora_modules and not engine_args.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        names = self.served_model_names(engine_args.model)
        taken = [name for name, _ in lora_modules if name in names]
        if taken:
            raise ValueError(f"--lora-modules: {taken} are also base model names (--served-model-name)")

    def served_model_names(self, model: Optional[str]) -> list[str]:
        """The names clients may put in ``model``: ``served_model_name``, else the engine's
        ``model`` option, else the default model's name."""
        from pagedllm.models.loader import DEFAULT_MODEL_FILE

        return list(self.served_model_name or [model or Path(DEFAULT_MODEL_FILE).stem])

    @staticmethod
    def model_root(model: Optional[str]) -> str:
        """What ``/v1/models`` reports as the base model's ``root``: the engine's ``model``
        option, else the default model's file."""
        from pagedllm.models.loader import DEFAULT_MODEL_FILE

        return str(model or DEFAULT_MODEL_FILE)

    def lora_requests(self) -> list[LoRARequest]:
        """``lora_modules`` as the adapters to load at start, ids 1, 2, ... in order.

        Raises:
            ValueError: as ``parse_lora_modules``.
        """
        return [LoRARequest(name, index + 1, path)
                for index, (name, path) in enumerate(parse_lora_modules(self.lora_modules or []))]

    def load_api_keys(self) -> list[APIKey]:
        """Every key: those of ``api_keys_file`` (else ``$PAGEDLLM_API_KEYS``), then
        ``api_key`` (else ``$PAGEDLLM_API_KEY``) as the key named ``default``, without limits.

        Raises:
            ValueError: a keys file or variable that does not parse (``api_keys.py``).
        """
        keys = []
        if self.api_keys_file:
            keys = load_api_keys(self.api_keys_file)
        elif envs.PAGEDLLM_API_KEYS:
            keys = parse_api_keys(envs.PAGEDLLM_API_KEYS, "$PAGEDLLM_API_KEYS")
        api_key = self.api_key or envs.PAGEDLLM_API_KEY
        return keys + ([APIKey(DEFAULT_KEY_NAME, api_key)] if api_key else [])


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """``pagedllm serve``'s flags: the server's (``ServerArgs``) then the engine's
    (``EngineArgs``)."""
    ServerArgs.add_cli_args(parser)
    EngineArgs.add_cli_args(parser)


def parse_serve_args(args: argparse.Namespace) -> tuple[ServerArgs, EngineArgs]:
    """What ``add_serve_args`` added, as verified dataclasses.

    Raises:
        ValueError: as ``EngineArgs.from_cli_args`` and ``ServerArgs.verify``.
    """
    engine_args = EngineArgs.from_cli_args(args)
    server_args = ServerArgs.from_cli_args(args)
    server_args.verify(engine_args)
    return server_args, engine_args
