"""Command line: ``sfcl serve``, ``sfcl generate``, ``sfcl anchors build``.

Flags map 1:1 onto the config records in ``sfcl.config``; every flag has help text. Errors that a
user can fix (missing model, damaged anchor library, bad corpus) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading
from pathlib import Path

from sfcl.engine.events import SNAPSHOT_MODES
from sfcl.config import DTYPE_CHOICES


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="model: a .gguf file or a local HF model folder (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="weights/activations dtype: auto (default) = bfloat16 where the CPU runs it natively "
                        "(AVX-512 BF16 / AMX, confirmed by a start-up GEMM probe; bf16 on CUDA), float32 elsewhere "
                        "(an AVX2-only CPU runs bf16 GEMMs 30-47x slower than fp32); the choice is logged on stderr")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:0)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for the engine (serve: for decode steps, default cores - 1 so the HTTP "
                        "event loop keeps a core; other commands: default torch's)")
    p.add_argument("--cache-dir", default=None,
                   help="cache for converted weights and the default anchor library "
                        "(default $SFCL_CACHE_DIR or ~/.cache/sfcl; put it on local SSD)")


def _add_snapshot_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--anchors", default=None,
                   help="anchor library directory (default: built once from the bundled sample corpus)")
    p.add_argument("--snapshot-mode", default="triggered", choices=SNAPSHOT_MODES,
                   help="default snapshot mode for requests that do not set one")
    p.add_argument("--anchor-timeout", type=float, default=120.0, help="seconds allowed to load the library")
    p.add_argument("--anchor-retry", type=int, default=3, help="library load attempts before giving up")
    p.add_argument("--anchor-optional", action="store_true",
                   help="start with snapshots disabled if the library cannot be loaded (default: exit)")
    p.add_argument("--layer", type=int, default=None, help="snapshot layer of the default library (default: 3/4 depth)")
    p.add_argument("--steer-lambda-max", type=float, default=0.5,
                   help="steering requests: kNN-LM interpolation weight at snapshot confidence 1 (0..1)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="largest decode batch (KV slots)")
    p.add_argument("--max-model-len", type=int, default=None, help="context window cap in tokens (default: model's)")
    p.add_argument("--max-waiting", type=int, default=256, help="waiting-queue bound; beyond it 529/429")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="tokens per engine step (decode rows + one prompt chunk): smaller = steadier streams "
                        "while long prompts prefill, larger = faster prefill")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="KV cache storage: auto = model dtype; int8 = block-wise INT8 (0.54x memory, KIVI-style)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run decode eagerly instead of replaying captured CUDA graphs (CPU: always eager)")
    p.add_argument("--weight-quant", default="none", choices=["none", "int8", "int4"],
                   help="weight-only quantized linears (CPU): int8 per-channel or int4 group-32; packed kernels "
                        "for decode batches of <= 6 rows, the bf16 weights above (faster single-stream decode)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (prefix cache, INT8 scales)")
    p.add_argument("--prefix-cache-tokens", type=int, default=32768,
                   help="prefix KV cache capacity in tokens (0 disables prefix caching)")
    p.add_argument("--prefill-threads", type=int, default=None,
                   help="torch threads for steps computing >= 64 prompt tokens (default: all cores)")
    p.add_argument("--sync-lookup", action="store_true",
                   help="CPU: run every anchor search inside its step, so a snapshot event precedes its token's "
                        "text (default: a step's search runs on a lookup thread during the next step and its events "
                        "follow their tokens; a step whose search includes a steering request searches in the step)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile (Inductor) the decode step: fuses the per-layer element-wise ops; "
                        "compiles at startup, about 5 min on 2 cores the first time (Inductor caches code under /tmp, so restarts take ~35 s); "
                        "needs a C++ compiler on CPU; combines with --weight-quant; not with --kv-cache-dtype int8")
    p.add_argument("--priority-tags", default="", help="comma-separated x-sfcl-tag values admitted first (e.g. high-risk)")
    p.add_argument("--metric-tags", default="high-risk", help="comma-separated tags kept as metric labels (others: other)")
    p.add_argument("--price-per-hour", type=float, default=0.0, help="device price in $/hour for the cost metrics")


def _port(text: str) -> int:
    """argparse type: a TCP port (uvicorn hangs instead of failing on one out of range)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0-65535, got {port}")
    return port


def _csv(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in (text or "").split(",") if t.strip())


def _configs(a):
    from sfcl.config import EngineConfig, ModelConfig, SnapshotConfig, default_cache_dir

    mc = ModelConfig(model=a.model, dtype=a.dtype, device=a.device, threads=a.threads,
                     weight_quant=getattr(a, "weight_quant", "none"))
    ec = EngineConfig(max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len, max_waiting=a.max_waiting,
                      priority_tags=_csv(a.priority_tags), metric_tags=_csv(a.metric_tags),
                      price_per_hour=a.price_per_hour, max_num_batched_tokens=a.max_num_batched_tokens,
                      kv_cache_dtype=a.kv_cache_dtype, block_size=a.block_size,
                      prefix_cache_tokens=a.prefix_cache_tokens, compile=getattr(a, "compile", False),
                      enforce_eager=getattr(a, "enforce_eager", False),
                      prefill_threads=getattr(a, "prefill_threads", None),
                      overlap_lookup=not getattr(a, "sync_lookup", False))
    sc = SnapshotConfig(anchors=a.anchors, default_mode=a.snapshot_mode, anchor_timeout_s=a.anchor_timeout,
                        anchor_retry=a.anchor_retry, anchor_optional=a.anchor_optional, layer=a.layer,
                        keyword_boost=getattr(a, "keyword_boost", None), steer_lambda_max=a.steer_lambda_max,
                        cache_dir=Path(a.cache_dir) if a.cache_dir else default_cache_dir())
    return mc, ec, sc


def cmd_serve(a) -> int:
    import uvicorn

    from sfcl.server.app import create_app
    from sfcl.serving import build_engine

    mc, ec, sc = _configs(a)
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


def cmd_generate(a) -> int:
    from sfcl.engine.events import ErrorEvent, Finished, SnapshotEvent, TextDelta
    from sfcl.engine.request import SamplingParams
    from sfcl.serving import build_engine

    mc, ec, sc = _configs(a)
    content = a.prompt
    if a.document:  # read the document before loading the model: a bad path or id fails fast
        from sfcl.anchors.corpus import CorpusError, read_corpus

        docs = read_corpus([a.document])
        # ids may be given with or without the file's prefix ("dev:14" or "14")
        pick = [d for d in docs if a.doc_id is None or a.doc_id in (d.doc_id, d.doc_id.split(":", 1)[-1])]
        if not pick:
            raise CorpusError(f"no document with id {a.doc_id!r} in {a.document} (ids: {', '.join(d.doc_id for d in docs[:8])}...)")
        content = pick[0].text + "\n\n" + a.prompt
    built = build_engine(mc, ec, sc, progress=True)
    eng = built.engine
    messages = [{"role": "user", "content": content}]
    ids = eng.encode_chat(messages, a.system)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                            snapshot_mode=a.snapshot_mode, seed=a.seed, steer=a.steer)
    if "cad" in params.steer:  # cad contrasts with the request without its document
        from sfcl.snapshot.mechanisms import no_document_messages

        nd = no_document_messages(messages, a.system)
        params.cad_prompt_ids = eng.encode_chat(*nd) if nd else None
    tty = sys.stdout.isatty()
    dim, off = ("\033[2;36m", "\033[0m") if tty else ("", "")
    rc = 0

    async def run() -> None:
        nonlocal rc
        async for ev in eng.stream(ids, params):
            if isinstance(ev, TextDelta):
                sys.stdout.write(ev.text)
            elif isinstance(ev, SnapshotEvent) and not a.no_marks:
                st = f" steer={ev.steer['mechanism']}:{ev.steer['original_token']!r}->{ev.steer['token']!r}" if ev.steer else ""
                sys.stdout.write(f"{dim}⟦snapshot {ev.trigger} anchor={ev.anchor_id} conf={ev.confidence:.2f}{st}⟧{off}")
            elif isinstance(ev, Finished):
                s = ev.snapshot_summary
                sys.stdout.write("\n")
                print(f"[{ev.stop_reason}] prompt {ev.prompt_tokens} tok, output {ev.completion_tokens} tok, "
                      f"TTFT {ev.ttft_ms:.0f} ms, snapshots {s['lookups']} ({s['lookups_per_1k_tokens']}/1k tok) "
                      f"{s['triggers']}", file=sys.stderr)
            elif isinstance(ev, ErrorEvent):
                print(f"\nerror: {ev.message}", file=sys.stderr)
                rc = 1
            sys.stdout.flush()

    try:
        asyncio.run(run())
    finally:
        eng.shutdown()
    return rc


def cmd_anchors_build(a) -> int:
    import torch

    from sfcl.anchors.builder import BuildConfig, build_library
    from sfcl.anchors.corpus import read_corpus
    from sfcl.config import default_cache_dir
    from sfcl.model.loader import load_model

    if a.threads:
        torch.set_num_threads(a.threads)
    docs = read_corpus(a.corpus)
    if a.max_docs:
        docs = docs[: a.max_docs]
    lm = load_model(a.model, dtype=a.dtype, device=a.device,
                    cache_dir=Path(a.cache_dir) if a.cache_dir else default_cache_dir())
    cfg = BuildConfig(n_anchors=a.n_anchors, layer=a.layer, seed=a.seed, window_tokens=a.window_tokens,
                      max_points=a.max_points)
    from sfcl.anchors.versions import describe_command

    path = build_library(lm, docs, a.out, cfg, versioned=True, command=describe_command(a))
    from sfcl.anchors.store import load_library

    lib = load_library(path)
    print(f"[ANCHOR] built {lib.n_anchors} anchors from {len(docs)} documents "
          f"({lib.manifest['build']['n_points']} positions, layer {lib.layer}) into {path}", file=sys.stderr)
    return 0


def cmd_soak(a) -> int:
    from sfcl.tools.soak import soak

    st = asyncio.run(soak(a.url, a.concurrency, a.duration, a.disconnect, a.max_tokens, a.seed))
    print(st.table())
    for e in st.errors[:10]:
        print("error:", e, file=sys.stderr)
    bad = st.errors or st.lost_or_duplicated or st.idle_after_s is None
    return 1 if bad else 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sfcl", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    fmt = {"formatter_class": argparse.ArgumentDefaultsHelpFormatter}

    s = sub.add_parser("serve", help="run the HTTP server (Anthropic Messages + OpenAI Chat Completions)", **fmt)
    _add_model_flags(s)
    _add_snapshot_flags(s)
    s.add_argument("--host", default="127.0.0.1", help="bind address")
    s.add_argument("--port", type=_port, default=8000, help="TCP port")
    s.add_argument("--api-key", default=None, help="require this key (x-api-key or Bearer); or set SFCL_API_KEY")
    s.add_argument("--log-level", default="warning", help="uvicorn log level")
    s.add_argument("--metrics-port", type=_port, default=None,
                   help="also serve /metrics on this port without the API key (for a scraper on a private network)")
    s.add_argument("--keyword-boost", default=None, metavar="FILE.json",
                   help="keyword-boost rules added to the library's own: a JSON list of {\"keywords\": [...], "
                        "\"kinds\": [\"domain\"], \"multiplier\": 1.5}")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds open streams may run after SIGTERM before they are ended with a stop event")
    s.set_defaults(fn=cmd_serve)

    g = sub.add_parser("generate", help="stream one answer in the terminal, snapshots marked inline", **fmt)
    g.add_argument("prompt", help="the question or instruction")
    g.add_argument("--document", default=None,
                   help="a .txt/.md file (or ContractNLI .json / .jsonl, see --doc-id) placed before the prompt")
    g.add_argument("--doc-id", default=None,
                   help="which document of a multi-document file, e.g. dev:14 or 14 (default: the first)")
    g.add_argument("--system", default=None, help="system prompt")
    g.add_argument("--max-tokens", type=int, default=256, help="generated tokens at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--seed", type=int, default=None, help="sampling seed")
    g.add_argument("--no-marks", action="store_true", help="do not print snapshot markers")
    g.add_argument("--steer", default=None,
                   help="grounded correction when a snapshot fires: on (the default mechanism), source, cad, knn or "
                        "a '+' combination (default: off, snapshots observe only)")
    _add_model_flags(g)
    _add_snapshot_flags(g)
    g.set_defaults(fn=cmd_generate)

    k = sub.add_parser("soak", help="bounded soak test of a running server (loopback only)", **fmt)
    k.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (loopback)")
    k.add_argument("--concurrency", type=int, default=64, help="concurrent streaming clients")
    k.add_argument("--duration", type=float, default=180.0, help="seconds to keep starting requests")
    k.add_argument("--disconnect", type=float, default=0.3, help="share of clients that hang up mid-stream")
    k.add_argument("--max-tokens", type=int, default=48, help="max_tokens per request (random 8..this)")
    k.add_argument("--seed", type=int, default=0, help="random seed of the client mix")
    k.set_defaults(fn=cmd_soak)

    from sfcl.ingest.cli import add_parser as add_ingest_parser; add_ingest_parser(sub)  # noqa: E702
    from sfcl.bench.run import add_parser as add_bench; add_bench(sub)  # sfcl bench

    from sfcl.eval import run as _ev, stress as _st; _ev.add_parser(sub); _st.add_parser(sub)  # noqa: E702
    an = sub.add_parser("anchors", help="anchor library tools")
    asub = an.add_subparsers(dest="anchors_cmd", required=True)
    b = asub.add_parser("build", help="Static Anchor Generator: corpus -> anchor library", **fmt)
    b.add_argument("corpus", nargs="+", help=".txt/.md files, directories, ContractNLI .json or .jsonl, or an `sfcl ingest` output directory")
    b.add_argument("--out", required=True,
                   help="library root: a new directory (becomes ROOT/v0001 + CURRENT) or an existing root "
                        "(the build becomes its next version)")
    b.add_argument("--n-anchors", type=int, default=32768, help="anchors at most")
    b.add_argument("--layer", type=int, default=None, help="snapshot layer (default: 3/4 of the depth)")
    b.add_argument("--seed", type=int, default=0, help="clustering seed (same seed, same library)")
    b.add_argument("--window-tokens", type=int, default=1024, help="tokens per model pass")
    b.add_argument("--max-points", type=int, default=None, help="stop after this many token positions")
    b.add_argument("--max-docs", type=int, default=None, help="use only the first N documents")
    _add_model_flags(b)
    b.set_defaults(fn=cmd_anchors_build)
    from sfcl.anchors.lifecycle_cli import add_parsers as _add_lifecycle; _add_lifecycle(asub)  # noqa: E702
    from sfcl.eval.calibrate import add_parser as _cal; _cal(asub)  # noqa: E702
    return ap


def main(argv: list[str] | None = None) -> int:
    from sfcl.anchors.corpus import CorpusError
    from sfcl.anchors.store import AnchorLibraryError
    from sfcl.model.loader import ModelLoadError

    a = build_parser().parse_args(argv)
    try:
        return a.fn(a)
    except (ModelLoadError, AnchorLibraryError, CorpusError, FileExistsError, ValueError) as e:
        print(f"sfcl: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
