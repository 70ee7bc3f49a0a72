"""Configuration records, one per concern. CLI flags map 1:1 onto these fields (``sfcl.cli``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

SNAPSHOT_MODES: tuple[str, ...] = ("off", "triggered", "always")  # the values of sfcl.engine.events.SnapshotMode


def default_cache_dir() -> Path:
    return Path(os.environ.get("SFCL_CACHE_DIR", Path.home() / ".cache" / "sfcl"))


def contractnli_path() -> Path:
    """Where the ContractNLI dev set (``contractnli/dev.json``; Koreeda & Manning 2021, CC BY 4.0,
    never copied into the repo) is read from: ``$SFCL_DATA_DIR/contractnli/dev.json`` when
    ``SFCL_DATA_DIR`` is set, else ``../shared/data/contractnli/dev.json`` beside the SFCL source
    checkout this package was imported from, else beside the checkout containing the current
    working directory. Returns the first candidate that exists, or the first candidate (for the
    error message) when none does; never raises. The one place this path is computed: the bench's
    long-document workload, ``sfcl eval``, the scripts and the tests all call it."""
    env = os.environ.get("SFCL_DATA_DIR")
    if env:
        return Path(env).expanduser() / "contractnli" / "dev.json"
    roots = []
    here = Path(__file__).resolve().parents[1]  # the checkout; site-packages when installed
    if (here / "pyproject.toml").is_file():
        roots.append(here)
    cwd = Path.cwd().resolve()
    roots += [d for d in (cwd, *cwd.parents) if (d / "pyproject.toml").is_file()][:1] or [cwd]
    paths = [r.parent / "shared" / "data" / "contractnli" / "dev.json" for r in roots]
    return next((p for p in paths if p.is_file()), paths[0])


DTYPE_CHOICES = ("auto", "bfloat16", "float32", "float16")  # --dtype; "auto": sfcl.model.hardware.choose_dtype
MAX_THREADS = 1024  # torch.set_num_threads(100000) segfaults in the OpenMP pool (4096 works)


@dataclass(slots=True)
class ModelConfig:
    model: str | None = None  # None: bundled SmolLM2-135M-Instruct; else .gguf path or HF folder
    dtype: str = "auto"  # auto (bf16 where the CPU runs it natively, else fp32: sfcl.model.hardware) | bfloat16 | float32 | float16
    device: str = "cpu"
    threads: int | None = None  # torch intra-op threads of the engine thread for decode (None: serve picks
    # all cores, see sfcl.engine_stack.engine_threads; other commands: torch's default)
    weight_quant: str = "auto"  # auto | none | fp16 | int8 | int4: linear-layer weight format (sfcl.model.quant, CPU;
    # auto: sfcl.model.hardware.choose_weight_format picks per machine, none elsewhere than a CPU)

    def __post_init__(self) -> None:
        if self.threads is not None and not 1 <= self.threads <= MAX_THREADS:
            raise ValueError(f"threads must be 1..{MAX_THREADS}, got {self.threads}")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}")
        if self.weight_quant not in ("auto", "none", "fp16", "int8", "int4"):
            raise ValueError("weight_quant must be auto, none, fp16, int8 or int4")
        if self.weight_quant not in ("auto", "none") and not str(self.device).startswith("cpu"):
            raise ValueError(f"--weight-quant {self.weight_quant} runs on the CPU only (torch's packed int8/int4 "
                             f"and FBGEMM fp16 CPU kernels); use --weight-quant auto or none with --device {self.device}")


ATTENTION_KERNELS = ("auto", "attention", "torch")


@dataclass(slots=True)
class EngineConfig:
    max_num_seqs: int = 16  # largest decode batch (KV slots)
    max_model_len: int | None = None  # None: the model's context window
    max_waiting: int = 256  # bounded waiting queue (full -> 529/429)
    priority_tags: tuple[str, ...] = ()  # x-sfcl-tag values admitted before untagged requests
    metric_tags: tuple[str, ...] = ("high-risk",)  # tag label values kept in metrics (others: "other")
    price_per_hour: float = 0.0  # device price, dollars/hour, for the cost series (0: cost reads 0)
    max_num_batched_tokens: int = 512  # tokens per engine step (decode rows + prompt chunk): chunked prefill
    kv_cache_dtype: str = "auto"  # auto (= model dtype) | int8 (block-wise, KIVI-style)
    block_size: int = 16  # KV block size in tokens (prefix cache, INT8 key scales)
    prefix_cache_tokens: int = 32768  # prefix-cache pool capacity in tokens (0: off)
    compile: bool = False  # torch.compile the decode-only step (sfcl.model.compiled); compiles at startup
    enforce_eager: bool = False  # never capture CUDA graphs for decode (on a CPU decode is always eager)
    prefill_threads: int | None = None  # torch threads for steps with >= PREFILL_THREADS_MIN_TOKENS prompt tokens
    # (None: same as decode; serve picks all cores, see sfcl.engine_stack.engine_threads)
    # CPU: anchor searches of non-steering rows run on a lookup thread during the next step (ModelRunner).
    # Off by default: in the step, served lookup p99 was 1.0 / 1.9 ms at 1 stream and 2.8 / 3.0 ms at 16
    # against 6.7 / 5.8 and 10.1 / 33.0 ms overlapped (the lookup thread waits for a core behind the
    # engine's threads and the event loop), with no throughput lost (two A/B pairs of sfcl bench
    # --systems sfcl-off,sfcl-triggered, 2-core AVX-512 BF16 EPYC, 2026-12-04; docs/benchmarks.md)
    overlap_lookup: bool = False
    shared_prefix_attention: bool = True  # decode rows sharing prefix-cache blocks read them once (scheduler.decode_groups)
    # decode on the CPU: "auto" = sfcl's fused kernels (sfcl.model.decode_kernel: attention, and every layer
    # of a decode-only step in one call, sfcl.model.decode_stack; built with the machine's C++ compiler on
    # first use, eager torch ops when it cannot be), "attention" = the fused attention kernel only (layers
    # as torch operators called from Python), "torch" = torch's operators
    attention_kernel: str = "auto"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_waiting < 1:
            raise ValueError("max_num_seqs and max_waiting must be >= 1")
        if self.kv_cache_dtype not in ("auto", "int8"):
            raise ValueError("kv_cache_dtype must be auto or int8")
        if self.block_size < 1 or self.prefix_cache_tokens < 0:
            raise ValueError("block_size must be >= 1 and prefix_cache_tokens >= 0")
        if self.max_num_batched_tokens < self.block_size + self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens must be >= block_size + max_num_seqs "
                             f"({self.block_size + self.max_num_seqs})")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"attention_kernel must be one of {', '.join(ATTENTION_KERNELS)}, not {self.attention_kernel!r}")
        if self.compile and self.kv_cache_dtype == "int8":
            raise ValueError("--compile works with the bf16/fp32 KV cache, not --kv-cache-dtype int8")
        if self.price_per_hour < 0:
            raise ValueError("price_per_hour must be >= 0")
        if self.prefill_threads is not None and not 1 <= self.prefill_threads <= MAX_THREADS:
            raise ValueError(f"prefill_threads must be 1..{MAX_THREADS}, got {self.prefill_threads}")
        self.priority_tags, self.metric_tags = tuple(self.priority_tags), tuple(self.metric_tags)


@dataclass(slots=True)
class SnapshotConfig:
    anchors: str | None = None  # library dir; None: default library built from the sample corpus
    default_mode: str = "triggered"  # off | triggered | always (requests may override)
    anchor_timeout_s: float = 120.0  # give up loading (or building) the library after this long
    anchor_retry: int = 3  # load attempts before failing
    anchor_optional: bool = False  # start without snapshots if the library cannot be loaded
    layer: int | None = None  # snapshot layer for the default library (None: 3/4 depth)
    n_anchors: int = 32768
    top_k: int = 3
    steer_lambda_max: float = 0.5  # kNN-LM interpolation weight at snapshot confidence 1 (steering requests)
    keyword_boost: str | None = None  # JSON file of keyword-boost rules (sfcl.snapshot.boost), added to the library's
    cache_dir: Path = field(default_factory=default_cache_dir)

    def __post_init__(self) -> None:
        if self.default_mode not in SNAPSHOT_MODES:
            raise ValueError(f"snapshot mode must be one of {', '.join(SNAPSHOT_MODES)}")
        if self.anchor_timeout_s <= 0 or self.anchor_retry < 1:
            raise ValueError("anchor timeout must be > 0 and retries >= 1")
        self.cache_dir = Path(self.cache_dir).expanduser()


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be in 0..65535")
