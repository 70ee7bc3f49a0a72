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
