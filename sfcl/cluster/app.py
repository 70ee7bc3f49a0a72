"""The Ray Serve application: ingress -> engine replicas, plus the report hub.

``build_app(...)`` assembles it from the same config records ``sfcl serve`` uses
(``sfcl.config``) and a ``ClusterConfig``; ``app_builder(args)`` does the same from a plain dict,
for ``serve run sfcl.cluster.app:app_builder`` and KubeRay's ``RayService``
(``serveConfigV2.applications[].import_path`` + ``args``, see ``deploy/kuberay/rayservice.yaml``)::

    args:
      model: {dtype: auto}                       # ModelConfig fields
      engine: {max_num_seqs: 16}                 # EngineConfig fields
      snapshot: {anchors: /var/cache/sfcl/anchors/current}  # SnapshotConfig fields
      cluster: {replicas: 2, replica_cpus: 4}    # ClusterConfig fields
      server: {default_snapshot_mode: triggered} # IngressSettings fields (api_key: use $SFCL_API_KEY)
"""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from sfcl.cluster.config import ClusterConfig, engine_deployment_options
from sfcl.cluster.ingress import IngressSettings, SfclIngress
from sfcl.cluster.replica import EngineReplica, ReportHub
from sfcl.config import EngineConfig, ModelConfig, SnapshotConfig


def replica_configs(mcfg: ModelConfig, ecfg: EngineConfig, cluster: ClusterConfig) -> tuple[ModelConfig, EngineConfig]:
    """The model and engine configs one replica runs with: torch threads default to the replica's
    reserved CPUs (decode and prefill alike: the HTTP event loop is in the ingress, not here), and a
    replica with a GPU runs on it (Ray sets CUDA_VISIBLE_DEVICES, so it is ``cuda``).
    Raises ValueError for a CUDA device without a GPU reserved per replica."""
    device = mcfg.device
    if cluster.replica_gpus > 0 and device == "cpu":
        device = "cuda"
    if str(device).startswith("cuda") and cluster.replica_gpus <= 0:
        raise ValueError(f"--device {device} with --replicas needs --replica-gpus (e.g. 1: one GPU per replica)")
    threads = mcfg.threads or max(1, int(cluster.replica_cpus))
    return (replace(mcfg, device=device, threads=threads),
            replace(ecfg, prefill_threads=ecfg.prefill_threads or threads))


def build_app(mcfg: ModelConfig, ecfg: EngineConfig, scfg: SnapshotConfig, cluster: ClusterConfig,
              settings: IngressSettings | None = None, shutdown_timeout_s: float = 30.0) -> Application:
    """The Serve application (pass to ``serve.run``). shutdown_timeout_s: how long a stopping
    replica lets its open streams run (Serve's ``graceful_shutdown_timeout_s``)."""
    settings = settings or IngressSettings(default_snapshot_mode=scfg.default_mode)
    settings = replace(settings, router=cluster.router)
    mcfg, ecfg = replica_configs(mcfg, ecfg, cluster)
    opts = engine_deployment_options(cluster, ecfg.max_num_seqs, ecfg.max_waiting)
    opts["request_router_config"] = RequestRouterConfig(**opts["request_router_config"])
    quiet = {"enable_access_log": False}  # the ingress writes the JSON request log; per-call lines are noise
    hub = ReportHub.options(logging_config=quiet).bind()
    engine = EngineReplica.options(**opts, graceful_shutdown_timeout_s=shutdown_timeout_s, logging_config=quiet).bind(
        mcfg, ecfg, scfg, hub, cluster.report_interval_s)
    return SfclIngress.options(graceful_shutdown_timeout_s=shutdown_timeout_s + 5, logging_config=quiet).bind(
        engine, hub, settings)


def _record(cls, values: dict | None):
    """``cls(**values)`` with a clear error for a key that is not one of its fields."""
    values = dict(values or {})
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {', '.join(unknown)}; fields: {', '.join(sorted(names))}")
    return cls(**values)


def configs_from_args(args: dict) -> tuple[ModelConfig, EngineConfig, SnapshotConfig, ClusterConfig, IngressSettings]:
    """The records ``app_builder`` builds from its ``args`` (see the module docstring).
    Raises ValueError on unknown sections or fields and on invalid values."""
    sections = {"model", "engine", "snapshot", "cluster", "server"}
    unknown = sorted(set(args) - sections)
    if unknown:
        raise ValueError(f"unknown argument section(s) {', '.join(unknown)}; expected {', '.join(sorted(sections))}")
    engine = dict(args.get("engine") or {})
    for key in ("priority_tags", "metric_tags"):
        if isinstance(engine.get(key), list):
            engine[key] = tuple(engine[key])
    snapshot = dict(args.get("snapshot") or {})
    if "cache_dir" in snapshot:
        snapshot["cache_dir"] = Path(snapshot["cache_dir"])
    scfg = _record(SnapshotConfig, snapshot)
    settings = _record(IngressSettings, {"default_snapshot_mode": scfg.default_mode, **(args.get("server") or {})})
    return (_record(ModelConfig, args.get("model")), _record(EngineConfig, engine), scfg,
            _record(ClusterConfig, args.get("cluster")), settings)


def app_builder(args: dict) -> Application:
    """Serve application builder for an import path (``sfcl.cluster.app:app_builder``)."""
    mcfg, ecfg, scfg, cluster, settings = configs_from_args(args)
    return build_app(mcfg, ecfg, scfg, cluster, settings)
