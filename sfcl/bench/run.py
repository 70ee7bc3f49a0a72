"""``sfcl bench``: SFCL (snapshot modes off / triggered / always on one server), HF transformers
``generate()``, llama.cpp (``python -m llama_cpp.server``) and any ``--peer-url`` server, same
weights (the bundled SmolLM2-135M-Instruct GGUF unless ``--model``), same machine, one run.

Systems run one after another, each alone on the machine; the workloads of one system run in the
order single -> concurrent levels -> longdoc. SFCL's snapshot modes share one server and run the
single and concurrent workloads in interleaved rounds (``--rounds``), then longdoc per mode. With
``llamacpp`` in the run, llama.cpp's server starts first and its single-stream requests take their
turn in those rounds (one server serving at a time; ``--separate-single`` runs them on their own).
Output folder: report.md, report.json, PNG plots and the servers' logs. Exit code 0 when at least one system was measured (a FAIL target is a finding,
not an error), 1 when none could be, 2 for bad arguments.

``run_bench(BenchConfig)`` is the entry point (the flags: ``sfcl.cli.bench``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from sfcl.bench import clients, peers, report, workloads
from sfcl.bench.config import DEFAULT_CONCURRENCY, BenchConfig
from sfcl.bench.stats import RequestSample, Summary, summarize

SFCL_MODES = ("off", "triggered", "always")
KNOWN = ("sfcl-off", "sfcl-triggered", "sfcl-always", "hf-bf16", "hf-fp32", "llamacpp", "llama-server")
ALIASES = {"sfcl": ("sfcl-off", "sfcl-triggered", "sfcl-always"), "hf": ("hf-bf16",)}
WORKLOADS = ("single", "concurrent", "longdoc")


@dataclass(slots=True)
class Plan:
    """What every system is asked to do (same for all of them)."""

    workloads: tuple[str, ...]
    levels: tuple[int, ...]  # concurrent streams per level
    single_requests: int
    requests_per_level: int  # at least the level itself, so every client sends one
    max_tokens: int
    longdoc_max_tokens: int
    prompts: list[list[dict]]  # base short prompts (tagged per system/level before use)
    docs: list[workloads.LongDoc] = field(default_factory=list)  # one per SFCL mode (prefix cache)
    ignore_eos: bool = True
    warmup_requests: int = 2  # untimed requests (concurrently) before a system's first workload
    rounds: int = 1  # SFCL's modes run single/concurrent in this many interleaved rounds
    temperature: float = 0.0  # of every request (0: greedy); top_p 1


@dataclass
class Results:
    rows: list[Summary] = field(default_factory=list)
    samples: dict[str, list[RequestSample]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    rounds: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # "concurrent|c16" -> system -> tok/s per round

    def add(self, system: str, workload: str, c: int, samples: list[RequestSample], *, snapshots: bool,
            wall_s: float | None = None, rss: int | None = None, gpu: int | None = None) -> None:
        self.rows.append(summarize(system, workload, c, samples, wall_s=wall_s, peak_rss_bytes=rss,
                                   gpu_mem_bytes=gpu, snapshots=snapshots))
        self.samples[f"{system}|{workload}|c{c}"] = samples


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--concurrency must be comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise ValueError("--concurrency needs integers >= 1")
    return vals


def parse_systems(text: str) -> tuple[str, ...]:
    """'sfcl,hf,llamacpp' -> ('sfcl-off', 'sfcl-triggered', 'sfcl-always', 'hf-bf16', 'llamacpp').
    Raises ValueError naming an unknown system."""
    out: list[str] = []
    for s in (x.strip() for x in text.split(",") if x.strip()):
        names = ALIASES.get(s, (s,))
        for n in names:
            if n not in KNOWN:
                raise ValueError(f"unknown system {s!r} (known: {', '.join(KNOWN + tuple(ALIASES))}; "
                                 "other servers: --peer-url NAME=URL)")
            if n not in out:
                out.append(n)
    return tuple(out)


def parse_peer(text: str) -> tuple[str, str]:
    """'NAME=URL' or 'URL' (name: host:port) -> (name, url). Raises ValueError."""
    name, _, url = text.rpartition("=") if "=" in text.split("://")[0] else ("", "", text)
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--peer-url needs NAME=http://host:port, got {text!r}")
    return (name or url.split("://", 1)[1].rstrip("/")), url.rstrip("/")


def _bar(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", leave=False, dynamic_ncols=True)


def _window(monitor: peers.MemoryMonitor | None):
    """The monitor's peak-memory window, or a no-op context yielding None without a monitor."""
    return monitor.window() if monitor else contextlib.nullcontext(None)


def _warmup(target: clients.Target, plan: Plan, tag: str) -> None:
    """Untimed requests first: first-request effects (allocator, caches, lazy init)."""
    if plan.warmup_requests:
        n = plan.warmup_requests
        asyncio.run(clients.closed_loop(target, workloads.tagged(plan.prompts[:n], f"{tag}w"), n, n, plan.max_tokens))


def bench_http(target: clients.Target, plan: Plan, res: Results, *, tag: str, doc: workloads.LongDoc | None,
               monitor: peers.MemoryMonitor | None, snapshots: bool) -> None:
    """Run the plan's workloads against one HTTP target and add the summaries to ``res``."""

    def figures(w):
        return (w.peak_rss, w.peak_gpu) if w is not None else (None, None)

    _warmup(target, plan, tag)
    for wl in plan.workloads:
        if wl == "single":
            n = plan.single_requests
            bar = _bar(n, f"{target.name} single")
            with _window(monitor) as w:
                ss = asyncio.run(clients.closed_loop(target, workloads.tagged(plan.prompts[:n], f"{tag}s"), 1, n,
                                                     plan.max_tokens, lambda s: bar.update()))
            bar.close()
            rss, gpu = figures(w)
            res.add(target.name, "single", 1, ss, snapshots=snapshots, rss=rss, gpu=gpu)
        elif wl == "concurrent":
            for c in plan.levels:
                n = max(plan.requests_per_level, c)
                bar = _bar(n, f"{target.name} c={c}")
                prompts = workloads.tagged([plan.prompts[i % len(plan.prompts)] for i in range(n)], f"{tag}c{c}")
                t0 = time.monotonic()
                with _window(monitor) as w:
                    ss = asyncio.run(clients.closed_loop(target, prompts, c, n, plan.max_tokens, lambda s: bar.update()))
                wall = time.monotonic() - t0
                bar.close()
                rss, gpu = figures(w)
                res.add(target.name, "concurrent", c, ss, snapshots=snapshots, wall_s=wall, rss=rss, gpu=gpu)
        elif wl == "longdoc" and doc is not None:
            msgs = [doc.messages(i) for i in range(len(doc.questions))]
            bar = _bar(len(msgs), f"{target.name} longdoc")
            with _window(monitor) as w:
                ss = asyncio.run(clients.sequential(target, msgs, plan.longdoc_max_tokens, lambda s: bar.update()))
            bar.close()
            rss, gpu = figures(w)
            res.add(target.name, "longdoc-cold", 1, ss[:1], snapshots=snapshots, rss=rss, gpu=gpu)
            if len(ss) > 1:
                res.add(target.name, "longdoc-repeat", 1, ss[1:], snapshots=snapshots, rss=rss, gpu=gpu)


def _target(name: str, url: str, plan: Plan, headers: dict | None = None, eos_body: dict | None = None) -> clients.Target:
    """Target for ``url``; ``eos_body`` is how this server is asked to ignore EOS (default the
    vLLM / llama-server field ``ignore_eos``); the probe drops it if the server rejects it."""
    body = (eos_body if eos_body is not None else {"ignore_eos": True}) if plan.ignore_eos else {}
    t = clients.Target(name=name, base_url=url, model=clients.discover_model(url), headers=headers or {},
                       extra_body=dict(body), temperature=plan.temperature)
    return asyncio.run(clients.probe(t))


def _eos_note(t: clients.Target, plan: Plan) -> str:
    if not plan.ignore_eos:
        return f"{t.name}: stops at EOS (--no-ignore-eos)"
    if not t.extra_body:
        return f"{t.name}: rejected the ignore-EOS field, so it stops at EOS (fewer tokens per request)"
    return f"{t.name}: EOS suppressed with `{json.dumps(t.extra_body)}`"


def _split(n: int, rounds: int, wave: int) -> list[int]:
    """n requests as up to ``rounds`` parts of whole waves (multiples of ``wave``, the level's
    concurrency), as equal as whole waves allow; what does not fill a wave joins the last part.
    A closed loop of c clients over a part that is not a multiple of c ends with a partly empty
    batch, which would lower that round's throughput for a reason that is not the server's."""
    wave = max(1, wave)
    waves = n // wave
    if waves <= 1:
        return [n]
    k = max(1, min(rounds, waves))
    parts = [wave * (waves // k + (1 if i < waves % k else 0)) for i in range(k)]
    parts[-1] += n - waves * wave
    return parts


@dataclass(slots=True)
class SinglePeer:
    """A peer server whose single-stream rounds join SFCL's interleaved rounds (``bench_interleaved``):
    the ``single`` workload of SFCL's modes and of this peer then alternate round by round, so a
    change in machine speed during the run hits both sides of the single-stream ratio alike."""

    target: clients.Target
    tag: str  # prompt tag prefix, unique per system ("l" for llama.cpp)
    monitor: peers.MemoryMonitor | None


def bench_interleaved(targets: list[tuple[clients.Target, int]], plan: Plan, res: Results,
                      monitor: peers.MemoryMonitor | None, single_peers: Sequence[SinglePeer] = ()) -> None:
    """The single and concurrent workloads of several targets on ONE server (SFCL's snapshot
    modes), in ``plan.rounds`` interleaved rounds: off, triggered, always, off, triggered, ...
    A drift in machine speed during the run (other tenants, thermal, page cache) then hits every
    mode alike instead of biasing the mode that ran last; each mode's figures pool its rounds
    (throughput = its tokens / the sum of its rounds' wall time). targets: (target, tag index).
    single_peers: other servers (already warmed up) that take their turn in the single-stream
    rounds only, after the modes. Odd rounds run in reverse order (off, triggered, always, peer;
    peer, always, triggered, off; ...), so that no mode always follows the same one: whatever one
    run leaves behind (a busy lookup thread, a cooler cache, the client's garbage) falls on
    different modes in turn instead of always on the next one in the list."""
    modes = [(t, f"m{k}", monitor, t.headers.get("x-sfcl-snapshot") != "off") for t, k in targets]
    others = [(p.target, p.tag, p.monitor, False) for p in single_peers]  # (target, tag, monitor, snapshots)
    jobs = []  # (workload, level, requests per round)
    if "single" in plan.workloads:
        jobs.append(("single", 1, _split(plan.single_requests, plan.rounds, 2)))
    if "concurrent" in plan.workloads:
        jobs += [("concurrent", c, _split(max(plan.requests_per_level, c), plan.rounds, c)) for c in plan.levels]
    for wl, c, parts in jobs:
        mine = modes + (others if wl == "single" else [])
        got = {t.name: ([], 0.0, 0) for t, *_ in mine}
        bar = _bar(sum(parts) * len(mine), f"{'sfcl+peers' if len(mine) > len(modes) else 'sfcl'} {wl} c={c} "
                                           f"x{len(parts)} rounds")
        for r, n in enumerate(parts):
            base = sum(parts[:r])  # this round's first prompt
            for t, tag, mon, _snap in (mine if r % 2 == 0 else mine[::-1]):
                prompts = workloads.tagged([plan.prompts[(base + i) % len(plan.prompts)] for i in range(n)],
                                           f"{tag}{'s' if wl == 'single' else f'c{c}'}r{r}")
                t0 = time.monotonic()
                with _window(mon) as w:
                    ss = asyncio.run(clients.closed_loop(t, prompts, c, n, plan.max_tokens, lambda s: bar.update()))
                dt_s = time.monotonic() - t0
                samples, wall, rss = got[t.name]
                got[t.name] = (samples + ss, wall + dt_s, max(rss, (w.peak_rss or 0) if w is not None else 0))
                if wl == "concurrent":
                    per_round = res.rounds.setdefault(f"{wl}|c{c}", {}).setdefault(t.name, [])
                    per_round.append(round(summarize(t.name, wl, c, ss, wall_s=dt_s).tokens_per_s or 0.0, 2))
        bar.close()
        for t, _tag, _mon, snap in mine:
            samples, wall, rss = got[t.name]
            res.add(t.name, wl, c, samples, snapshots=snap, wall_s=wall if wl == "concurrent" else None,
                    rss=rss or None)
        if wl == "concurrent" and len(parts) > 1:
            res.notes.append(round_note(c, res.rounds[f"{wl}|c{c}"], targets[0][0].name))
        if wl == "single" and single_peers:
            res.notes.append("single stream: " + ", ".join(p.target.name for p in single_peers) + " ran its "
                             f"single-stream requests in the same {len(parts)} interleaved round(s) as SFCL's "
                             "modes (both servers up, one serving at a time)")


def round_note(c: int, per_round: dict[str, list[float]], base: str) -> str:
    """One line: each mode's tok/s per round at level c, and its ratio to ``base`` round by round
    (the spread of those ratios is the run-to-run noise a pooled ratio carries)."""
    parts = []
    for name, v in per_round.items():
        txt = f"{name} " + ", ".join(f"{x:.1f}" for x in v)
        if name != base and len(v) == len(per_round[base]):
            txt += " (/" + base + ": " + ", ".join(f"{x / b:.3f}" if b else "-" for x, b in zip(v, per_round[base])) + ")"
        parts.append(txt)
    return f"per-round tok/s at {c} streams: " + "; ".join(parts)


def run_sfcl(cfg: BenchConfig, plan: Plan, res: Results, modes: list[str], out: Path,
             single_peers: Sequence[SinglePeer] = ()) -> None:
    port = peers.free_port()
    argv = peers.sfcl_argv(port, max_num_seqs=max(plan.levels + (1,)), model=cfg.model,
                           device=cfg.device, extra=shlex.split(cfg.sfcl_args))
    with peers.ServerProcess("sfcl", argv, port, out / "logs", ready_path="/health",
                             env=peers.sfcl_env(cfg.threads)) as srv:
        srv.wait_ready(cfg.ready_timeout)
        targets = []
        for k, mode in enumerate(modes):
            t = _target(f"sfcl-{mode}", srv.url, plan, {"x-sfcl-snapshot": mode})
            res.notes.append(_eos_note(t, plan))
            targets.append((t, k))
        for t, k in targets:
            _warmup(t, plan, f"m{k}")
        bench_interleaved(targets, plan, res, srv.monitor, single_peers)
        if "longdoc" in plan.workloads:
            no_warm = dataclasses.replace(plan, workloads=("longdoc",), warmup_requests=0)
            for t, k in targets:
                # each mode gets its own document: a later mode must not find the earlier mode's KV cached
                doc = plan.docs[k % len(plan.docs)] if plan.docs else None
                bench_http(t, no_warm, res, tag=f"m{k}", doc=doc, monitor=srv.monitor,
                           snapshots=t.headers.get("x-sfcl-snapshot") != "off")


@contextlib.contextmanager
def llamacpp_server(cfg: BenchConfig, plan: Plan, res: Results, out: Path):
    """Start ``python -m llama_cpp.server`` on the GGUF; yields (its Target, its ServerProcess), or
    None with a note when llama.cpp is not installed or the model is not a GGUF file. Raises
    RuntimeError when the server does not come up."""
    from sfcl.model.loader import resolve_model

    why = peers.llamacpp_available()
    if why:
        res.notes.append(f"llamacpp skipped: `import llama_cpp.server` failed ({why}); "
                         "`pip install 'llama-cpp-python[server]'` (or `pip install -e .[bench]`)")
        yield None
        return
    src = resolve_model(cfg.model)
    if not src.gguf_file:
        res.notes.append("llamacpp skipped: --model is not a .gguf file")
        yield None
        return
    port = peers.free_port()
    argv = peers.llamacpp_argv(port, str(src.path), threads=cfg.threads, n_ctx=cfg.n_ctx,
                               extra=shlex.split(cfg.llamacpp_args))
    with peers.ServerProcess("llamacpp", argv, port, out / "logs") as srv:
        srv.wait_ready(cfg.ready_timeout)
        # llama_cpp.server has no ignore_eos; a -100 logit bias on the end tokens does the same
        eos = {str(i): -100.0 for i in peers.gguf_eos_ids(str(src.path))}
        t = _target("llamacpp", srv.url, plan, eos_body={"logit_bias": eos})
        res.notes.append(_eos_note(t, plan))
        yield t, srv


def run_llamacpp(cfg: BenchConfig, plan: Plan, res: Results, out: Path, up: tuple | None = None) -> None:
    """llama.cpp's workloads. up: (Target, ServerProcess) of a server already started (and warmed
    up) by ``llamacpp_server``, whose single-stream workload already ran interleaved with SFCL's."""
    with contextlib.nullcontext(up) if up is not None else llamacpp_server(cfg, plan, res, out) as got:
        if got is None:
            return
        t, srv = got
        # single ran in SFCL's rounds, unless those did not run (SFCL's server failed): then it runs here
        done = f"{t.name}|single|c1" in res.samples
        todo = dataclasses.replace(plan, workloads=tuple(w for w in plan.workloads if w != "single" or not done),
                                   warmup_requests=0 if up is not None else plan.warmup_requests)
        bench_http(t, todo, res, tag="l", doc=plan.docs[0] if plan.docs else None, monitor=srv.monitor,
                   snapshots=False)


def run_llama_server(cfg: BenchConfig, plan: Plan, res: Results, out: Path, binary: Path) -> None:
    """llama.cpp's native ``llama-server`` (``sfcl.bench.llama_server``): a fresh server per workload
    level with ``-np`` = the level's concurrency (single stream and the long document: ``-np 1``), so
    each level gets the slots it needs and no more, and its peak RSS is its own. Each slot holds
    ``--llama-server-ctx`` tokens (the long-document server at least the document + answer).
    Raises RuntimeError when a server does not come up (the caller notes it)."""
    from sfcl.model.loader import resolve_model

    src = resolve_model(cfg.model)
    if not src.gguf_file:
        res.notes.append("llama-server skipped: --model is not a .gguf file")
        return
    doc = plan.docs[0] if plan.docs else None
    runs = []  # (n_parallel, ctx per slot, the plan to run on it)
    if "single" in plan.workloads:
        runs.append((1, cfg.llama_server_ctx, dataclasses.replace(plan, workloads=("single",))))
    if "concurrent" in plan.workloads:
        runs += [(c, cfg.llama_server_ctx, dataclasses.replace(plan, workloads=("concurrent",), levels=(c,)))
                 for c in plan.levels]
    if "longdoc" in plan.workloads and doc is not None:
        need = len(doc.text) // 2 + plan.longdoc_max_tokens + 256  # generous: >= 2 characters per token
        runs.append((1, max(cfg.llama_server_ctx, need), dataclasses.replace(plan, workloads=("longdoc",))))
    extra = shlex.split(cfg.llama_server_args)
    for n_par, ctx, sub in runs:
        with _start_llama_server(binary, str(src.path), n_par, ctx, cfg, extra, res, out) as srv:
            argv = srv.argv
            t = _target("llama-server", srv.url, plan)
            if not any(n.startswith("llama-server:") for n in res.notes):
                res.notes.append(_eos_note(t, plan) + f"; `{shlex.join(argv[1:])}` per level (-np = the level, "
                                 f"-c = np x {cfg.llama_server_ctx})")
            bench_http(t, sub, res, tag=f"ls{n_par}", doc=doc, monitor=srv.monitor, snapshots=False)


NO_REPACK = "--no-repack"


def _start_llama_server(binary: Path, gguf: str, n_par: int, ctx: int, cfg: BenchConfig, extra: list[str],
                        res: Results, out: Path) -> peers.ServerProcess:
    """A ready ``llama-server`` with ``n_par`` slots. If it dies from a signal before it is ready and
    weight repacking is on, it is started once more with ``--no-repack`` (``extra`` keeps the flag for
    later levels, and the run's notes say so): on an Intel Xeon with AMX (2026-12-05), llama.cpp
    0.3.36's AMX matmul (``ggml_backend_amx_mul_mat``, used for repacked weights) segfaulted in the
    warm-up. Raises RuntimeError when it does not come up."""
    from sfcl.bench.llama_server import llama_server_argv

    while True:
        port = peers.free_port()
        argv = llama_server_argv(binary, gguf, port, n_parallel=n_par, ctx_per_slot=ctx, threads=cfg.threads,
                                 extra=extra)
        srv = peers.ServerProcess(f"llama-server-np{n_par}", argv, port, out / "logs", ready_path="/health")
        try:
            srv.wait_ready(cfg.ready_timeout)
            return srv
        except RuntimeError as e:
            srv.stop()
            code = srv.proc.returncode
            if code is None or code >= 0 or NO_REPACK in extra or "-nr" in extra:
                raise
            extra.append(NO_REPACK)
            msg = (f"llama-server crashed: killed by signal {-code} before it was ready with weight repacking on "
                   f"(ggml's AMX / repacked-weight kernels); every level ran with {NO_REPACK}")
            res.notes.append(msg)
            print(f"sfcl bench: {msg}; first error: {str(e).splitlines()[0]}", file=sys.stderr)


def run_llama_server_peer(cfg: BenchConfig, plan: Plan, res: Results, out: Path) -> None:
    """Find (or build, unless ``cfg.llama_server_build`` is off) llama-server, then ``run_llama_server``.
    A missing binary is a note, not a failure of the run."""
    from sfcl.bench.llama_server import LlamaServerUnavailable, llama_server
    from sfcl.config import default_cache_dir

    try:
        binary = llama_server(default_cache_dir(), build=cfg.llama_server_build)
    except LlamaServerUnavailable as e:
        res.notes.append(f"llama-server skipped: {e}")
        print(f"sfcl bench: llama-server skipped: {str(e).splitlines()[0]}", file=sys.stderr)
        return
    run_llama_server(cfg, plan, res, out, binary)


def run_hf(cfg: BenchConfig, plan: Plan, res: Results, name: str, out: Path) -> None:
    """transformers generate() in a subprocess (its own RSS); see sfcl.bench.hf_runner."""
    jobs = []
    if "single" in plan.workloads:
        jobs.append({"key": "single|c1", "concurrency": 1, "max_tokens": plan.max_tokens,
                     "prompts": workloads.tagged(plan.prompts[:plan.single_requests], "hs")})
    if "concurrent" in plan.workloads:
        for c in plan.levels:
            n = max(plan.requests_per_level, c)
            jobs.append({"key": f"concurrent|c{c}", "concurrency": c, "max_tokens": plan.max_tokens,
                         "prompts": workloads.tagged([plan.prompts[i % len(plan.prompts)] for i in range(n)], f"hc{c}")})
    if "longdoc" in plan.workloads and plan.docs:
        d = plan.docs[0]
        jobs.append({"key": "longdoc|c1", "concurrency": 1, "max_tokens": plan.longdoc_max_tokens,
                     "prompts": [d.messages(i) for i in range(len(d.questions))]})
    spec = {"name": name, "model": cfg.model, "dtype": name.split("-", 1)[1], "device": cfg.hf_device or cfg.device,
            "attn": cfg.hf_attn,
            "threads": cfg.threads, "ignore_eos": plan.ignore_eos, "temperature": plan.temperature, "jobs": jobs}
    with tempfile.TemporaryDirectory() as tmp:
        sp, op = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        sp.write_text(json.dumps(spec))
        log = open(out / "logs" / f"{name}.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "sfcl.bench.hf_runner", str(sp), str(op)],
                                stdout=log, stderr=None, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        mon = peers.MemoryMonitor(proc.pid)
        with mon.window() as w:
            rc = proc.wait()
        mon.close()
        log.close()
        if rc != 0 or not op.is_file():
            res.notes.append(f"{name} failed (exit {rc}); see {out / 'logs' / (name + '.log')} and the stderr above")
            return
        got = json.loads(op.read_text())["jobs"]
    for key, job in got.items():
        wl, c = key.split("|")[0], int(key.split("|c")[1])
        ss = [RequestSample(**s) for s in job["samples"]]
        gpu = job.get("gpu_mem_bytes")
        if wl == "longdoc":
            res.add(name, "longdoc-cold", 1, ss[:1], snapshots=False, rss=w.peak_rss, gpu=gpu)
            if len(ss) > 1:
                res.add(name, "longdoc-repeat", 1, ss[1:], snapshots=False, rss=w.peak_rss, gpu=gpu)
        else:
            res.add(name, wl, c, ss, snapshots=False, wall_s=job["wall_s"], rss=w.peak_rss, gpu=gpu)
    res.notes.append(f"{name}: transformers generate() in a subprocess, static batching (c prompts left-padded "
                     f"into one generate() call, next batch when all rows finish), {cfg.hf_attn} attention, greedy, "
                     f"{'min_new_tokens = max_tokens (EOS ignored)' if plan.ignore_eos else 'stops at EOS'}; "
                     "peak RSS is the subprocess' peak over all its workloads, including model load")


def _machine(device: str) -> str:
    from sfcl.model.hardware import cpu_summary

    return f"{cpu_summary()}, {os.cpu_count()} CPUs visible, device {device}, {platform.system()} {platform.release()}"


def _loadavg() -> float | None:
    """1-minute load average (other processes on a shared machine make every figure noisier)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def quick_sized(cfg: BenchConfig) -> BenchConfig:
    """``cfg`` with its ``quick`` smoke-run sizes applied: concurrency 4 (unless given), at most
    8 requests per level, 3 single requests, 16 tokens, a ~2k-token document, 3 questions of 8 tokens."""
    if not cfg.quick:
        return cfg
    return dataclasses.replace(
        cfg, concurrency="4" if cfg.concurrency is None else cfg.concurrency,
        requests_per_level=min(cfg.requests_per_level, 8), single_requests=min(cfg.single_requests, 3),
        max_tokens=min(cfg.max_tokens, 16), longdoc_questions=min(cfg.longdoc_questions, 3),
        longdoc_tokens=min(cfg.longdoc_tokens, 2000), longdoc_max_tokens=min(cfg.longdoc_max_tokens, 8))


def run_bench(cfg: BenchConfig) -> int:
    """Measure every system of ``cfg`` (module docstring); write report.md, report.json and the
    PNGs into ``cfg.out``. Returns 0 when at least one system was measured, 1 when none could be.
    Raises ValueError for bad settings and ModelLoadError for a missing model (before anything runs)."""
    from sfcl.model.loader import resolve_model

    cfg = quick_sized(cfg)
    systems = parse_systems(cfg.systems)
    peer_urls = [parse_peer(p) for p in cfg.peer_url]
    wls = tuple(w.strip() for w in cfg.workloads.split(",") if w.strip())
    bad = [w for w in wls if w not in WORKLOADS]
    if bad or not wls:
        raise ValueError(f"unknown workload(s) {', '.join(bad) or '(none)'}; choose from {', '.join(WORKLOADS)}")
    if not 0.0 <= cfg.temperature <= 1.0:
        raise ValueError("--temperature must be in [0, 1]")
    if min(cfg.max_tokens, cfg.single_requests, cfg.requests_per_level, cfg.longdoc_questions, cfg.threads,
           cfg.rounds) < 1 or cfg.warmup_requests < 0:
        raise ValueError("--max-tokens, --single-requests, --requests-per-level, --longdoc-questions, --rounds "
                         "and --threads must be >= 1, --warmup-requests >= 0")
    resolve_model(cfg.model)  # fail early (ModelLoadError -> one line, exit 2)
    levels = _ints(DEFAULT_CONCURRENCY if cfg.concurrency is None else cfg.concurrency)
    sfcl_modes = [s.split("-", 1)[1] for s in systems if s.startswith("sfcl-")]
    docs = []
    if "longdoc" in wls:
        docs = [workloads.long_document(cfg.longdoc_file, cfg.longdoc_tokens, cfg.longdoc_questions, index=k)
                for k in range(max(1, len(sfcl_modes)))]
    plan = Plan(workloads=wls, levels=levels, single_requests=cfg.single_requests,
                requests_per_level=cfg.requests_per_level, max_tokens=cfg.max_tokens,
                longdoc_max_tokens=cfg.longdoc_max_tokens,
                prompts=workloads.short_prompts(max(cfg.single_requests, cfg.requests_per_level, max(levels))),
                docs=docs, ignore_eos=not cfg.no_ignore_eos, warmup_requests=cfg.warmup_requests, rounds=cfg.rounds,
                temperature=cfg.temperature)
    out = Path(cfg.out or f"bench-out/{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%SZ}")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    res = Results()
    if plan.temperature > 0:
        res.notes.append(f"every request sampled at temperature {plan.temperature:g}, top_p 1; other sampler "
                         "settings are each server's defaults (llama-cpp-python's server keeps top_k 40 and "
                         "min_p 0.05; SFCL and HF here sample the whole vocabulary), and the token streams "
                         "differ between systems")
    t0 = time.monotonic()
    load_start = _loadavg()
    with contextlib.ExitStack() as stack:  # stops llama.cpp's server however this block ends
        up = None  # llama.cpp started first, so its single-stream rounds interleave with SFCL's
        interleave = "llamacpp" in systems and bool(sfcl_modes) and "single" in wls and not cfg.separate_single
        if interleave:
            try:
                up = stack.enter_context(llamacpp_server(cfg, plan, res, out))
            except (RuntimeError, OSError) as e:
                res.notes.append(f"llamacpp failed: {e}")
                print(f"sfcl bench: llamacpp failed: {str(e).splitlines()[0]}", file=sys.stderr)
            if up is not None:
                _warmup(up[0], plan, "l")
        single_peers = [SinglePeer(up[0], "l", up[1].monitor)] if up is not None else []
        steps = ([("sfcl", lambda: run_sfcl(cfg, plan, res, sfcl_modes, out, single_peers))] if sfcl_modes else [])
        steps += [(s, (lambda s=s: run_hf(cfg, plan, res, s, out))) for s in systems if s.startswith("hf-")]
        if "llama-server" in systems:
            steps += [("llama-server", lambda: run_llama_server_peer(cfg, plan, res, out))]
        if "llamacpp" in systems and (up is not None or not interleave):  # else: skipped or failed, noted
            steps += [("llamacpp", lambda: run_llamacpp(cfg, plan, res, out, up))]
        for name, url in peer_urls:
            def peer(name=name, url=url):
                t = _target(name, url, plan)
                res.notes.append(_eos_note(t, plan) + "; peak RSS not measured (not started by sfcl bench)")
                bench_http(t, plan, res, tag="p", doc=docs[0] if docs else None, monitor=None, snapshots=False)
            steps.append((name, peer))
        for name, fn in steps:
            try:
                fn()
            except (RuntimeError, OSError) as e:
                res.notes.append(f"{name} failed: {e}")
                print(f"sfcl bench: {name} failed: {str(e).splitlines()[0]}", file=sys.stderr)
    if "llamacpp" in systems:
        res.notes.append("llamacpp: llama-cpp-python's `llama_cpp.server` serves requests one at a time (no parallel "
                         "slots): concurrent requests queue in the server, so its throughput stays flat and its TTFT "
                         "grows with concurrency. llama.cpp's own parallel-slot server is the llama-server system "
                         "(`--systems sfcl,llama-server`)")
    if docs:
        res.notes.append("longdoc: ContractNLI " + ", ".join(f"{d.doc_id} ({len(d.text):,} chars)" for d in docs)
                         + f"; {cfg.longdoc_questions} questions in sequence, the first cold. Each SFCL snapshot "
                           "mode gets its own document (they share one server and its prefix cache); other "
                           "systems use the first")
    res.notes.append("short prompts start with a per-system/level tag (`Ref m0c4-3.`) so no run reuses another's "
                     "prefix-cached KV; peak RSS is polled every 0.1 s (a lower bound)")
    for s in dict.fromkeys(r.system for r in res.rows):
        by = sorted({r.tokens_counted_by for r in res.rows if r.system == s})
        res.notes.append(f"{s}: output tokens counted from {' and '.join(by)} "
                         "(usage = the server's usage chunk or generate()'s count; chunks = content chunks)")
    if not res.rows:
        print("sfcl bench: no system could be measured:\n" + "\n".join(res.notes), file=sys.stderr)
        return 1
    checks = report.compute_targets(res.rows)
    meta = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": _machine(cfg.device),
            "model": str(resolve_model(cfg.model).path), "command": "sfcl " + shlex.join(sys.argv[1:]),
            "threads": cfg.threads, "wall_s": round(time.monotonic() - t0, 1),
            "loadavg_1min_start_end": [load_start, _loadavg()], "plan": {
                "workloads": wls, "levels": levels, "single_requests": cfg.single_requests,
                "requests_per_level": cfg.requests_per_level, "max_tokens": cfg.max_tokens,
                "longdoc_max_tokens": cfg.longdoc_max_tokens, "ignore_eos": plan.ignore_eos, "rounds": cfg.rounds,
                "temperature": cfg.temperature},
            "per_round_tokens_per_s": res.rounds}
    md = report.markdown(res.rows, checks, meta, res.notes)
    (out / "report.md").write_text(md)
    report.write_json(out / "report.json", res.rows, checks, meta, res.samples)
    pngs = report.write_plots(out, res.rows, res.samples)
    print(md)
    print(f"wrote {out / 'report.md'}, {out / 'report.json'}, " + ", ".join(p.name for p in pngs), file=sys.stderr)
    return 0
