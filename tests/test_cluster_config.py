"""sfcl.cluster.config: flag validation and the Serve deployment options (no Ray needed)."""

from __future__ import annotations

import pytest

from sfcl.cluster.config import AFFINITY_ROUTER, POW2_ROUTER, ClusterConfig, engine_deployment_options


def test_fixed_replica_count_without_autoscaling():
    opts = engine_deployment_options(ClusterConfig(replicas=3, replica_cpus=2), max_num_seqs=16, max_waiting=256)
    assert opts["num_replicas"] == 3 and "autoscaling_config" not in opts
    assert opts["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 0.0}
    assert opts["max_ongoing_requests"] == 32  # 2 x KV slots: the rest waits in the ingress
    assert opts["max_queued_requests"] == 256  # beyond it: 529 / 429 as the single server
    rr = opts["request_router_config"]
    assert rr["request_router_class"] == AFFINITY_ROUTER
    assert rr["request_router_kwargs"] == {"max_queue_gap": 4, "routed_ttl_s": 60.0, "min_match_ratio": 0.5}
    assert rr["request_routing_stats_period_s"] == 2.0


def test_autoscaling_defaults_are_sized_for_llm_streams():
    opts = engine_deployment_options(ClusterConfig(replicas=2, min_replicas=1, max_replicas=8), 16, 256)
    auto = opts["autoscaling_config"]
    assert "num_replicas" not in opts
    assert (auto["min_replicas"], auto["initial_replicas"], auto["max_replicas"]) == (1, 2, 8)
    assert auto["target_ongoing_requests"] == 12  # 3/4 of 16 KV slots, not Serve's 2
    assert (auto["upscale_delay_s"], auto["downscale_delay_s"]) == (30.0, 600.0)
    explicit = engine_deployment_options(ClusterConfig(replicas=1, max_replicas=4, target_ongoing_requests=5,
                                                       max_ongoing_requests=7, router="pow2"), 16, 64)
    assert explicit["autoscaling_config"]["target_ongoing_requests"] == 5
    assert explicit["max_ongoing_requests"] == 7
    assert explicit["request_router_config"]["request_router_class"] == POW2_ROUTER
    assert explicit["request_router_config"]["request_router_kwargs"] == {}


def test_gpu_replicas_reserve_one_gpu_each():
    opts = engine_deployment_options(ClusterConfig(replicas=2, replica_cpus=4, replica_gpus=1), 64, 256)
    assert opts["ray_actor_options"] == {"num_cpus": 4, "num_gpus": 1}


@pytest.mark.parametrize("kwargs", [
    {"replicas": 0}, {"replicas": 2, "min_replicas": 3}, {"replicas": 3, "max_replicas": 2},
    {"target_ongoing_requests": 0}, {"max_ongoing_requests": 0}, {"replica_cpus": 0, "replica_gpus": 0},
    {"replica_cpus": -1}, {"router": "random"}, {"max_queue_gap": -1}, {"min_match_ratio": 1.5},
    {"report_interval_s": 0}, {"route_prefix": "v1"},
])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        ClusterConfig(**kwargs)


def test_scale_out_flags_reach_the_config():
    from sfcl.cli import build_parser

    a = build_parser().parse_args(["serve", "--replicas", "2", "--min-replicas", "1", "--max-replicas", "4",
                                   "--target-ongoing-requests", "6", "--replica-cpus", "0.5", "--router", "pow2",
                                   "--ray-address", "auto", "--min-match-ratio", "0.25"])
    assert (a.replicas, a.min_replicas, a.max_replicas, a.target_ongoing_requests) == (2, 1, 4, 6.0)
    assert (a.replica_cpus, a.router, a.ray_address, a.min_match_ratio) == (0.5, "pow2", "auto", 0.25)
    assert build_parser().parse_args(["serve"]).replicas is None  # the single server stays the default
