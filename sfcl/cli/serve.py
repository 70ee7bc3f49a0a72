"""``sfcl serve``: the HTTP server (Anthropic Messages + OpenAI Chat Completions) under uvicorn,
with SIGHUP reloading the anchor library and SIGTERM draining open streams."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from sfcl.cli.flags import FMT, add_model_flags, add_snapshot_flags, configs, port


def add_parser(sub) -> None:
    """Add ``serve`` to the top-level subparsers ``sub``."""
    s = sub.add_parser("serve", help="run the HTTP server (Anthropic Messages + OpenAI Chat Completions)", **FMT)
    add_model_flags(s)
    add_snapshot_flags(s)
    s.add_argument("--host", default="127.0.0.1", help="bind address")
    s.add_argument("--port", type=port, default=8000, help="TCP port")
    s.add_argument("--api-key", default=None, help="require this key (x-api-key or Bearer); or set SFCL_API_KEY")
    s.add_argument("--log-level", default="warning", help="uvicorn log level")
    s.add_argument("--metrics-port", type=port, default=None,
                   help="also serve /metrics on this port without the API key (for a scraper on a private network)")
    s.add_argument("--keyword-boost", default=None, metavar="FILE.json",
                   help="keyword-boost rules added to the library's own: a JSON list of {\"keywords\": [...], "
                        "\"kinds\": [\"domain\"], \"multiplier\": 1.5}")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds open streams may run after SIGTERM before they are ended with an overloaded_error event")
    # -- scale-out on Ray Serve (sfcl.cluster; extra sfcl[ray]); docs/scale-out.md --------------
    r = s.add_argument_group("scale-out (Ray Serve)")
    r.add_argument("--replicas", type=int, default=None,
                   help="serve through Ray Serve with this many engine replicas (each its own model copy) behind "
                        "one endpoint, routed by prefix-cache affinity; unset: a single in-process engine")
    r.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (auto, or ray://HOST:10001) instead of starting a local one")
    r.add_argument("--min-replicas", type=int, default=None,
                   help="autoscaling lower bound (default: --replicas); autoscaling is on when it differs from --max-replicas")
    r.add_argument("--max-replicas", type=int, default=None, help="autoscaling upper bound (default: --replicas)")
    r.add_argument("--target-ongoing-requests", type=float, default=None,
                   help="autoscaling target of ongoing requests per replica (default: 3/4 of --max-num-seqs)")
    r.add_argument("--max-ongoing-requests", type=int, default=None,
                   help="requests one replica takes at once; more wait in the ingress (default: 2 x --max-num-seqs)")
    r.add_argument("--replica-cpus", type=float, default=1.0,
                   help="Ray CPUs per engine replica (its torch threads default to this)")
    r.add_argument("--replica-gpus", type=float, default=0.0, help="Ray GPUs per engine replica (1: one GPU each, on cuda)")
    r.add_argument("--router", default="affinity", choices=["affinity", "pow2"],
                   help="affinity: the replica holding the longest cached prefix of the prompt, else the less loaded "
                        "of two random ones; pow2: Ray Serve's power of two choices only")
    r.add_argument("--max-queue-gap", type=int, default=4,
                   help="affinity: skip the prefix holder when it has this many more ongoing requests than the least "
                        "loaded replica")
    r.add_argument("--min-match-ratio", type=float, default=0.5,
                   help="affinity: follow the prefix holder only when it holds more than this share of the prompt's "
                        "KV blocks (a shared chat-template header alone does not count)")
    r.add_argument("--routed-ttl", type=float, default=60.0,
                   help="affinity: seconds the router trusts its own record of where it sent a prefix; the replicas' "
                        "reports (every --report-interval) cover the rest")
    r.add_argument("--report-interval", type=float, default=2.0,
                   help="seconds between replica reports (prefix holdings, health, metrics)")
    r.add_argument("--app-name", default="sfcl", help="Ray Serve application name")
    r.add_argument("--route-prefix", default="/", help="HTTP path prefix of the application on the Ray Serve proxy")
    s.set_defaults(fn=cmd_serve)


def cmd_serve(a: argparse.Namespace) -> int:
    import uvicorn

    from sfcl.engine.host_memory import freeze_startup_objects, return_freed_memory
    from sfcl.engine_stack import build_engine
    from sfcl.server.app import create_app

    mc, ec, sc = configs(a)
    if sc.keyword_boost:
        from sfcl.snapshot.boost import load_rules

        load_rules(sc.keyword_boost)  # a bad rule file fails before the model loads (ValueError: exit 2)
    api_key = a.api_key or os.environ.get("SFCL_API_KEY") or None
    if a.replicas is not None:  # scale-out on Ray Serve (sfcl.cluster)
        from sfcl.cluster.config import ClusterConfig
        from sfcl.cluster.launch import serve_cluster

        cluster = ClusterConfig(
            replicas=a.replicas, min_replicas=a.min_replicas, max_replicas=a.max_replicas,
            target_ongoing_requests=a.target_ongoing_requests, max_ongoing_requests=a.max_ongoing_requests,
            replica_cpus=a.replica_cpus, replica_gpus=a.replica_gpus, router=a.router,
            max_queue_gap=a.max_queue_gap, min_match_ratio=a.min_match_ratio, routed_ttl_s=a.routed_ttl,
            report_interval_s=a.report_interval, ray_address=a.ray_address, app_name=a.app_name,
            route_prefix=a.route_prefix)
        return serve_cluster(mc, ec, sc, cluster, host=a.host, port=a.port, api_key=api_key,
                             metrics_port=a.metrics_port, shutdown_timeout_s=a.shutdown_timeout)
    built = build_engine(mc, ec, sc)
    app = create_app(built.engine, api_key=api_key, default_snapshot_mode=sc.default_mode)
    if a.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(a.metrics_port, addr=a.host, registry=built.engine.metrics.registry)
    print(f"sfcl: serving {built.lm.name} on http://{a.host}:{a.port} "
          f"(snapshots: {'on, ' + str(built.library.n_anchors) + ' anchors' if built.library else 'off'})",
          file=sys.stderr, flush=True)
    built.library = None  # the engine owns the library now: a reload must be able to release it

    def reload_on_sighup(sig, frame) -> None:  # like POST /admin/anchors/reload, from the configured path
        def work() -> None:
            try:
                info = built.engine.reload_anchors(None)
                print(f"[ANCHOR] reloaded {info['path']} (version {info['version']}, {info['n_anchors']} anchors)",
                      file=sys.stderr, flush=True)
            except Exception as e:  # the old library stays in use
                print(f"[ANCHOR] reload refused, the current library stays: {e}", file=sys.stderr, flush=True)
        threading.Thread(target=work, name="sfcl-reload", daemon=True).start()

    signal.signal(signal.SIGHUP, reload_on_sighup)
    # Graceful shutdown: on SIGTERM/SIGINT uvicorn stops accepting and waits for open streams;
    # after --shutdown-timeout, or at a second signal, the engine ends whatever still runs with an
    # overloaded_error event (a well-formed end that says the answer was cut, so clients retry), and
    # the process exits 0 (130 after Ctrl-C). A third signal is uvicorn's forced exit (tasks cancelled
    # mid-stream).
    server = uvicorn.Server(uvicorn.Config(app, host=a.host, port=a.port, log_level=a.log_level, access_log=False,
                                           timeout_graceful_shutdown=a.shutdown_timeout + 5))
    uvicorn_exit = server.handle_exit

    # sse-starlette would cut every open stream at the first signal; we drain them ourselves.
    from sse_starlette.sse import AppStatus

    AppStatus.disable_automatic_graceful_drain()

    def past_deadline() -> None:
        built.engine.cut_all()  # streams end with an error event: overloaded_error, 'retry'
        t2 = threading.Timer(3.0, lambda: setattr(AppStatus, "should_exit", True))  # safety net
        t2.daemon = True
        t2.start()

    deadline = threading.Timer(a.shutdown_timeout, past_deadline)
    deadline.daemon = True
    signals_seen = [0, None]  # how many, and the first one

    def handle_exit(sig, frame) -> None:
        signals_seen[0] += 1
        if signals_seen[0] == 1:
            signals_seen[1] = sig
            print(f"sfcl: shutting down; open streams get {a.shutdown_timeout:g} s to finish (a second signal ends "
                  f"them now)", file=sys.stderr, flush=True)
            deadline.start()
            uvicorn_exit(sig, frame)
        elif signals_seen[0] == 2:  # Ctrl-C again: end the streams now, each with its error event, and exit
            print("sfcl: second signal: ending open streams now (a third one forces the exit)", file=sys.stderr,
                  flush=True)
            deadline.cancel()
            past_deadline()
        else:  # uvicorn's forced exit: open tasks are cancelled
            uvicorn_exit(sig, frame)

    server.handle_exit = handle_exit
    # uvicorn re-raises the captured signal after its graceful shutdown, into whatever handler was
    # installed before it started; a no-op SIGTERM handler there turns that into a clean exit 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    freeze_startup_objects()  # no later collection walks the start-up objects (sfcl.engine.host_memory)
    return_freed_memory()  # what loading freed (conversion, index build) goes back to the kernel
    try:
        server.run()
    finally:
        built.engine.shutdown()
    # uvicorn re-raises a captured SIGINT (KeyboardInterrupt: 130 in sfcl.cli.main), but a process
    # started with SIGINT ignored (a background job of a non-interactive shell) keeps ignoring it
    return 130 if signals_seen[1] == signal.SIGINT else 0
