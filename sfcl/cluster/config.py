"""Scale-out settings (``sfcl serve --replicas N``) and the Ray Serve deployment options they make.

Pure Python (no Ray import), so the CLI can validate flags before Ray starts. The defaults are
chosen for LLM streams rather than Serve's defaults, which are made for short requests:

* ``target_ongoing_requests`` (autoscaling): Serve's default of 2 would add a replica as soon as
  two streams run, while an engine batches ``max_num_seqs`` streams for little more than the cost
  of one (continuous batching). Default: 3/4 of ``max_num_seqs`` (12 for 16 KV slots), which
  leaves a quarter of the slots as headroom while a new replica loads its model.
* ``max_ongoing_requests`` (per replica): 2 x ``max_num_seqs``. Up to that many requests wait in
  the replica's own engine queue (admitted the moment a KV slot frees, no round trip); beyond it
  they wait in the ingress, where the router decides later, with fresher load and prefix reports.
* ``max_queued_requests`` (ingress side): the engine's ``max_waiting``; beyond it a request is
  refused with 529 (Anthropic) / 429 (OpenAI) and Retry-After, as the single server does.
* upscale after 30 s, downscale after 600 s of sustained load change (Serve's values, kept on
  purpose: a replica start loads a model, so scaling down on a short lull is expensive).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from sfcl.cluster.affinity import AffinityConfig

ROUTERS = ("affinity", "pow2")  # prefix-cache affinity | Ray Serve's power of two choices
AFFINITY_ROUTER = "sfcl.cluster.router:PrefixAffinityRouter"
POW2_ROUTER = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"  # Serve's default
UPSCALE_DELAY_S = 30.0
DOWNSCALE_DELAY_S = 600.0


@dataclass(slots=True)
class ClusterConfig:
    replicas: int = 2  # engine replicas at start (and the fixed count without autoscaling)
    min_replicas: int | None = None  # autoscaling lower bound (None: = replicas)
    max_replicas: int | None = None  # autoscaling upper bound (None: = replicas; > replicas enables autoscaling)
    target_ongoing_requests: float | None = None  # autoscaling target per replica (None: 3/4 of max_num_seqs)
    max_ongoing_requests: int | None = None  # requests one replica takes at once (None: 2 x max_num_seqs)
    replica_cpus: float = 1.0  # Ray CPUs reserved per engine replica (its torch threads default to this)
    replica_gpus: float = 0.0  # Ray GPUs per engine replica (1 = one GPU each; the engine then runs on cuda)
    router: str = "affinity"  # affinity | pow2
    max_queue_gap: int = 4  # affinity: skip the prefix holder when it has this many more ongoing requests
    # than the least loaded replica
    min_match_ratio: float = 0.5  # affinity: follow a holder only when it holds more than this share
    # of the prompt's KV blocks (a shared template header alone does not count)
    routed_ttl_s: float = 60.0  # affinity: how long the router trusts its own record of what it sent
    # where (the replicas' reports take over after that)
    report_interval_s: float = 2.0  # replicas report prefix holdings, health and metrics this often
    ray_address: str | None = None  # join this Ray cluster (None: start a local one)
    app_name: str = "sfcl"  # Serve application name
    route_prefix: str = "/"  # HTTP path prefix of the application on the Serve proxy

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        lo = self.replicas if self.min_replicas is None else self.min_replicas
        hi = self.replicas if self.max_replicas is None else self.max_replicas
        if not 0 <= lo <= self.replicas <= hi:
            raise ValueError(f"need 0 <= min_replicas ({lo}) <= replicas ({self.replicas}) <= max_replicas ({hi})")
        self.min_replicas, self.max_replicas = lo, hi
        if self.target_ongoing_requests is not None and self.target_ongoing_requests <= 0:
            raise ValueError("target_ongoing_requests must be > 0")
        if self.max_ongoing_requests is not None and self.max_ongoing_requests < 1:
            raise ValueError("max_ongoing_requests must be >= 1")
        if self.replica_cpus < 0 or self.replica_gpus < 0 or self.replica_cpus + self.replica_gpus == 0:
            raise ValueError("replica_cpus and replica_gpus must be >= 0, and not both 0")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}")
        self.affinity()  # validates max_queue_gap, min_match_ratio, routed_ttl_s
        if self.report_interval_s <= 0:
            raise ValueError("report_interval_s must be > 0")
        if not self.route_prefix.startswith("/"):
            raise ValueError(f"route_prefix must start with '/', got {self.route_prefix!r}")

    def affinity(self) -> AffinityConfig:
        """The affinity router's settings (ValueError when out of range)."""
        return AffinityConfig(max_queue_gap=self.max_queue_gap, routed_ttl_s=self.routed_ttl_s,
                              min_match_ratio=self.min_match_ratio)

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas != self.max_replicas


def engine_deployment_options(cfg: ClusterConfig, max_num_seqs: int, max_waiting: int) -> dict:
    """``serve.deployment(...).options(**this)`` for the engine replicas (see the module docstring).
    max_num_seqs / max_waiting: the engine's KV slots and waiting-queue bound (``EngineConfig``)."""
    opts: dict = {
        "max_ongoing_requests": cfg.max_ongoing_requests or 2 * max_num_seqs,
        "max_queued_requests": max_waiting,
        "ray_actor_options": {"num_cpus": cfg.replica_cpus, "num_gpus": cfg.replica_gpus},
        "health_check_period_s": 10.0,
        "health_check_timeout_s": 30.0,
        "request_router_config": {
            "request_router_class": AFFINITY_ROUTER if cfg.router == "affinity" else POW2_ROUTER,
            "request_router_kwargs": asdict(cfg.affinity()) if cfg.router == "affinity" else {},
            "request_routing_stats_period_s": cfg.report_interval_s,
            "request_routing_stats_timeout_s": max(10.0, 5 * cfg.report_interval_s),
        },
    }
    if cfg.autoscaling:
        opts["autoscaling_config"] = {
            "min_replicas": cfg.min_replicas, "max_replicas": cfg.max_replicas, "initial_replicas": cfg.replicas,
            "target_ongoing_requests": cfg.target_ongoing_requests or max(1.0, 0.75 * max_num_seqs),
            "upscale_delay_s": UPSCALE_DELAY_S, "downscale_delay_s": DOWNSCALE_DELAY_S,
        }
    else:
        opts["num_replicas"] = cfg.replicas
    return opts
