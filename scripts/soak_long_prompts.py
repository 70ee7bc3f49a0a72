"""Resident memory of a running server under long prompts: does it level off or keep growing?

    python scripts/soak_long_prompts.py --pid PID [--url http://127.0.0.1:8000] [--docs 40]
        [--concurrency 4] [--passes 3] [--chars 14000] [--out DIR]

Sends each of the first ``--docs`` ContractNLI NDAs (read at run time from
``sfcl.config.contractnli_path()``; the first ``--chars`` characters, ~3,000 tokens) as one
non-streaming /v1/chat/completions request (greedy, 8 tokens), ``--concurrency`` at a time, and
does so ``--passes`` times (each pass's prompts end with its number, so a later pass finds each
document's prefix in the prefix cache only as far as the cache kept it). After every request it
reads the server's RSS (``VmRSS`` of ``/proc/PID/status``; the server must run on this machine).
What to expect: RSS climbs while the prefix cache fills (``--prefix-cache-tokens``, 32,768 tokens
by default, ~23 KB each in bf16) and the rows of running requests hold their tokens, then levels
off; a leak shows as a peak that goes on rising from pass to pass. Prints the per-pass peak and
the RSS after each pass, and writes ``soak_rss.csv`` and ``soak_rss.png`` (RSS over requests) into
``--out`` (default: the current folder). Exits 1 when a request fails.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
from pathlib import Path

import httpx

from sfcl.config import contractnli_path


def rss_mib(pid: int) -> int:
    """Resident set size of process ``pid`` in MiB (``VmRSS``). Raises OSError when it is gone."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    raise OSError(f"no VmRSS for pid {pid}")


async def _run(a: argparse.Namespace) -> list[tuple[int, int, int, int]]:
    docs = json.loads(contractnli_path().read_text())["documents"][: a.docs]
    rows: list[tuple[int, int, int, int]] = []  # (pass, document, prompt tokens, RSS MiB)
    sem = asyncio.Semaphore(a.concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(p: int, i: int, text: str) -> None:
            body = {"model": "smollm2-135m-instruct", "max_tokens": 8, "temperature": 0, "messages": [
                {"role": "user", "content": text[: a.chars] + f"\n\nPass {p}. Who are the parties to this agreement?"}]}
            async with sem:
                r = await client.post(a.url + "/v1/chat/completions", json=body)
                r.raise_for_status()
                rows.append((p, i, r.json()["usage"]["prompt_tokens"], rss_mib(a.pid)))
        for p in range(a.passes):
            await asyncio.gather(*(one(p, i, d["text"]) for i, d in enumerate(docs)))
            peak = max(r[3] for r in rows if r[0] == p)
            print(f"pass {p}: {len(docs)} requests, peak RSS {peak} MiB, after the pass {rss_mib(a.pid)} MiB",
                  flush=True)
    return rows


def _plot(rows: list[tuple[int, int, int, int]], path: Path, start: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(range(len(rows) + 1), [start] + [r[3] for r in rows], lw=1.2)
    per_pass = len(rows) // max(1, rows[-1][0] + 1)
    for p in range(1, rows[-1][0] + 1):
        ax.axvline(p * per_pass, color="grey", lw=0.6, ls="--")
    ax.set_xlabel("requests finished (dashed: a new pass over the same documents)")
    ax.set_ylabel("server RSS, MiB")
    ax.set_title("RSS under long NDA prompts")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pid", type=int, required=True, help="the server's process id (on this machine)")
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--docs", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--chars", type=int, default=14000)
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    start = rss_mib(a.pid)
    print(f"RSS before: {start} MiB", flush=True)
    try:
        rows = asyncio.run(_run(a))
    except httpx.HTTPError as e:
        print(f"a request failed: {e}")
        return 1
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "soak_rss.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["pass", "document", "prompt_tokens", "rss_mib"])
        w.writerows(rows)
    _plot(rows, out / "soak_rss.png", start)
    print(f"wrote {out / 'soak_rss.csv'}, {out / 'soak_rss.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
