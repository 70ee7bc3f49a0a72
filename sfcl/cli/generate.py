"""``sfcl generate``: stream one answer in the terminal, snapshot events marked inline."""

from __future__ import annotations

import argparse
import asyncio
import sys

from sfcl.cli.flags import FMT, add_model_flags, add_snapshot_flags, configs


def add_parser(sub) -> None:
    """Add ``generate`` to the top-level subparsers ``sub``."""
    g = sub.add_parser("generate", help="stream one answer in the terminal, snapshots marked inline", **FMT)
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
    add_model_flags(g)
    add_snapshot_flags(g)
    g.set_defaults(fn=cmd_generate)


def cmd_generate(a: argparse.Namespace) -> int:
    from sfcl.engine.events import ErrorEvent, Finished, SnapshotEvent, TextDelta
    from sfcl.engine.request import SamplingParams
    from sfcl.engine_stack import build_engine

    mc, ec, sc = configs(a)
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
                st = (f" steer={ev.steer['mechanism']}:{ev.steer['original_token']!r}->{ev.steer['token']!r}"
                      if ev.steer else "")
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
