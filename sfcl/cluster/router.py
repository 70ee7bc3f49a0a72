"""``PrefixAffinityRouter``: Ray Serve's ``RequestRouter`` for the engine replicas.

Runs inside every ``DeploymentHandle`` of the engine deployment (the ingress's). For each call it
reads the prompt's block hashes from the call's ``prefix_hashes`` keyword (computed by the
ingress) and ranks the replica holding the longest cached prefix first
(``sfcl.cluster.affinity.PrefixAffinity``: the replicas' ``record_routing_stats`` reports plus
this router's own record of recent routings), then the power-of-two pair as the fallback rank.
Serve tries the ranks in order and, within one, takes the replica with the shortest queue that
still accepts (``max_ongoing_requests``); so a full holder falls through to the pair, and so does a
holder whose queue exceeds the least loaded replica's by more than ``max_queue_gap``.

Configured with ``RequestRouterConfig(request_router_class="sfcl.cluster.router:PrefixAffinityRouter",
request_router_kwargs={"max_queue_gap": 4, "routed_ttl_s": 60.0, "min_match_ratio": 0.5})``
(``sfcl.cluster.config``).
"""

from __future__ import annotations

from typing import List, Optional

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (LocalityMixin, MultiplexMixin, PendingRequest, ReplicaID,
                                      RequestRouter, RunningReplica)

from sfcl.cluster.affinity import AffinityConfig, PrefixAffinity


def request_hashes(pending_request: PendingRequest | None) -> list[int]:
    """The ``prefix_hashes`` keyword of a call (``ClusterEngine.stream``), else []."""
    if pending_request is None or not pending_request.kwargs:
        return []
    hashes = pending_request.kwargs.get("prefix_hashes")
    return list(hashes) if isinstance(hashes, (list, tuple)) else []


class PrefixAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    # No FIFOMixin: the replica chosen for a request must serve that request, not the oldest one.

    def initialize_state(self, max_queue_gap: int = 4, routed_ttl_s: float = 60.0,
                         min_match_ratio: float = 0.5) -> None:
        self.affinity = PrefixAffinity(AffinityConfig(max_queue_gap=max_queue_gap, routed_ttl_s=routed_ttl_s,
                                                      min_match_ratio=min_match_ratio))
        self._seen_stats: dict[ReplicaID, int] = {}  # replica -> id() of the stats dict last read

    def _read_reports(self, replicas: List[RunningReplica]) -> None:
        for r in replicas:
            stats = r.routing_stats or {}
            if self._seen_stats.get(r.replica_id) != id(stats) and "prefix_hashes" in stats:
                self._seen_stats[r.replica_id] = id(stats)
                self.affinity.report(r.replica_id, stats["prefix_hashes"])

    async def _queue_lens(self, replicas: List[RunningReplica]) -> dict[ReplicaID, int | None]:
        lens = {r.replica_id: self.replica_queue_len_cache.get(r.replica_id) for r in replicas}
        unknown = [r for r in replicas if lens[r.replica_id] is None]
        if unknown:
            for r, q in await self._probe_queue_lens(unknown, 0):
                lens[r.replica_id] = q
        return lens

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        fallback = await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
        hashes = request_hashes(pending_request)
        if not hashes or not fallback:
            return fallback
        self._read_reports(candidate_replicas)
        holder = self.affinity.choose(hashes, await self._queue_lens(candidate_replicas))
        if holder is None or holder not in self._replicas:
            return fallback
        return [[self._replicas[holder]], *fallback]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        hashes = request_hashes(pending_request)
        if hashes:
            self.affinity.routed(replica_id, hashes)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.affinity.forget(replica_id)
        self._seen_stats.pop(replica_id, None)

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        gone = set(self._replicas) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        for replica_id in gone:
            self.affinity.forget(replica_id)
            self._seen_stats.pop(replica_id, None)
