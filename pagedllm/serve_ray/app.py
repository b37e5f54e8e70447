"""The Ray Serve application: ``pagedllm serve --replicas N`` on one machine, ``app_builder``
for ``serve run`` / ``serve build`` on a cluster.

    HTTP ─▶ Serve proxy ─▶ OpenAIIngress (1 replica: build_app's routes over RayEngineClient)
                                 │ handle.generate, streaming; PrefixAwareRequestRouter picks
                                 ▼
                 EngineReplica × N (each: AsyncLLMEngine, its KV and prefix cache, T threads)

Both entry points take the same options, ``ServerArgs`` and ``EngineArgs`` (``app_builder``
parses them with ``pagedllm serve``'s flags), so every engine and server flag means the same
thing in both: ``serve run pagedllm.serve_ray.app:app_builder
model=... replicas=2 max-num-seqs=32`` passes ``--model ... --replicas 2 --max-num-seqs 32``.

Threads: each replica runs ``--threads-per-replica`` torch threads (default: this machine's
cores // the most replicas there can be, at least 1) and asks Ray for as many CPUs, so that N
replicas on C cores never oversubscribe them and Ray places no more replicas on a node than its
CPUs hold.

Autoscaling (``--max-replicas M`` above ``--replicas N``): Serve's autoscaler keeps between N and
M replicas so that each has about ``--target-ongoing-requests`` requests in flight (running or
waiting in its engine): a queue that grows adds replicas, an idle one drains back to N.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from typing import Any, Callable, Optional

from pagedllm.config import EngineArgs
from pagedllm.entrypoints.openai.cli_args import ServerArgs, add_serve_args, parse_serve_args
from pagedllm.serve_ray.options import APP_NAME, ENGINE_DEPLOYMENT, ROUTER_CLASS, ReplicaPlan
from pagedllm.utils import check_port_free

logger = logging.getLogger(__name__)


def build_application(server_args: ServerArgs, engine_args: EngineArgs, cores: Optional[int] = None,
                      engine_factory: Optional[Callable[[EngineArgs], Any]] = None) -> Any:
    """The Serve application (ingress bound to the engine deployment) for ``pagedllm serve``'s
    options.

    Args:
        cores: CPUs to share among replicas (default: this process's CPU affinity).
        engine_factory: builds each replica's engine from ``engine_args`` (default
            ``LLMEngine``; tests serve tiny random models through it). Ray pickles it to the
            replicas: a module-level function.

    Raises:
        ValueError: bad options (``ServerArgs.verify``, ``ReplicaPlan``, the keys file).
    """
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from pagedllm.serve_ray.ingress import OpenAIIngress
    from pagedllm.serve_ray.replica import EngineReplica

    server_args.verify(engine_args)
    cores = cores or len(os.sched_getaffinity(0))
    plan = ReplicaPlan.from_args(server_args, engine_args.max_num_seqs, cores)
    api_keys = server_args.load_api_keys()  # here: the file and the variables are this machine's
    names = server_args.served_model_names(engine_args.model)
    router_config = RequestRouterConfig(request_routing_stats_period_s=server_args.routing_stats_period)
    if server_args.router == "prefix":
        router_config = RequestRouterConfig(request_router_class=ROUTER_CLASS,
                                            request_routing_stats_period_s=server_args.routing_stats_period)
    options: dict[str, Any] = dict(
        # OMP_NUM_THREADS as well as torch.set_num_threads: OpenMP reads it when the worker
        # process starts, so every thread of the replica (the engine thread too) gets the count.
        name=ENGINE_DEPLOYMENT, ray_actor_options={"num_cpus": plan.threads, "runtime_env": {
            "env_vars": {"OMP_NUM_THREADS": str(plan.threads)}}},
        # Requests beyond a full batch wait in the engine's own queue (its 429 limit applies).
        max_ongoing_requests=2 * engine_args.max_num_seqs, request_router_config=router_config,
        graceful_shutdown_timeout_s=server_args.drain_timeout, health_check_period_s=2.0)
    if plan.target_ongoing_requests is None:
        options["num_replicas"] = plan.min_replicas
    else:
        options["autoscaling_config"] = {
            "min_replicas": plan.min_replicas, "max_replicas": plan.max_replicas,
            "target_ongoing_requests": plan.target_ongoing_requests,
            "upscale_delay_s": 2.0, "downscale_delay_s": 20.0, "metrics_interval_s": 1.0,
            "look_back_period_s": 5.0}
    engine = serve.deployment(EngineReplica).options(**options).bind(
        engine_args, names[0], plan.threads, engine_factory, server_args.max_waiting_requests,
        server_args.request_timeout)
    ingress = serve.deployment(OpenAIIngress).options(
        name="OpenAIIngress", num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=10_000)
    return ingress.bind(engine, server_args, api_keys, APP_NAME, ENGINE_DEPLOYMENT,
                        ServerArgs.model_root(engine_args.model))


def app_builder(args: dict[str, str]) -> Any:
    """``serve run pagedllm.serve_ray.app:app_builder key=value ...``: each ``key=value`` is
    ``pagedllm serve``'s ``--key value`` (``true`` for a flag), ``model=`` the model.

    Raises:
        ValueError: an unknown option or a bad value (argparse's message, or the options').
    """
    argv = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if str(value).lower() == "true":
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    parser = argparse.ArgumentParser(prog="app_builder", exit_on_error=False)
    add_serve_args(parser)
    try:
        parsed = parser.parse_args(argv)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise ValueError(f"bad app_builder arguments {args}: {exc}") from None
    if parsed.replicas is None:
        parsed.replicas = 1
    return build_application(*parse_serve_args(parsed))


def _drain(timeout: float) -> None:
    """What one server does on SIGTERM, for the ingress: new requests get 503 (``/readyz``
    false), open ones get ``timeout`` seconds to finish; those left are ended by the shutdown."""
    from ray import serve

    logger.warning("shutting down: draining open requests for up to %g s", timeout)
    try:
        left = serve.get_app_handle(APP_NAME).drain.remote(timeout).result(timeout_s=timeout + 30)
    except Exception as exc:  # noqa: BLE001 - a broken ingress must not stop the shutdown
        logger.warning("drain failed (%r); shutting down", exc)
        return
    if left:
        logger.warning("%d request(s) still open after the %g s drain timeout are ended", left, timeout)


def run_replicas(server_args: ServerArgs, engine_args: EngineArgs,
                 engine_factory: Optional[Callable[[EngineArgs], Any]] = None) -> int:
    """``pagedllm serve --replicas N``: start Ray (local, unless ``--ray-address``), serve the
    application on ``--host:--port`` until SIGTERM/SIGINT, then drain (new requests 503, open
    ones get ``--drain-timeout`` seconds to finish), shut Serve down and return 0.

    Raises:
        ValueError: bad options, or the port is taken.
    """
    import ray
    from ray import serve

    cores = len(os.sched_getaffinity(0))
    application = build_application(server_args, engine_args, cores, engine_factory)  # before Ray starts
    check_port_free(server_args.host, server_args.port)
    if server_args.ray_address:
        ray.init(address=server_args.ray_address, log_to_driver=False)
    else:
        ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": server_args.host, "port": server_args.port})
        serve.run(application, name=APP_NAME, route_prefix="/", blocking=False)
        logger.info("serving %s replica(s) of %s on http://%s:%d", server_args.replicas,
                    server_args.served_model_names(engine_args.model)[0], server_args.host, server_args.port)
        stop.wait()
        _drain(server_args.drain_timeout)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
