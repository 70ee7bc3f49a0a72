"""``sfcl bench``: the flags of a benchmark run (``sfcl.bench.config.BenchConfig``, one field per
flag) and the command, which hands the record to ``sfcl.bench.run.run_bench``."""

from __future__ import annotations

import argparse
import dataclasses

from sfcl.bench import run
from sfcl.bench.config import DEFAULT_CONCURRENCY, BenchConfig
from sfcl.cli.flags import FMT
from sfcl.config import contractnli_path


class _SetFlag(argparse.Action):
    """Store the value and note that it was given (``--quick`` keeps a given ``--concurrency``)."""

    def __call__(self, parser, ns, values, option_string=None):
        setattr(ns, self.dest, values)
        ns.concurrency_set = True


def add_parser(sub) -> None:
    """Add ``bench`` to the top-level subparsers ``sub``."""
    p = sub.add_parser("bench", help="benchmark SFCL against HF transformers, llama.cpp and other servers",
                       description=run.__doc__.split("\n\n")[0], **FMT)
    p.add_argument("--systems", default="sfcl,llama-server,llamacpp",
                   help="comma-separated: sfcl (= sfcl-off,sfcl-triggered,sfcl-always), sfcl-MODE, llama-server "
                        "(llama.cpp's native server, -np = the concurrency level; built with cmake and cached when "
                        "absent), hf (= hf-bf16), hf-bf16, hf-fp32, llamacpp (llama-cpp-python's server)")
    p.add_argument("--peer-url", action="append", metavar="NAME=URL",
                   help="a running OpenAI-compatible server to include (repeatable), e.g. llama-server=http://127.0.0.1:8080")
    p.add_argument("--workloads", default="single,concurrent,longdoc", help="comma-separated: " + ", ".join(run.WORKLOADS))
    p.add_argument("--concurrency", default=DEFAULT_CONCURRENCY, action=_SetFlag,
                   help="closed-loop concurrency levels of the concurrent workload")
    p.add_argument("--requests-per-level", type=int, default=32,
                   help="requests per concurrency level (at least the level)")
    p.add_argument("--single-requests", type=int, default=8, help="requests of the single-stream workload")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of the short-prompt workloads")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request, top_p 1 (default 0: greedy, every system emits "
                        "its argmax; 1.0 is what both APIs default to and measures each system's sampler too; other "
                        "sampler settings stay at each server's defaults)")
    p.add_argument("--rounds", type=int, default=2,
                   help="SFCL's snapshot modes run the single and concurrent workloads in this many interleaved "
                        "rounds (off, triggered, always; always, triggered, off; ...; each round whole waves of the "
                        "level), so a drift in machine speed hits every mode alike; figures pool the rounds")
    p.add_argument("--separate-single", action="store_true",
                   help="run llama.cpp's single-stream workload on its own after SFCL's (default: llama.cpp's "
                        "server starts first and its single-stream requests take a turn in each of SFCL's rounds, "
                        "so machine-speed drift hits both sides of the single-stream ratio alike)")
    p.add_argument("--warmup-requests", type=int, default=2,
                   help="untimed requests sent to each system (concurrently) before it is measured")
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="do not ask systems to ignore EOS (default: ask; servers that reject ignore_eos stop at EOS)")
    p.add_argument("--longdoc-file", default=str(contractnli_path()),
                   help="ContractNLI JSON file ($SFCL_DATA_DIR/contractnli/dev.json when SFCL_DATA_DIR is set, "
                        "else ../shared/data/contractnli/dev.json beside the checkout)")
    p.add_argument("--longdoc-tokens", type=int, default=4000, help="pick the NDA closest to this many tokens")
    p.add_argument("--longdoc-questions", type=int, default=5, help="questions asked about the document, in sequence")
    p.add_argument("--longdoc-max-tokens", type=int, default=32, help="max_tokens of each long-document answer")
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: bundled SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--device", default="cpu", help="torch device for SFCL and HF (cpu, cuda)")
    p.add_argument("--hf-device", default=None, help="device of the HF peer (default: --device)")
    p.add_argument("--hf-attn", default="sdpa", choices=["sdpa", "eager"],
                   help="attention implementation of the HF peer (transformers' default is sdpa)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads given to every system")
    p.add_argument("--n-ctx", type=int, default=8192, help="llama.cpp context size")
    p.add_argument("--sfcl-args", default="", help="extra `sfcl serve` flags, e.g. \"--kv-cache-dtype int8\"")
    p.add_argument("--llamacpp-args", default="", help="extra `llama_cpp.server` flags")
    p.add_argument("--llama-server-ctx", type=int, default=4096,
                   help="llama-server: context tokens per slot (-c = -np x this; the long-document server gets at "
                        "least the document)")
    p.add_argument("--llama-server-args", default="", help="extra `llama-server` flags")
    p.add_argument("--no-llama-server-build", dest="llama_server_build", action="store_false",
                   help="skip llama-server when no binary is found ($SFCL_LLAMA_SERVER or the cache) instead of "
                        "building it from the llama-cpp-python sdist (cmake, several minutes)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a server may take to start")
    p.add_argument("--out", default=None, help="output folder (default bench-out/<UTC time>)")
    p.add_argument("--quick", action="store_true",
                   help="small settings for a smoke run: concurrency 4, 8 requests/level, 3 single requests, "
                        "16 tokens, a ~2k-token document with 3 questions of 8 tokens")
    p.set_defaults(fn=cmd_bench, concurrency_set=False)


def bench_config(a: argparse.Namespace) -> BenchConfig:
    """The ``BenchConfig`` of a parsed ``sfcl bench`` namespace (``--concurrency``: None unless given)."""
    got = {f.name: getattr(a, f.name) for f in dataclasses.fields(BenchConfig)}
    got["peer_url"] = tuple(a.peer_url or ())
    got["concurrency"] = a.concurrency if a.concurrency_set else None
    return BenchConfig(**got)


def cmd_bench(a: argparse.Namespace) -> int:
    return run.run_bench(bench_config(a))
