"""``BenchConfig``: what one ``sfcl bench`` run measures, one field per flag (``sfcl.cli.bench``).

Fields hold the values as given; ``sfcl.bench.run.run_bench`` parses and checks them (systems,
workloads, concurrency levels) and raises ValueError naming the flag at fault.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sfcl.config import contractnli_path

DEFAULT_CONCURRENCY = "1,4,8,16,32"  # levels of the concurrent workload when none are given (quick: "4")


@dataclass(slots=True)
class BenchConfig:
    systems: str = "sfcl,llama-server,llamacpp"  # comma-separated names or aliases (sfcl.bench.run.KNOWN, ALIASES)
    peer_url: tuple[str, ...] = ()  # running OpenAI-compatible servers, each NAME=URL or URL
    workloads: str = "single,concurrent,longdoc"  # comma-separated, of sfcl.bench.run.WORKLOADS
    concurrency: str | None = None  # comma-separated levels; None: DEFAULT_CONCURRENCY (with quick: 4)
    requests_per_level: int = 32  # requests per concurrency level (at least the level)
    single_requests: int = 8  # requests of the single-stream workload
    max_tokens: int = 64  # max_tokens of the short-prompt workloads
    temperature: float = 0.0  # of every request, top_p 1 (0: greedy)
    rounds: int = 2  # interleaved rounds of SFCL's snapshot modes (single and concurrent workloads)
    separate_single: bool = False  # llama.cpp's single-stream workload on its own, not in SFCL's rounds
    warmup_requests: int = 2  # untimed requests per system before it is measured
    no_ignore_eos: bool = False  # do not ask systems to ignore EOS
    longdoc_file: str = field(default_factory=lambda: str(contractnli_path()))  # ContractNLI JSON ($SFCL_DATA_DIR)
    longdoc_tokens: int = 4000  # pick the NDA closest to this many tokens
    longdoc_questions: int = 5  # questions asked about the document, in sequence
    longdoc_max_tokens: int = 32  # max_tokens of each long-document answer
    model: str | None = None  # GGUF file or HF folder (None: bundled SmolLM2-135M-Instruct GGUF)
    device: str = "cpu"  # torch device for SFCL and HF
    hf_device: str | None = None  # device of the HF peer (None: device)
    hf_attn: str = "sdpa"  # attention implementation of the HF peer: sdpa | eager
    threads: int = 2  # CPU threads given to every system
    n_ctx: int = 8192  # llama.cpp context size
    sfcl_args: str = ""  # extra `sfcl serve` flags (shell syntax)
    llamacpp_args: str = ""  # extra `llama_cpp.server` flags (shell syntax)
    llama_server_ctx: int = 4096  # llama-server: context tokens per slot (-c = slots x this)
    llama_server_args: str = ""  # extra `llama-server` flags (shell syntax)
    llama_server_build: bool = True  # build llama-server with cmake when no binary is found (minutes)
    ready_timeout: float = 600.0  # seconds a server may take to start
    out: str | None = None  # output folder (None: bench-out/<UTC time>)
    quick: bool = False  # small settings for a smoke run (run_bench applies them)
