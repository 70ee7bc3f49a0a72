"""sfcl.cluster.launch: what the CLI's cluster path hands to replicas in other processes."""

from __future__ import annotations

from pathlib import Path

from sfcl.cluster.launch import RAY_LOG_ENV, absolute_paths
from sfcl.config import ModelConfig, SnapshotConfig


def test_local_relative_paths_become_absolute(tmp_path, monkeypatch):
    (tmp_path / "lib").mkdir()
    (tmp_path / "rules.json").write_text("[]")
    monkeypatch.chdir(tmp_path)
    m, s = absolute_paths(ModelConfig(model=None), SnapshotConfig(anchors="lib", keyword_boost="rules.json",
                                                                  cache_dir=Path("cache")))
    assert s.anchors == str(tmp_path / "lib") and s.keyword_boost == str(tmp_path / "rules.json")
    assert s.cache_dir == tmp_path / "cache" and m.model is None
    # a path that only exists on the cluster's machines is left as given
    _, s2 = absolute_paths(ModelConfig(), SnapshotConfig(anchors="/mnt/anchors/current"))
    assert s2.anchors == "/mnt/anchors/current"


def test_worker_logs_reach_this_process_without_rays_prefix():
    """stdout must stay one bare JSON object per line (the ingress's request log)."""
    assert RAY_LOG_ENV["RAY_DISABLE_WORKER_LOG_PREFIX"] == "1" and RAY_LOG_ENV["RAY_DEDUP_LOGS"] == "0"


def test_replicas_that_a_local_cluster_cannot_schedule_are_refused():
    import pytest

    from sfcl.cluster.config import ClusterConfig
    from sfcl.cluster.launch import check_local_resources

    check_local_resources(ClusterConfig(replicas=4, replica_cpus=0.5), {"CPU": 2.0})  # fits exactly
    with pytest.raises(ValueError, match="need 4 CPUs"):
        check_local_resources(ClusterConfig(replicas=2, replica_cpus=2), {"CPU": 2.0})
    with pytest.raises(ValueError, match="GPU"):
        check_local_resources(ClusterConfig(replicas=2, replica_gpus=1), {"CPU": 16.0, "GPU": 1.0})
