"""``sfcl serve --replicas N``: start (or join) a Ray cluster, deploy the application, wait, stop.

The process is the Ray driver. It starts a local Ray cluster unless ``ClusterConfig.ray_address``
names one (``auto`` or ``ray://host:10001``), starts Serve's HTTP proxy on ``host:port``, deploys
``sfcl.cluster.app.build_app`` and waits for SIGTERM / SIGINT; then it deletes the application
(each replica first lets its open streams run for ``shutdown_timeout_s``) and, if it started the
cluster, stops it.

Logs: replicas' stdout and stderr are forwarded to this process's stdout and stderr without Ray's
``(name pid=...)`` prefix (``RAY_DISABLE_WORKER_LOG_PREFIX=1``, set before Ray is imported), so
stdout carries the ingress's JSON request lines and stderr the ``[ANCHOR]`` / ``[ENGINE]``
diagnostics, as with the single server.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path

from sfcl.cluster.config import ClusterConfig
from sfcl.config import EngineConfig, ModelConfig, SnapshotConfig

# Ray reads these when it is imported (ray._private.ray_constants): set them first.
RAY_LOG_ENV = {"RAY_DISABLE_WORKER_LOG_PREFIX": "1", "RAY_DEDUP_LOGS": "0", "RAY_COLOR_PREFIX": "0"}


def cluster_log(msg: str) -> None:
    print(f"[CLUSTER] {msg}", file=sys.stderr, flush=True)


class HubCollector:
    """Prometheus collector for ``--metrics-port``: the replicas' series from the report hub."""

    def __init__(self, hub):
        self._hub = hub

    def collect(self):
        from sfcl.cluster.reports import merge_families

        try:
            reports = self._hub.collect.remote().result(timeout_s=10.0)
        except Exception as e:  # a scrape during a hub restart: empty, not an HTTP 500 loop
            cluster_log(f"metrics: report hub unavailable: {e}")
            return []
        return merge_families(reports)


def absolute_paths(mcfg: ModelConfig, scfg: SnapshotConfig) -> tuple[ModelConfig, SnapshotConfig]:
    """Relative paths made absolute: replicas run in other processes (and, on a cluster, other
    machines that mount the same paths), whose working directory is not this one's."""
    def resolve(p: str | None) -> str | None:
        return str(Path(p).expanduser().resolve()) if p and Path(p).expanduser().exists() else p

    return (replace(mcfg, model=resolve(mcfg.model)),
            replace(scfg, anchors=resolve(scfg.anchors), keyword_boost=resolve(scfg.keyword_boost),
                    cache_dir=scfg.cache_dir.expanduser().resolve()))


def check_local_resources(cluster: ClusterConfig, resources: dict) -> None:
    """A local cluster cannot add machines: refuse replicas that would never be scheduled (Serve
    would wait for them forever). Raises ValueError with what fits."""
    cpus, gpus = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
    need_cpu, need_gpu = cluster.replicas * cluster.replica_cpus, cluster.replicas * cluster.replica_gpus
    if need_cpu > cpus + 1e-9 or need_gpu > gpus + 1e-9:
        raise ValueError(f"{cluster.replicas} replicas x {cluster.replica_cpus:g} CPU / {cluster.replica_gpus:g} GPU "
                         f"need {need_cpu:g} CPUs and {need_gpu:g} GPUs; this machine's local Ray cluster has "
                         f"{cpus:g} and {gpus:g}: lower --replica-cpus / --replica-gpus or --replicas, or join a "
                         "larger cluster with --ray-address")


def serve_cluster(mcfg: ModelConfig, ecfg: EngineConfig, scfg: SnapshotConfig, cluster: ClusterConfig, *,
                  host: str, port: int, api_key: str | None, metrics_port: int | None = None,
                  shutdown_timeout_s: float = 30.0) -> int:
    """Run until SIGTERM / SIGINT; returns the exit code (0)."""
    for k, v in RAY_LOG_ENV.items():
        os.environ.setdefault(k, v)
    try:
        import ray
        from ray import serve
        from ray.serve.config import HTTPOptions
    except ImportError as e:
        raise ValueError(f"--replicas needs Ray Serve: pip install 'sfcl[ray]' ({e})") from None

    from sfcl.cluster.app import build_app
    from sfcl.cluster.ingress import IngressSettings

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address=cluster.ray_address, logging_level=logging.WARNING, include_dashboard=False,
                 log_to_driver=True)
    if started_ray and cluster.ray_address is None:
        check_local_resources(cluster, ray.cluster_resources())
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options=HTTPOptions(host=host, port=port),
                    logging_config={"log_level": "WARNING", "enable_access_log": False})
        mcfg, scfg = absolute_paths(mcfg, scfg)
        settings = IngressSettings(api_key=api_key, default_snapshot_mode=scfg.default_mode)
        app = build_app(mcfg, ecfg, scfg, cluster, settings, shutdown_timeout_s)
        cluster_log(f"deploying {cluster.replicas} engine replica(s) ({cluster.router} router); "
                    "each loads the model ...")
        serve.run(app, name=cluster.app_name, route_prefix=cluster.route_prefix, blocking=False)
        if metrics_port:
            from prometheus_client import CollectorRegistry, start_http_server

            registry = CollectorRegistry()
            registry.register(HubCollector(serve.get_deployment_handle("ReportHub", app_name=cluster.app_name)))
            start_http_server(metrics_port, addr=host, registry=registry)
        prefix = cluster.route_prefix.rstrip("/")
        print(f"sfcl: serving on http://{host}:{port}{prefix} with {cluster.replicas} engine replica(s) "
              f"(Ray Serve, {cluster.router} router)", file=sys.stderr, flush=True)
        while not stop.wait(1.0):
            pass
        cluster_log(f"shutting down; open streams get {shutdown_timeout_s:g} s to finish")
        serve.delete(cluster.app_name)
    finally:
        if started_ray:
            if cluster.ray_address is None:
                serve.shutdown()
            ray.shutdown()
    return 0
