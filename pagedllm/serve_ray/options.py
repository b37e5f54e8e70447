"""How ``pagedllm serve``'s replica options (``ServerArgs.replicas`` ...) become a replica plan,
and the names of the Serve application's parts. Imports no Ray."""

from __future__ import annotations

import dataclasses
from typing import Optional

from pagedllm.entrypoints.openai.cli_args import ServerArgs

APP_NAME = "pagedllm"
ENGINE_DEPLOYMENT = "EngineReplica"
ROUTER_CLASS = "pagedllm.serve_ray.router:PrefixAwareRequestRouter"


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
    def from_args(cls, server_args: ServerArgs, max_num_seqs: int, cores: int) -> "ReplicaPlan":
        """The plan of ``server_args``' replica options on ``cores`` CPUs; ``max_num_seqs`` (the
        engine's) is the default autoscaling target.

        Raises:
            ValueError: a count below 1, --max-replicas below --replicas, or a target <= 0.
        """
        replicas = server_args.replicas
        if replicas is None or replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {replicas}")
        most = server_args.max_replicas if server_args.max_replicas is not None else replicas
        if most < replicas:
            raise ValueError(f"--max-replicas must be >= --replicas ({replicas}), got {most}")
        threads = server_args.threads_per_replica
        if threads is None:
            threads = max(1, cores // most)
        if threads < 1:
            raise ValueError(f"--threads-per-replica must be >= 1, got {threads}")
        target = None
        if most > replicas:
            target = server_args.target_ongoing_requests
            if target is None:
                target = max_num_seqs
            if not target > 0:
                raise ValueError(f"--target-ongoing-requests must be > 0, got {target}")
        return cls(replicas, most, threads, target)
