"""``pagedllm serve``'s options for Ray Serve, and how they become a replica plan. Imports no
Ray: the parser is built whether or not the ``ray`` extra is installed."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

APP_NAME = "pagedllm"
ENGINE_DEPLOYMENT = "EngineReplica"
ROUTERS = ("prefix", "pow2")
ROUTER_CLASS = "pagedllm.serve_ray.router:PrefixAwareRequestRouter"


def add_ray_args(parser: argparse.ArgumentParser) -> None:
    """``pagedllm serve``'s options for Ray Serve (``--replicas`` switches to it)."""
    group = parser.add_argument_group("replicas (Ray Serve; pip install -e '.[ray]')")
    group.add_argument("--replicas", type=int, default=None, metavar="N",
                       help="serve N engine replicas behind Ray Serve (starts a local Ray); with "
                            "--max-replicas, the fewest the autoscaler keeps (default: one process, no Ray)")
    group.add_argument("--max-replicas", type=int, default=None, metavar="M",
                       help="autoscale between --replicas and M replicas on queue length (default: no autoscaling)")
    group.add_argument("--target-ongoing-requests", type=float, default=None, metavar="R",
                       help="autoscaling target: requests in flight per replica (default: --max-num-seqs)")
    group.add_argument("--threads-per-replica", type=int, default=None, metavar="T",
                       help="torch threads (and Ray CPUs) per replica (default: cores // max replicas, >= 1)")
    group.add_argument("--router", choices=ROUTERS, default="prefix",
                       help="prefix: to the replica holding the prompt's prefix unless it is overloaded, else "
                            "the least loaded (default); pow2: Serve's default power of two choices")
    group.add_argument("--routing-stats-period", type=float, default=0.5, metavar="SECONDS",
                       help="how often replicas report load and prefix keys to the router (default 0.5)")
    group.add_argument("--ray-address", default=None,
                       help="join this Ray cluster instead of starting a local one (e.g. 'auto')")


@dataclasses.dataclass(frozen=True)
class ReplicaPlan:
    """How many replicas, with how many threads each.

    Attributes:
        min_replicas, max_replicas: equal without autoscaling.
        threads: torch threads and Ray CPUs of each replica.
        target_ongoing_requests: the autoscaling target (None without autoscaling).
    """

    min_replicas: int
    max_replicas: int
    threads: int
    target_ongoing_requests: Optional[float]

    @classmethod
    def from_args(cls, args: argparse.Namespace, cores: int) -> "ReplicaPlan":
        """Raises: ValueError for a count below 1, --max-replicas below --replicas, or a
        target <= 0."""
        replicas = args.replicas
        if replicas is None or replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {replicas}")
        most = args.max_replicas if args.max_replicas is not None else replicas
        if most < replicas:
            raise ValueError(f"--max-replicas must be >= --replicas ({replicas}), got {most}")
        threads = args.threads_per_replica if args.threads_per_replica is not None else max(1, cores // most)
        if threads < 1:
            raise ValueError(f"--threads-per-replica must be >= 1, got {threads}")
        target = None
        if most > replicas:
            target = args.target_ongoing_requests if args.target_ongoing_requests is not None else args.max_num_seqs
            if not target > 0:
                raise ValueError(f"--target-ongoing-requests must be > 0, got {target}")
        return cls(replicas, most, threads, target)
