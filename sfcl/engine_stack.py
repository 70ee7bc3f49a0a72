"""Assembly of the engine stack: model + anchor library + snapshotter + scheduler + runner -> a running
AsyncEngine (hence the name: the one place where the layers are put together).

Used by ``sfcl serve`` and ``sfcl generate``. Anchor-loading diagnostics go to stderr, prefixed
``[ANCHOR]``, never to the stdout JSON request log.
"""

from __future__ import annotations

import concurrent.futures as cf
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from sfcl.config import EngineConfig, ModelConfig, SnapshotConfig
from sfcl.engine.async_engine import AsyncEngine
from sfcl.engine.engine import LLMEngine
from sfcl.engine.graph_runner import DecodeGraphRunner
from sfcl.engine.host_memory import keep_freed_memory
from sfcl.engine.model_runner import ModelRunner
from sfcl.engine.scheduler import Scheduler, SchedulerConfig
from sfcl.engine.threads import run_on_scratch_thread
from sfcl.library.store import AnchorLibrary, AnchorLibraryError
from sfcl.library.versions import load_library
from sfcl.metrics import PrometheusStatLogger
from sfcl.model import decode_kernel
from sfcl.model.hardware import WeightChoice, resolve_weight_format
from sfcl.model.kv_cache import KVCache
from sfcl.model.loader import LoadedModel, load_model
from sfcl.model.quant import QuantLinear, check_kernel_variables, pack_dense_weights, quantize_weights, resolved_cuts
from sfcl.snapshot.boost import load_rules
from sfcl.snapshot.entity import vocab_class_table
from sfcl.snapshot.grounding import Grounding
from sfcl.snapshot.snapshotter import Snapshotter
from sfcl.snapshot.steering import SteerConfig
from sfcl.snapshot.triggers import TriggerConfig


def served_weights(lm: LoadedModel, weight_quant: str = "auto", device: str = "cpu",
                   pack_dense: bool = True, max_decode_rows: int | None = None,
                   traceable: bool = False) -> tuple[WeightChoice, int]:
    """Put ``lm``'s weights in the format ``sfcl serve`` runs them in, in place: ``--weight-quant``
    resolved for its dtype and ``device`` (``sfcl.model.hardware.resolve_weight_format``), the model
    quantized (``quantize_weights``) and, with ``pack_dense`` (the server's unless ``--compile``), its
    dense bf16 / float32 weights packed for oneDNN (``pack_dense_weights``: the quantized formats' dense copies,
    and under ``none`` every projection and the lm_head). max_decode_rows: the largest decode batch
    (``--max-num-seqs``; None: any). Where the format puts prompt tokens on the packed kernels
    (``packed_prompts``) and no decode batch exceeds their ``max_rows``, no block projection row can take
    the dense path, so the block projections get no dense copy (``dense="packed"``, said on stderr); the
    lm_head keeps its own. traceable (``--compile``): dense paths the format puts on FBGEMM's fp16
    weights (``Fp16Linear``, whose packed ScriptObject Dynamo cannot trace: the compiled decode step
    broke its graph at the lm_head from 4 rows and recompiled mid-serving, a tester found) keep a
    plain copy in the model dtype instead (``dense="keep"``). The profiling scripts call it to
    measure the served model. Returns the choice and how many weights were packed."""
    wq = resolve_weight_format(weight_quant, next(lm.model.parameters()).dtype, device)
    dense = head_dense = "keep" if traceable and wq.dense == "fp16" else wq.dense
    if (wq.mode in ("int8", "int4") and wq.packed_prompts and wq.dense != "packed" and max_decode_rows is not None
            and max_decode_rows <= resolved_cuts(wq.mode, wq.lm_head, wq.max_rows, wq.head_max_rows)[1]):
        dense = "packed"
    quantize_weights(lm.model, wq.mode, max_rows=wq.max_rows, dense=dense, lm_head=wq.lm_head,
                     head_max_rows=wq.head_max_rows, packed_prompts=wq.packed_prompts, head_dense=head_dense)
    if dense == "packed":
        per = {"fp16": 2, "keep": next(lm.model.parameters()).element_size(), "dequant": 0}[head_dense]
        saved = per * sum(m.in_features * m.out_features for m in lm.model.layers.modules() if isinstance(m, QuantLinear))
        tagged_log("WEIGHTS", f"block projections without dense copies ({saved / 2**20:.0f} MiB not allocated): "
                              f"decode batches of at most {max_decode_rows} rows (--max-num-seqs) and prompt tokens "
                              f"all run on the packed kernels")
    return wq, (pack_dense_weights(lm.model) if pack_dense else 0)


def tagged_log(tag: str, msg: str) -> None:
    """One start-up progress line on stderr, ``[TAG] msg``."""
    print(f"[{tag}] {msg}", file=sys.stderr, flush=True)


def anchor_log(msg: str) -> None:
    tagged_log("ANCHOR", msg)


def default_library_path(lm: LoadedModel, scfg: SnapshotConfig) -> Path:
    from sfcl.anchors.builder import default_layer, library_cache_name
    from sfcl.anchors.corpus import corpus_hash, read_corpus, sample_corpus_files

    docs = read_corpus(sample_corpus_files())
    layer = default_layer(lm.args.n_layers) if scfg.layer is None else scfg.layer
    return scfg.cache_dir / "anchors" / library_cache_name(lm.fingerprint, corpus_hash(docs), layer, scfg.n_anchors)


def ensure_default_library(lm: LoadedModel, scfg: SnapshotConfig, progress: bool = True) -> Path:
    """Path of the default library (sample corpus), building it once into the cache dir."""
    from sfcl.anchors.builder import BuildConfig, build_library
    from sfcl.anchors.corpus import read_corpus, sample_corpus_files

    path = default_library_path(lm, scfg)
    if (path / "manifest.json").is_file():
        return path
    anchor_log(f"building the default anchor library from the bundled sample corpus into {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        build_library(lm, read_corpus(sample_corpus_files()), path,
                      BuildConfig(n_anchors=scfg.n_anchors, layer=scfg.layer), progress=progress)
    except FileExistsError:  # another process built it meanwhile
        pass
    return path


def load_anchors(lm: LoadedModel, scfg: SnapshotConfig, progress: bool = True) -> AnchorLibrary | None:
    """Load the configured library with timeout and retries.

    Returns None (snapshots disabled) only when ``anchor_optional`` is set; otherwise raises
    AnchorLibraryError with the reason.
    """
    last: Exception | None = None
    path = Path(scfg.anchors) if scfg.anchors else None
    if path is None:
        # A first start builds the default library (1-2 min on 2 cores, with a progress bar) before
        # the timed loads: --anchor-timeout bounds loading, and a timed-out build kept running in
        # its thread while each retry started another build of the same directory.
        try:
            path = ensure_default_library(lm, scfg, progress)
        except (AnchorLibraryError, OSError, ValueError) as e:
            last = AnchorLibraryError(f"building the default anchor library failed: {e}")
    for attempt in range(1, scfg.anchor_retry + 1 if path is not None else 1):
        t0 = time.monotonic()
        ex = cf.ThreadPoolExecutor(max_workers=1)
        try:
            def work() -> AnchorLibrary:
                return load_library(path, expect_fingerprint=lm.fingerprint,
                                    expect_hidden_size=lm.args.hidden_size, expect_model_name=lm.name)
            lib = ex.submit(work).result(timeout=scfg.anchor_timeout_s)
            anchor_log(f"Loaded {lib.n_anchors} anchors from {lib.path} (layer {lib.layer}, "
                       f"{(time.monotonic() - t0) * 1e3:.0f} ms)")
            return lib
        except cf.TimeoutError:
            last = AnchorLibraryError(f"loading the anchor library took longer than {scfg.anchor_timeout_s:.0f} s "
                                      "(raise --anchor-timeout)")
        except (AnchorLibraryError, OSError, ValueError) as e:
            last = e
        finally:
            ex.shutdown(wait=False)
        anchor_log(f"attempt {attempt}/{scfg.anchor_retry} failed: {last}")
        if isinstance(last, AnchorLibraryError) and "fingerprint" in str(last):
            break  # a model mismatch does not fix itself
        if attempt < scfg.anchor_retry:
            time.sleep(min(2.0, 0.25 * 2 ** attempt))
    if scfg.anchor_optional:
        anchor_log("starting WITHOUT snapshots (--anchor-optional): " + str(last))
        return None
    raise AnchorLibraryError(str(last))


def make_llm_engine(lm: LoadedModel, lib: AnchorLibrary | None, ecfg: EngineConfig,
                    scfg: SnapshotConfig | None = None, device: str = "cpu", decode_threads: int | None = None) -> LLMEngine:
    """Scheduler + KV cache + runner (+ snapshotter when a library is given), not yet threaded.
    decode_threads: with ``ecfg.prefill_threads``, the runner switches between the two per step."""
    from sfcl.anchors.builder import default_layer

    scfg = scfg or SnapshotConfig()
    snap = None
    if torch.device(device).type == "cpu":  # before the snapshotter: its anchor search uses the library too
        decode_kernel.load(cache_dir=scfg.cache_dir)
    if lib is not None:
        if not 0 <= lib.layer < lm.args.n_layers:
            raise AnchorLibraryError(f"library layer {lib.layer} does not exist in {lm.name}")
        snap = Snapshotter(lib, vocab_class_table(lm.tokenizer, lm.args.vocab_size, device), top_k=scfg.top_k,
                           keyword_boost=load_rules(scfg.keyword_boost) if scfg.keyword_boost else None,
                           cfg=TriggerConfig.from_calibration(lib.calibration),  # thresholds of `anchors calibrate`
                           steer=SteerConfig(lambda_max=scfg.steer_lambda_max), n_heads=lm.args.n_heads)
    layer = lib.layer if lib is not None else (scfg.layer if scfg.layer is not None else default_layer(lm.args.n_layers))
    max_len = min(ecfg.max_model_len or lm.args.max_position_embeddings, lm.args.max_position_embeddings)
    lm.model.fit_rope(max_len, "--max-model-len")  # positions past max_len never reach the model here
    dtype = next(lm.model.parameters()).dtype
    pool_blocks = ecfg.prefix_cache_tokens // ecfg.block_size
    kv = KVCache(lm.args, ecfg.max_num_seqs, max_len, dtype, device, kv_dtype=ecfg.kv_cache_dtype,
                 block_size=ecfg.block_size, pool_blocks=pool_blocks)
    if torch.device(device).type == "cpu":
        why = decode_kernel.enable(kv, lm.args, ecfg.attention_kernel, cache_dir=scfg.cache_dir)
        if kv.fused_decode:
            layers = ("; decode-only steps run every layer in one call" if kv.fused_layers
                      else "; layers as torch operators (--attention-kernel attention)")
            tagged_log("ENGINE", f"decode attention: SFCL's fused CPU kernel (ready in "
                                 f"{decode_kernel.load_seconds():.1f} s){layers}")
        else:
            tagged_log("ENGINE", f"decode attention: torch's operators ({why})")
    cuda = torch.device(device).type == "cuda"
    graphs = DecodeGraphRunner(lm.model, kv, layer, capture=True) if cuda and not ecfg.enforce_eager else None
    compiled = None
    if ecfg.compile and graphs is None:  # on CUDA the captured graphs already remove the op overhead
        from sfcl.model.compiled import CompiledDecode

        compiled = CompiledDecode(lm.model, kv)  # ValueError with an INT8 KV cache
        tagged_log("ENGINE", "compiling the decode step (torch.compile, once per process) ...")
        tagged_log("ENGINE", f"compiled in {compiled.warmup(layer):.0f} s")
        if kv.fused_layers:
            tagged_log("ENGINE", "note: the compiled step replaces SFCL's fused decode kernels, which were faster where "
                                 "measured (16 streams: the compiled step at 0.57-0.87x their tokens/s, AMD EPYC Zen 4, "
                                 "2026-12-08; docs/engine.md); leave --compile out unless comparing")
        if compiled.uncompiled:
            tagged_log("ENGINE", f"warning: torch.compile compiled no graph for decode batches of "
                                 f"{compiled.uncompiled} rows; those steps run eager (TORCH_LOGS=recompiles says why)")
        if compiled.graph_breaks:
            tagged_log("ENGINE", f"warning: the compiled decode step has {compiled.graph_breaks} graph breaks: "
                                 f"parts of it run eager and may recompile while serving (TORCH_LOGS=graph_breaks says where)")
    runner = ModelRunner(lm.model, kv, layer, snap, device, graphs=graphs, fused_lookup=cuda,
                         compiled_decode=compiled, prefill_threads=ecfg.prefill_threads,
                         decode_threads=decode_threads, overlap_lookup=ecfg.overlap_lookup,
                         grounding=Grounding.for_model(lm, ecfg.max_num_seqs, device, snap.class_table) if snap is not None else None)
    if cuda and snap is not None:
        snap.device_index(device)  # upload the search copy now, not in the first step
    sched = Scheduler(SchedulerConfig(max_num_seqs=ecfg.max_num_seqs, max_model_len=max_len,
                                      max_waiting=ecfg.max_waiting, priority_tags=ecfg.priority_tags,
                                      max_num_batched_tokens=ecfg.max_num_batched_tokens,
                                      block_size=ecfg.block_size, prefix_cache_blocks=pool_blocks,
                                      shared_prefix_attention=ecfg.shared_prefix_attention))
    return LLMEngine(sched, runner, lm.tokenizer, lm.eos_token_ids, lib)


def make_reloader(lm: LoadedModel, scfg: SnapshotConfig, device: str = "cpu"):
    """``reload(path | None) -> (AnchorLibrary, Snapshotter)`` for ``AsyncEngine.reload_anchors``:
    loads and fully validates (checksums, model fingerprint, hidden size, calibration, keyword
    rules) the library at ``path`` (default: the configured one, so a ``current -> vN`` symlink is
    re-resolved). Raises AnchorLibraryError; nothing is swapped by this function."""
    table = vocab_class_table(lm.tokenizer, lm.args.vocab_size, device)

    def reload(path: str | None = None):
        p = Path(path) if path else (Path(scfg.anchors) if scfg.anchors else default_library_path(lm, scfg))
        lib = load_library(p, expect_fingerprint=lm.fingerprint, expect_hidden_size=lm.args.hidden_size,
                           expect_model_name=lm.name)
        try:
            rules = load_rules(scfg.keyword_boost) if scfg.keyword_boost else None
            snap = Snapshotter(lib, table, top_k=scfg.top_k, keyword_boost=rules,
                               cfg=TriggerConfig.from_calibration(lib.calibration),
                               steer=SteerConfig(lambda_max=scfg.steer_lambda_max), n_heads=lm.args.n_heads)
            if torch.device(device).type == "cuda":
                snap.device_index(device)  # fused lookup: upload the search copy before the swap
            return lib, snap
        except ValueError as e:
            lib.close()
            raise AnchorLibraryError(f"anchor library {p}: {e}") from e
    return reload


@dataclass(slots=True)
class Built:
    engine: AsyncEngine
    lm: LoadedModel
    library: AnchorLibrary | None


_CORES = torch.get_num_threads()  # torch's default, before anything here changes it


def engine_threads(threads: int | None, prefill_threads: int | None, cores: int | None = None) -> tuple[int, int]:
    """(decode threads, prefill threads) of the server's engine thread.

    Defaults: all cores for both, each measured behind HTTP with ``sfcl bench`` on 2 cores.
    Prefill: prompt chunks are compute-bound GEMMs (2,437 vs 1,297 prompt tokens/s on 2 vs 1
    thread). Decode:
    - a bf16 model on the AVX-512 BF16 EPYC, 2026-12-04: single stream TPOT p50 20.6 ms on 2
      threads vs 25.1 on 1, 16 streams 157.9 vs 122.6 tok/s;
    - a float32 model (``--dtype auto`` without native bf16) on AVX2 code paths (torch and SFCL's
      kernels restricted to AVX2 on that EPYC, 2026-12-05, two A/B pairs): TPOT 14.8 / 16.7 ms vs
      21.1 / 20.4, 16 streams 166.8 / 150.1 vs 143.5 / 139.0 tok/s, 32 streams 159.3 / 160.2 vs
      135.9 / 129.0. (Until then cores - 1 was the default without native bf16, from an AVX2-only
      EPYC where 2 threads lost to 1 while a leftover OpenMP pool slowed every 2-thread region;
      after that fix 2 threads were already faster there, 34.2 / 45.8 vs 55.0 / 51.3 ms;
      ``docs/performance-journal.md``.)
    cores: torch's default thread count at import (its count of physical cores) unless given."""
    cores = cores or _CORES
    decode = threads or cores
    return decode, prefill_threads or max(decode, cores)


def build_engine(mcfg: ModelConfig, ecfg: EngineConfig, scfg: SnapshotConfig, progress: bool = True) -> Built:
    """Load everything and start the engine thread. Raises ModelLoadError / AnchorLibraryError, and
    ValueError for a bad ``$SFCL_INT4_KERNEL`` / ``$SFCL_INT8_KERNEL`` before anything loads.
    Sets the host allocator's thresholds first (``sfcl.engine.host_memory``). The loading (on all
    cores) runs on a thread that exits before this returns, so that no OpenMP pool but the engine
    thread's outlives it (``sfcl.engine.threads``: a leftover pool slowed every prompt chunk)."""
    check_kernel_variables()
    return run_on_scratch_thread(_build_engine, mcfg, ecfg, scfg, progress, name="sfcl-load")


def _build_engine(mcfg: ModelConfig, ecfg: EngineConfig, scfg: SnapshotConfig, progress: bool) -> Built:
    malloc_tuned = keep_freed_memory()
    _, prefill_threads = engine_threads(mcfg.threads, ecfg.prefill_threads)  # loading runs on prefill's
    main_threads = torch.get_num_threads()  # torch's process-wide count (new threads take it) comes back at the end
    try:
        torch.set_num_threads(prefill_threads)  # loading, and a first start's anchor build, are bulk work
        lm = load_model(mcfg.model, dtype=mcfg.dtype, device=mcfg.device, cache_dir=scfg.cache_dir)
        if torch.device(mcfg.device).type == "cpu":  # built into --cache-dir before anything else loads them
            decode_kernel.load(cache_dir=scfg.cache_dir)  # (the library build's search, the int4 kernel choice)
        lib = load_anchors(lm, scfg, progress)
        decode_threads, prefill_threads = engine_threads(mcfg.threads, ecfg.prefill_threads)
        mcfg = replace(mcfg, threads=decode_threads)
        ecfg = replace(ecfg, prefill_threads=prefill_threads if prefill_threads != decode_threads else None)
        tagged_log("ENGINE", f"torch threads: decode {decode_threads}, prefill {prefill_threads}")
        # after the library: a default library built on first start comes from the unquantized weights
        # (its cache name holds the fingerprint, which the untouched embedding leaves unchanged)
        wq, n_packed = served_weights(lm, mcfg.weight_quant, mcfg.device, pack_dense=not ecfg.compile,
                                     max_decode_rows=ecfg.max_num_seqs, traceable=ecfg.compile)
        if n_packed:
            used = "every product" if wq.mode == "none" else "prompt chunks and batches above the packed kernels' rows"
            dtype = str(lm.model.embed_tokens.weight.dtype).removeprefix("torch.")
            tagged_log("ENGINE", f"{n_packed} dense {dtype} weights packed for oneDNN ({used})")
        torch.set_num_threads(decode_threads)  # --compile warms up its decode graphs here
        engine = make_llm_engine(lm, lib, ecfg, scfg, mcfg.device, decode_threads=decode_threads)
        max_len = engine.scheduler.cfg.max_model_len
        extra = {"anchors": {"path": str(lib.path), "n_anchors": lib.n_anchors, "layer": lib.layer} if lib else None,
                 "default_snapshot_mode": scfg.default_mode, "malloc_tuned": malloc_tuned}
        metrics = PrometheusStatLogger(engine.runner.snapshotter is not None,
                                       known_tags=tuple(ecfg.metric_tags) + tuple(ecfg.priority_tags),
                                       n_anchors=lib.n_anchors if lib else 0, price_per_hour=ecfg.price_per_hour,
                                       kv_slots=ecfg.max_num_seqs)
        ae = AsyncEngine(engine, model_name=lm.name, max_model_len=max_len, tokenizer=lm.tokenizer,
                         metrics=metrics, extra_health=extra, num_threads=mcfg.threads,
                         reloader=make_reloader(lm, scfg, mcfg.device))
    finally:
        torch.set_num_threads(main_threads)  # the engine thread sets its own (decode_threads)
    return Built(engine=ae, lm=lm, library=lib)
