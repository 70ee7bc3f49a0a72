"""Flag groups and argparse helpers shared by the ``sfcl`` subcommands.

``add_model_flags`` (model, dtype, device, threads, cache dir) and ``add_snapshot_flags`` (engine
and snapshot layer) are the flag groups several commands take; ``configs`` turns a parsed
namespace into the config records of ``sfcl.config`` (flags map 1:1 onto their fields). ``FMT``
is the formatter every subcommand uses (defaults shown in ``--help``); ``describe_command``
records an ``sfcl anchors ...`` invocation in a library version's lineage.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sfcl.config import ATTENTION_KERNELS, DTYPE_CHOICES, SNAPSHOT_MODES, EngineConfig, ModelConfig, SnapshotConfig, default_cache_dir

class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to a flag's help, unless the help already says its default (it did
    both: "(default: bundled SmolLM2-135M-Instruct) (default: None)")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


FMT = {"formatter_class": DefaultsHelpFormatter}  # **FMT on every add_parser


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """--model, --dtype, --device, --threads, --cache-dir (``sfcl.config.ModelConfig``, cache dir)."""
    p.add_argument("--model", default=None,
                   help="model: a .gguf file or a local HF model folder (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="weights/activations dtype: auto (default) = bfloat16 where the CPU runs it natively "
                        "(AVX-512 BF16 / AMX, confirmed by a start-up GEMM probe; bf16 on CUDA), float32 elsewhere "
                        "(an AVX2-only CPU runs bf16 GEMMs 30-47x slower than fp32); the choice is logged on stderr")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:0)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for the engine (default: serve, for decode steps, all cores, measured "
                        "with bf16 on native bf16 and with float32 on AVX2 code paths; other commands, torch's)")
    p.add_argument("--cache-dir", default=None,
                   help="cache for converted weights and the default anchor library "
                        "(default $SFCL_CACHE_DIR or ~/.cache/sfcl; put it on local SSD)")


def add_snapshot_flags(p: argparse.ArgumentParser) -> None:
    """The engine and snapshot flags of ``serve`` and ``generate`` (``sfcl.config.EngineConfig``,
    ``sfcl.config.SnapshotConfig``)."""
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
    p.add_argument("--weight-quant", default="auto", choices=["auto", "none", "fp16", "int8", "int4"],
                   help="weight format of the linear layers (CPU): auto (default) = the fastest format whose NDA "
                        "perplexity stays within 1%% on this machine kind, logged as [WEIGHTS] on stderr (AVX2 "
                        "fp32: SFCL's int4 packed kernels for decode batches of 1-32 rows and for prompts, FBGEMM "
                        "fp16 weights above (none with --max-num-seqs <= 32: every row on the packed kernels), or 1-3 rows and FBGEMM fp16 for prompts where SFCL's kernels cannot "
                        "be built and torch's int4 kernel runs; native bf16: SFCL's int4 x int8 kernels for 1-8-row batches, or torch's "
                        "int4 kernel for 1-6 rows on a CPU with AMX, bf16 above); none = as loaded; fp16 = FBGEMM "
                        "fp16 weights; int8 "
                        "per-channel / int4 group-32 packed kernels for small batches")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (prefix cache, INT8 scales)")
    p.add_argument("--prefix-cache-tokens", type=int, default=32768,
                   help="prefix KV cache capacity in tokens (0 disables prefix caching)")
    p.add_argument("--no-shared-prefix-attention", action="store_true",
                   help="decode every row's attention over its own KV, even where decoding requests share "
                        "prefix-cache blocks (default: such rows read the shared positions once per group)")
    p.add_argument("--attention-kernel", choices=list(ATTENTION_KERNELS), default="auto",
                   help="CPU decode: auto = SFCL's fused kernels, attention plus every layer of a decode-only step in "
                        "one C++ call (compiled with the machine's C++ compiler on first use, ~1 min on 2 idle cores, cached in the "
                        "cache dir's kernels/; falls back to torch's operators when they cannot be built), "
                        "attention = the fused attention kernel only, torch = torch's operators")
    p.add_argument("--prefill-threads", type=int, default=None,
                   help="torch threads for steps computing >= 64 prompt tokens (default: all cores)")
    p.add_argument("--overlap-lookup", action="store_true",
                   help="CPU: run a step's anchor search on a lookup thread during the next step, so its events "
                        "follow their tokens' text (default: every search runs inside its step and a snapshot "
                        "event precedes its token's text; a step whose search includes a steering request always "
                        "searches in the step)")
    p.add_argument("--sync-lookup", action="store_true",
                   help="search inside the step (the default; kept for older command lines)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile (Inductor) the decode step in place of SFCL's fused decode kernels: slower than "
                        "the default on the CPUs measured (16 streams at 0.57-0.66x the default's tokens/s in bf16 and "
                        "0.66-0.87x in float32 on AVX2 code paths, +700-830 MiB peak RSS; AMD EPYC Zen 4, 2026-12-08), "
                        "kept to compare against; compiles at startup, 3-5 min on 2 cores the first time (Inductor "
                        "caches code under /tmp, so restarts take ~1 min); needs a C++ compiler on CPU; combines with "
                        "--weight-quant; not with --kv-cache-dtype int8")
    p.add_argument("--priority-tags", default="", help="comma-separated x-sfcl-tag values admitted first (e.g. high-risk)")
    p.add_argument("--metric-tags", default="high-risk", help="comma-separated tags kept as metric labels (others: other)")
    p.add_argument("--price-per-hour", type=float, default=0.0, help="device price in $/hour for the cost metrics")


def port(text: str) -> int:
    """argparse type: a TCP port (uvicorn hangs instead of failing on one out of range)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0-65535, got {port}")
    return port


def comma_list(text: str) -> tuple[str, ...]:
    """"a, b,,c" -> ("a", "b", "c") (the tag-list flags)."""
    return tuple(t.strip() for t in (text or "").split(",") if t.strip())


def configs(a: argparse.Namespace) -> tuple[ModelConfig, EngineConfig, SnapshotConfig]:
    """(ModelConfig, EngineConfig, SnapshotConfig) of a ``serve`` / ``generate`` namespace."""
    mc = ModelConfig(model=a.model, dtype=a.dtype, device=a.device, threads=a.threads,
                     weight_quant=getattr(a, "weight_quant", "auto"))
    ec = EngineConfig(max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len, max_waiting=a.max_waiting,
                      priority_tags=comma_list(a.priority_tags), metric_tags=comma_list(a.metric_tags),
                      price_per_hour=a.price_per_hour, max_num_batched_tokens=a.max_num_batched_tokens,
                      kv_cache_dtype=a.kv_cache_dtype, block_size=a.block_size,
                      prefix_cache_tokens=a.prefix_cache_tokens, compile=getattr(a, "compile", False),
                      enforce_eager=getattr(a, "enforce_eager", False),
                      prefill_threads=getattr(a, "prefill_threads", None),
                      overlap_lookup=getattr(a, "overlap_lookup", False) and not getattr(a, "sync_lookup", False),
                      shared_prefix_attention=not getattr(a, "no_shared_prefix_attention", False),
                      attention_kernel=getattr(a, "attention_kernel", "auto"))
    sc = SnapshotConfig(anchors=a.anchors, default_mode=a.snapshot_mode, anchor_timeout_s=a.anchor_timeout,
                        anchor_retry=a.anchor_retry, anchor_optional=a.anchor_optional, layer=a.layer,
                        keyword_boost=getattr(a, "keyword_boost", None), steer_lambda_max=a.steer_lambda_max,
                        cache_dir=cache_dir(a))
    return mc, ec, sc


def cache_dir(a: argparse.Namespace) -> Path:
    """``--cache-dir``, else ``$SFCL_CACHE_DIR`` or ~/.cache/sfcl (``sfcl.config.default_cache_dir``)."""
    return Path(a.cache_dir) if a.cache_dir else default_cache_dir()


def load_model_flags(a: argparse.Namespace):
    """The model named by ``add_model_flags`` (``sfcl.model.loader.load_model``), after setting
    ``--threads`` torch threads. Raises ModelLoadError (the CLI prints it, exit 2)."""
    import torch

    from sfcl.model.loader import load_model

    if a.threads:
        torch.set_num_threads(a.threads)
    return load_model(a.model, dtype=a.dtype, device=a.device, cache_dir=cache_dir(a))


def describe_command(a: argparse.Namespace) -> str:
    """A readable record of a CLI invocation (argparse namespace) for the lineage."""
    parts = ["sfcl", "anchors", str(getattr(a, "anchors_cmd", ""))]
    for k, v in sorted(vars(a).items()):
        if k in ("fn", "cmd", "anchors_cmd") or v is None or v is False:
            continue
        parts.append(f"{k}={v}" if not isinstance(v, list) else f"{k}={','.join(map(str, v))}")
    return " ".join(parts)
