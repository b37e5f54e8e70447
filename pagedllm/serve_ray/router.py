"""``PrefixAwareRequestRouter``: a Serve request router that sends a prompt where its prefix is
cached, unless that replica is overloaded, else to the least-loaded replica.

Serve's default router (power of two choices) picks two random replicas and takes the shorter
queue: blind to the prefix cache, it spreads requests that share a system prompt over every
replica, and each replica computes that prompt again. This router (Ray 2.60's
``ray.serve.request_router.RequestRouter`` API; set with ``RequestRouterConfig``) decides per
request from:

- the request's prefix keys (``prefix_index.prefix_block_hashes``, computed by the ingress and
  passed as the ``prefix_hashes`` argument of ``EngineReplica.generate``);
- what each replica holds: the keys it reported (``record_routing_stats``, delivered by Serve's
  controller every ``request_routing_stats_period_s``) and the keys this router sent it since
  (``PrefixIndex``, bounded like the replica's own), so a prompt's second request follows the
  first at once rather than a report period later;
- each replica's load: requests this router has in flight on it (counted from
  ``on_request_routed`` to ``on_request_completed``), Serve's probed queue length when it is
  larger, and the reported waiting queue and KV cache usage.

Policy, in order:

1. the replica matching the most leading blocks (at least ``min_match_blocks``), unless it is
   overloaded: more than ``max_imbalance`` requests above the least-loaded replica (in flight,
   or waiting in its engine), or KV usage at ``kv_usage_limit`` while another replica is below;
2. otherwise, the least-loaded replicas: fewest requests in flight plus waiting, among those
   whose KV usage is below ``kv_usage_limit`` if any (Serve then probes them and takes the
   shortest queue).

The first rank returned holds the choice of step 1 alone, the second the least loaded, so that a
replica refusing the request (full, ``max_ongoing_requests``) falls through to step 2.
"""

from __future__ import annotations

import logging
import random
from typing import Any, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedllm.serve_ray.prefix_index import PrefixIndex, leading_matches

logger = logging.getLogger(__name__)


class PrefixAwareRequestRouter(RequestRouter):
    """See the module docstring. ``request_router_kwargs`` go to ``initialize_state``."""

    def initialize_state(self, max_imbalance: int = 4, kv_usage_limit: float = 0.9,
                         min_match_blocks: int = 1, max_tracked_blocks: int = 4096) -> None:
        """Args:
            max_imbalance: requests (in flight or waiting) by which the prefix holder may
                exceed the least-loaded replica and still get the request.
            kv_usage_limit: KV cache usage (0-1) at which the prefix holder counts as full
                when another replica is below it.
            min_match_blocks: fewest leading blocks a replica must hold to be preferred.
            max_tracked_blocks: keys remembered per replica of what this router sent.

        Raises:
            ValueError: a negative imbalance, a usage limit outside (0, 1], ``min_match_blocks``
                or ``max_tracked_blocks`` < 1.
        """
        if max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {max_imbalance}")
        if not 0 < kv_usage_limit <= 1:
            raise ValueError(f"kv_usage_limit must be in (0, 1], got {kv_usage_limit}")
        if min_match_blocks < 1:
            raise ValueError(f"min_match_blocks must be >= 1, got {min_match_blocks}")
        if max_tracked_blocks < 1:
            raise ValueError(f"max_tracked_blocks must be >= 1, got {max_tracked_blocks}")
        self.max_imbalance = max_imbalance
        self.kv_usage_limit = kv_usage_limit
        self.min_match_blocks = min_match_blocks
        self.max_tracked_blocks = max_tracked_blocks
        self._sent: dict[ReplicaID, PrefixIndex] = {}
        self._in_flight: dict[ReplicaID, int] = {}
        self._reported: dict[ReplicaID, tuple[int, frozenset]] = {}  # id(report list), its keys as a set
        self.decisions = {"prefix": 0, "least_loaded": 0, "overloaded": 0}

    # ------------------------------------------------------------------------------ state
    def _reported_keys(self, replica: RunningReplica) -> frozenset:
        keys = (replica.routing_stats or {}).get("prefix_hashes") or []
        cached = self._reported.get(replica.replica_id)
        if cached is None or cached[0] != id(keys):
            cached = (id(keys), frozenset(keys))
            self._reported[replica.replica_id] = cached
        return cached[1]

    def _load(self, replica: RunningReplica) -> tuple[int, int, float]:
        """``(requests in flight, waiting in its engine, KV usage)``."""
        stats = replica.routing_stats or {}
        queued = self.replica_queue_len_cache.get(replica.replica_id) or 0
        in_flight = max(self._in_flight.get(replica.replica_id, 0), queued)
        return in_flight, int(stats.get("waiting", 0)), float(stats.get("kv_cache_usage", 0.0))

    def _overloaded(self, load: tuple[int, int, float], loads: list[tuple[int, int, float]]) -> bool:
        in_flight, waiting, kv_usage = load
        if in_flight - min(other[0] for other in loads) > self.max_imbalance:
            return True
        if waiting - min(other[1] for other in loads) > self.max_imbalance:
            return True
        return kv_usage >= self.kv_usage_limit and any(other[2] < self.kv_usage_limit for other in loads)

    # ------------------------------------------------------------------------------ Serve hooks
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        loads = {r.replica_id: self._load(r) for r in candidate_replicas}
        # Least loaded: fewest in flight + waiting, among those whose KV cache has room if any.
        roomy = [r for r in candidate_replicas if loads[r.replica_id][2] < self.kv_usage_limit] or candidate_replicas
        least = min(sum(loads[r.replica_id][:2]) for r in roomy)
        least_loaded = [r for r in roomy if sum(loads[r.replica_id][:2]) == least]
        random.shuffle(least_loaded)
        keys = _prefix_keys(pending_request)
        if keys:
            best, best_match = None, 0
            for replica in candidate_replicas:
                sent = self._sent.get(replica.replica_id)
                match = max(sent.match(keys) if sent is not None else 0,
                            leading_matches(keys, self._reported_keys(replica)))
                if match > best_match or (match == best_match and best is not None and match
                                          and sum(loads[replica.replica_id][:2]) < sum(loads[best.replica_id][:2])):
                    best, best_match = replica, match
            if best is not None and best_match >= self.min_match_blocks:
                if not self._overloaded(loads[best.replica_id], list(loads.values())):
                    self.decisions["prefix"] += 1
                    return [[best], [r for r in least_loaded if r is not best] or [best]]
                self.decisions["overloaded"] += 1
        self.decisions["least_loaded"] += 1
        return [least_loaded]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._in_flight[replica_id] = self._in_flight.get(replica_id, 0) + 1
        keys = _prefix_keys(pending_request)
        if keys:
            sent = self._sent.get(replica_id)
            if sent is None:
                sent = self._sent[replica_id] = PrefixIndex(self.max_tracked_blocks)
            sent.add(keys)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._in_flight.get(replica_id, 0) > 0:
            self._in_flight[replica_id] -= 1

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._forget_except({r.replica_id for r in replicas})

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget_except(set(self._replica_id_set))

    def _forget_except(self, live: set) -> None:
        """Drop what is known of replicas that are gone (a replacement starts with an empty cache)."""
        for table in (self._sent, self._in_flight, self._reported):
            for replica_id in [r for r in table if r not in live]:
                del table[replica_id]


def _prefix_keys(pending_request: Optional[PendingRequest]) -> tuple[int, ...]:
    if pending_request is None:
        return ()
    return tuple(pending_request.kwargs.get("prefix_hashes") or ())
