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
                   help="seconds open streams may run after SIGTERM before they are ended with a stop event")
    s.set_defaults(fn=cmd_serve)


def cmd_serve(a: argparse.Namespace) -> int:
    import uvicorn

    from sfcl.server.app import create_app
    from sfcl.serving import build_engine

    mc, ec, sc = configs(a)
    if sc.keyword_boost:
        from sfcl.snapshot.boost import load_rules

        load_rules(sc.keyword_boost)  # a bad rule file fails before the model loads (ValueError: exit 2)
    built = build_engine(mc, ec, sc)
    api_key = a.api_key or os.environ.get("SFCL_API_KEY") or None
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
    # after --shutdown-timeout the engine ends whatever still runs with a proper stop event
    # (stop_reason max_tokens), so clients see a well-formed end, and the process exits 0.
    server = uvicorn.Server(uvicorn.Config(app, host=a.host, port=a.port, log_level=a.log_level, access_log=False,
                                           timeout_graceful_shutdown=a.shutdown_timeout + 5))
    uvicorn_exit = server.handle_exit

    # sse-starlette would cut every open stream at the first signal; we drain them ourselves.
    from sse_starlette.sse import AppStatus

    AppStatus.disable_automatic_graceful_drain()

    def past_deadline() -> None:
        built.engine.finish_all()  # streams end with message_delta/message_stop, [DONE]
        t2 = threading.Timer(3.0, lambda: setattr(AppStatus, "should_exit", True))  # safety net
        t2.daemon = True
        t2.start()

    def handle_exit(sig, frame) -> None:
        if not server.should_exit:
            print(f"sfcl: shutting down; open streams get {a.shutdown_timeout:g} s to finish", file=sys.stderr,
                  flush=True)
            t = threading.Timer(a.shutdown_timeout, past_deadline)
            t.daemon = True
            t.start()
        uvicorn_exit(sig, frame)

    server.handle_exit = handle_exit
    # uvicorn re-raises the captured signal after its graceful shutdown, into whatever handler was
    # installed before it started; a no-op SIGTERM handler there turns that into a clean exit 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    finally:
        built.engine.shutdown()
    return 0
