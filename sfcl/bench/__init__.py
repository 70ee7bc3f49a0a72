"""``sfcl bench``: SFCL against its peers, same weights, same machine, one run.

Modules: ``workloads`` (prompts: short sample-corpus prompts, one long ContractNLI NDA),
``clients`` (streaming OpenAI-compatible client: TTFT, inter-token gaps, tokens, snapshots),
``peers`` (servers as subprocesses on free ports, readiness, peak RSS of the process tree),
``hf_runner`` (transformers ``generate()`` in a subprocess, timed per step), ``stats``
(percentiles, variance, per-workload summaries), ``report`` (markdown, JSON, PNG, target ratios),
``config`` (``BenchConfig``, one field per ``sfcl bench`` flag; the parser is ``sfcl.cli.bench``),
``run`` (the orchestration: ``run_bench(BenchConfig)``). Everything runs on the host CPU except
the servers' and the HF subprocess' own model work (CPU or CUDA, as they were started).
"""
