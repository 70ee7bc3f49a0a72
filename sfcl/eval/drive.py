"""Driving the engine offline for the evaluation tools: prompts, batched runs, per-request records.

Callers: ``sfcl eval``, ``sfcl anchors calibrate``, ``sfcl stress`` (in-process mode). The engine is
the real serving stack (``sfcl.engine_stack.build_engine``: model + anchor library + snapshotter +
scheduler + engine thread); requests go through ``AsyncEngine.stream`` exactly as HTTP requests do,
so batching, the prefix cache (when present) and the snapshot path are those of the server.

Prompts put the document first and the question last, so consecutive questions about one document
share their prompt prefix (a prefix KV cache reuses it). Documents longer than the token budget
are cut around the gold spans of their questions (``sfcl.eval.questions.fit_document``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
import zlib
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from sfcl.engine.events import ErrorEvent, Finished, SnapshotEvent, TextDelta
from sfcl.engine.request import SamplingParams

SYSTEM_QA = ("You answer questions about the contract given by the user, using only its text. Quote names, "
             "numbers, durations, amounts and clause numbers exactly as the contract states them. "
             "Answer in one short sentence.")


@dataclass(slots=True)
class Item:
    """One request of an evaluation run (torch-free)."""

    key: str  # unique id, e.g. the question id
    prompt_ids: list[int]
    max_tokens: int
    meta: dict = field(default_factory=dict)  # anything the caller wants back (question, doc id, ...)
    cad_prompt_ids: list[int] | None = None  # the prompt without its document (steering with cad)


@dataclass(slots=True)
class Snap:
    """One snapshot event of a request, as the evaluation keeps it."""

    token_index: int
    triggers: list[str]
    confidence: float
    steer: dict | None = None


@dataclass(slots=True)
class Record:
    """What one request produced."""

    key: str
    request_id: str = ""  # engine request id (for signal recorders)
    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    lookups: int = 0  # snapshot events (anchor lookups) of this request
    triggers: dict = field(default_factory=dict)  # trigger name -> count
    ttft_ms: float = 0.0
    e2e_ms: float = 0.0
    stop_reason: str = ""
    error: str | None = None
    snapshots: list[Snap] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # generated ids (filled from a TokenRecorder)
    signals: list[list[float]] = field(default_factory=list)  # per token: the trigger signals (TRIGGER_NAMES order)
    records: list[list[float]] = field(default_factory=list)  # per token: StepSignals.record columns

    @property
    def decode_s(self) -> float:
        """Seconds spent after the first token (0 when fewer than 2 tokens)."""
        return max(0.0, (self.e2e_ms - self.ttft_ms) / 1e3) if self.completion_tokens > 1 else 0.0


@dataclass(kw_only=True)
class EngineSpec:
    """Model + library + batch settings of the evaluation commands (``sfcl.cli.eval`` maps its flags
    onto these fields one to one; the flags' help says what each means)."""

    model: str | None  # .gguf file or HF folder; None = the bundled SmolLM2-135M-Instruct
    dtype: str  # auto | bfloat16 | float32 | float16
    device: str  # torch device
    threads: int | None  # torch threads; None = torch's default
    cache_dir: str | None  # None = $SFCL_CACHE_DIR or ~/.cache/sfcl
    anchors: str | None  # library directory; None = the default library
    max_num_seqs: int  # KV slots
    max_model_len: int  # tokens
    steer_lambda_max: float  # kNN-LM weight at confidence 1 (knn arms)
    weight_quant: str  # auto | none | fp16 | int8 | int4
    enforce_eager: bool  # CUDA: no graphs
    no_shared_prefix_attention: bool = False  # per-row decode attention even where rows share prefix blocks


def build(spec: EngineSpec, progress: bool = True):
    """``sfcl.engine_stack.Built`` (a started AsyncEngine, the model, the library) for ``spec``.
    Raises what ``sfcl.engine_stack.build_engine`` raises (ModelLoadError, AnchorLibraryError, ...)."""
    from pathlib import Path

    from sfcl.config import EngineConfig, ModelConfig, SnapshotConfig, default_cache_dir
    from sfcl.engine_stack import build_engine

    mc = ModelConfig(model=spec.model, dtype=spec.dtype, device=spec.device, threads=spec.threads,
                     weight_quant=spec.weight_quant)
    ec = EngineConfig(max_num_seqs=spec.max_num_seqs, max_model_len=spec.max_model_len, max_waiting=1024,
                      enforce_eager=spec.enforce_eager, shared_prefix_attention=not spec.no_shared_prefix_attention)
    sc = SnapshotConfig(anchors=spec.anchors, cache_dir=Path(spec.cache_dir) if spec.cache_dir else default_cache_dir(),
                        steer_lambda_max=spec.steer_lambda_max)
    return build_engine(mc, ec, sc, progress=progress)


def token_budget_chars(tokenizer, text: str, budget: int) -> int:
    """Largest char length (approximately) of a prefix of ``text`` that tokenizes to <= budget
    tokens; used to size document excerpts. Raises ValueError when budget < 1."""
    if budget < 1:
        raise ValueError("token budget must be >= 1")
    n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    chars = len(text)
    while n > budget and chars > 1:
        chars = max(1, int(chars * budget / n * 0.97))
        n = len(tokenizer(text[:chars], add_special_tokens=False)["input_ids"])
    return chars


def qa_prompt(document: str, question: str) -> str:
    return f"Contract:\n{document}\n\nQuestion: {question}"


async def _run_one(engine, item: Item, params: SamplingParams, sem: asyncio.Semaphore) -> Record:
    rec = Record(key=item.key, request_id=f"{uuid.uuid4().hex[:8]}-{item.key}")
    parts: list[str] = []
    async with sem:
        async for ev in engine.stream(item.prompt_ids, params, request_id=rec.request_id):
            if isinstance(ev, TextDelta):
                parts.append(ev.text)
            elif isinstance(ev, SnapshotEvent):
                rec.lookups += 1
                for t in ev.triggers:
                    rec.triggers[t] = rec.triggers.get(t, 0) + 1
                rec.snapshots.append(Snap(ev.token_index, list(ev.triggers), ev.confidence, ev.steer))
            elif isinstance(ev, Finished):
                rec.prompt_tokens, rec.completion_tokens = ev.prompt_tokens, ev.completion_tokens
                rec.ttft_ms, rec.e2e_ms, rec.stop_reason = ev.ttft_ms, ev.e2e_ms, ev.stop_reason
            elif isinstance(ev, ErrorEvent):
                rec.error = ev.message
    rec.text = "".join(parts)
    return rec


class TokenRecorder:
    """Wraps a ``ModelRunner.execute`` and keeps, per request id, the generated token ids, their
    trigger signals and (``ModelRunner(record_signals=True)``) their recorded trigger inputs.

    Install with ``with TokenRecorder(runner) as rec:`` while no request runs (the engine thread
    calls it; read ``seqs`` once the requests finished). Exiting restores the runner."""

    def __init__(self, runner, record_signals: bool = True):
        self.runner, self.flag = runner, record_signals
        self.seqs: dict[str, tuple[list[int], list[list[float]], list[list[float]]]] = {}

    def __enter__(self) -> "TokenRecorder":
        self.execute, self.was = self.runner.execute, self.runner.record_signals
        self.runner.execute, self.runner.record_signals = self, self.flag
        return self

    def __exit__(self, *exc) -> None:
        self.runner.execute, self.runner.record_signals = self.execute, self.was

    def __call__(self, plan):
        out = self.execute(plan)
        for rid, r in out.results.items():
            t, s, rec = self.seqs.setdefault(rid, ([], [], []))
            t.append(r.token_id)
            s.append(list(r.signals))
            if r.record is not None:
                rec.append(list(r.record))
        return out

    def fill(self, recs: list[Record]) -> None:
        """Copy the kept tokens into the records (and forget them)."""
        for r in recs:
            r.token_ids, r.signals, r.records = self.seqs.pop(r.request_id, ([], [], []))


def run_requests(engine, jobs: list[tuple[Item, str, object, float]], *, max_in_flight: int = 32,
                 on_done=None) -> list[Record]:
    """Run (item, snapshot mode, steer, random-trigger rate) jobs greedily (temperature 0)
    through an AsyncEngine, at most ``max_in_flight`` at a time, submitted in list order; items'
    cad prompts go along. on_done: called after each request. Returns records in job order."""
    async def main() -> list[Record]:
        sem = asyncio.Semaphore(max_in_flight)

        async def one(it: Item, mode: str, steer, rate: float) -> Record:
            p = SamplingParams(max_tokens=it.max_tokens, temperature=0.0, snapshot_mode=mode, steer=steer,
                               cad_prompt_ids=it.cad_prompt_ids, random_trigger=rate,
                               seed=zlib.crc32(it.key.encode()) if rate else None)  # random draws repeat per item
            r = await _run_one(engine, it, p, sem)
            if on_done is not None:
                on_done()
            return r
        return list(await asyncio.gather(*(one(*j) for j in jobs)))

    return asyncio.run(main())


def run_items(engine, items: list[Item], *, snapshot_mode: str, steer=False, max_in_flight: int = 32,
              desc: str = "requests", progress: bool = True, random_trigger: float = 0.0
              ) -> tuple[list[Record], float]:
    """Run ``items`` under one setting (``run_requests``) with a progress bar. steer: a
    ``SamplingParams.steer`` value; random_trigger: the random-trigger control's rate. Returns
    (records in item order, wall seconds)."""
    bar = tqdm(total=len(items), desc=desc, unit="req", disable=not progress, leave=False)
    t0 = time.perf_counter()
    try:
        recs = run_requests(engine, [(it, snapshot_mode, steer, random_trigger) for it in items],
                            max_in_flight=max_in_flight, on_done=lambda: bar.update(1))
    finally:
        bar.close()
    return recs, time.perf_counter() - t0
