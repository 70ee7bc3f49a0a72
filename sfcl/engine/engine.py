"""LLMEngine: one step = schedule, execute, update. Nothing else lives between those three calls.

``step()`` asks the scheduler (torch-free) for a plan, has the model runner execute it (tensors),
then updates request state from the runner's plain results and turns them into typed events
(``sfcl.engine.events``): text deltas from the incremental detokenizer, snapshot events, and a
``Finished`` record per completed request. A lookup the runner overlaps with the next step
(``ModelRunner(overlap_lookup=True)``, ``sfcl serve --overlap-lookup``) becomes its snapshot event in that step's update, after its
token's text and before the next token's (its ``token_index`` names the token), or before
``Finished`` when it was the request's last token. Single-threaded: ``sfcl.engine.async_engine`` runs it
on the one thread that owns the model.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from sfcl.engine.detokenizer import IncrementalDetokenizer
from sfcl.engine.events import AnchorHit, EngineEvent, ErrorEvent, Finished, SnapshotEvent, Started, TextDelta
from sfcl.engine.model_runner import ModelRunner, PendingSnapshot, RunnerOutput, SeqResult
from sfcl.engine.request import SamplingParams
from sfcl.engine.scheduler import Scheduler, SchedulerOutput, Sequence
from sfcl.snapshot.snapshotter import Binding, SnapshotHit

log = logging.getLogger("sfcl.engine")


@dataclass(slots=True)
class RequestState:
    seq: Sequence
    detok: IncrementalDetokenizer
    n_snapshots: int = 0
    trigger_counts: Counter = field(default_factory=Counter)
    anchor_counts: Counter = field(default_factory=Counter)
    bind: Binding | None = None  # library version + keyword boost this request runs with
    pending: tuple[PendingSnapshot, SeqResult, int] | None = None  # overlapped lookup: (it, token result, index)


@dataclass(slots=True)
class StepStats:
    """What one step did; the metrics logger turns these into series."""

    prefill_tokens: int = 0
    decode_batch: int = 0
    generated: int = 0
    lookups: int = 0
    lookup_ms: float = 0.0
    step_ms: float = 0.0
    finished: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix KV cache this step
    prefix_cache_hits: int = 0  # of those, tokens whose KV was found in the cache (not recomputed)


class LLMEngine:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, tokenizer, eos_token_ids: list[int],
                 library=None):
        self.scheduler = scheduler
        self.runner = runner
        self.tok = tokenizer
        self.eos = set(eos_token_ids)
        self.library = library
        self.requests: dict[str, RequestState] = {}
        self.pending: dict[str, RequestState] = {}  # requests whose last token's lookup is overlapped
        self._resolved_n, self._resolved_ms = 0, 0.0  # overlapped lookups resolved so far, their search ms
        self.last_stats = StepStats()

    # -- intake (engine thread only) -----------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> list[tuple[str, EngineEvent]]:
        """Queue a request. Raises QueueFullError / ValueError from the scheduler."""
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id}")
        seq = Sequence(request_id=request_id, prompt_ids=list(prompt_ids), params=params)
        self.scheduler.add(seq)
        snap = self.runner.snapshotter  # keyword boost matches the prompt text once, at admission
        text = self.tok.decode(prompt_ids, skip_special_tokens=True) if snap is not None and snap.rules else None
        self.requests[request_id] = RequestState(seq=seq, detok=IncrementalDetokenizer(self.tok, params.stop),
                                                 bind=self.runner.admit(request_id, text))
        return [(request_id, Started(request_id=request_id, prompt_tokens=len(prompt_ids)))]

    def abort(self, request_id: str) -> bool:
        """End ``request_id`` now, without events (its client is gone). Returns False when it was
        not running or waiting (already finished, or unknown)."""
        if self.scheduler.abort(request_id):
            self._drop(request_id)
            return True
        return False

    def swap_library(self, library, snapshotter) -> None:
        """Make ``library`` (with its ``snapshotter``) current for requests admitted from now on;
        running requests keep the version they were admitted with. Call between steps only."""
        self.library = library
        self.runner.snapshotter = snapshotter

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def cut_all(self) -> list[tuple[str, EngineEvent]]:
        """End every request now (graceful shutdown past its deadline): each gets what it is owed
        (``_flush``), then an ``ErrorEvent`` of type ``overloaded_error`` saying how many tokens it
        got, so that a client retries instead of reading a cut answer as complete (a ``stop_reason``
        of ``max_tokens`` would claim the answer hit the limit it asked for). Never raises: a
        request whose pending snapshot cannot be built still gets its error."""
        events: list[tuple[str, EngineEvent]] = []
        for st in list(self.requests.values()):
            seq, rid = st.seq, st.seq.request_id
            try:
                events.extend(self._flush(st))
            except Exception:  # the error below still ends this request; the others go on
                log.exception("request %s: could not flush its last events at shutdown", rid)
            self.scheduler.finish(seq, "aborted")
            self._drop(rid)
            events.append((rid, ErrorEvent(
                f"the server is shutting down: generation stopped after {len(seq.output_ids)} output tokens; "
                "retry the request", "overloaded_error", tag=seq.params.tag)))
        return events

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[tuple[str, EngineEvent]]:
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        out = self.runner.execute(plan) if not plan.is_empty else RunnerOutput()
        self.scheduler.step_done()
        n0, ms0 = self._resolved_n, self._resolved_ms
        events = self.update(plan, out)
        n1, ms1 = self._resolved_n, self._resolved_ms
        self.last_stats = StepStats(prefill_tokens=out.prefill_tokens, decode_batch=out.decode_batch,
                                    prefix_cache_queries=plan.prefix_queries, prefix_cache_hits=plan.prefix_hits,
                                    generated=len(out.results), lookups=out.lookups + n1 - n0,
                                    lookup_ms=out.lookup_ms + ms1 - ms0,
                                    step_ms=(time.perf_counter() - t0) * 1e3,
                                    finished=sum(1 for _, e in events if isinstance(e, Finished)))
        return events

    def update(self, plan: SchedulerOutput, out: RunnerOutput) -> list[tuple[str, EngineEvent]]:
        # the previous step's overlapped lookups ran during this step's forward: their events first
        events: list[tuple[str, EngineEvent]] = []
        for st in list(self.pending.values()):
            try:
                events.extend(self._resolve(st))
            except Exception:  # as in _advance: building its event failed, that request ends, no other
                events.extend(self._fail(st.seq))
        now = time.monotonic()
        for seq in plan.sampled:
            res = out.results.get(seq.request_id)
            st = self.requests.get(seq.request_id)
            if res is None or st is None:
                continue
            try:
                events.extend(self._advance(st, res, now))
            except Exception:  # one request's bookkeeping failed: end that request only
                events.extend(self._fail(seq))
        return events

    def _fail(self, seq: Sequence) -> list[tuple[str, EngineEvent]]:
        """End ``seq`` with an error after its bookkeeping raised (call inside ``except``)."""
        log.exception("request %s failed in update", seq.request_id)
        self.scheduler.finish(seq, "aborted")
        self._drop(seq.request_id)
        return [(seq.request_id, ErrorEvent("internal error while processing this request", "api_error",
                                            tag=seq.params.tag))]

    def _advance(self, st: RequestState, res: SeqResult, now: float) -> list[tuple[str, EngineEvent]]:
        seq, rid = st.seq, st.seq.request_id
        ev: list[tuple[str, EngineEvent]] = []
        seq.output_ids.append(res.token_id)
        if seq.first_token_s is None:
            seq.first_token_s = now
        else:
            seq.token_gaps_s.append(now - seq.last_token_s)
        seq.last_token_s = now
        idx = len(seq.output_ids) - 1
        if res.snapshot is not None:
            ev.append((rid, self._snapshot_event(st, res, res.snapshot, idx)))
        elif res.pending is not None:  # its event comes with the next step (or before Finished)
            st.pending = (res.pending, res, idx)
            self.pending[rid] = st
        if res.token_id in self.eos and not seq.params.ignore_eos:
            return ev + self._finish(st, "end_turn", None)
        text, stop_hit = st.detok.add(res.token_id)
        if text:
            ev.append((rid, TextDelta(text=text, token_index=idx)))
        if stop_hit is not None:
            return ev + self._finish(st, "stop_sequence", stop_hit)
        if len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= self.scheduler.cfg.max_model_len:
            return ev + self._finish(st, "max_tokens", None)
        return ev

    def _resolve(self, st: RequestState) -> list[tuple[str, EngineEvent]]:
        """Wait for ``st``'s overlapped lookup and turn it into its snapshot event. A failed search
        is logged and costs the request that one event, nothing else."""
        pend, res, idx = st.pending
        st.pending = None
        self.pending.pop(st.seq.request_id, None)
        try:
            hit = pend.result()
        except Exception:
            log.exception("anchor lookup for request %s failed", st.seq.request_id)
            return []
        self._resolved_n += 1
        self._resolved_ms += hit.lookup_ms / len(pend.future.result())  # a search's rows share its time
        return [(st.seq.request_id, self._snapshot_event(st, res, hit, idx))]

    def _snapshot_event(self, st: RequestState, res: SeqResult, hit: SnapshotHit, idx: int) -> SnapshotEvent:
        lib = st.bind.snap.lib if st.bind is not None else self.library
        ctx = hit.context or [False] * len(hit.anchor_ids)
        rid = st.seq.request_id
        top = [AnchorHit(anchor_id=a, score=s, kind="context", span={
                   "doc_id": "prompt", "start": a, "end": a + 1, "unit": "token",
                   "text": self.runner.context.span_text(rid, a, self.tok)}) if c else
               AnchorHit(anchor_id=a, score=s, kind=lib.kind_name(a), span=lib.span(a))
               for a, s, c in zip(hit.anchor_ids, hit.scores, ctx)]
        best = hit.best_library_anchor  # the event's anchor_id is always a library row
        st.trigger_counts.update(hit.triggers)
        st.anchor_counts[best] += 1
        steer = None if hit.steer is None else self._steer_dict(st, hit.steer)
        e = SnapshotEvent(snapshot_id=st.n_snapshots, token_index=idx, trigger=hit.triggers[0],
                          triggers=hit.triggers, anchor_id=best, confidence=hit.confidence,
                          token=self.tok.decode([res.token_id]), token_logprob=res.logprob,
                          entropy=res.entropy, top=top, lookup_ms=hit.lookup_ms,
                          library_version=hit.library_version or None, steer=steer)
        st.n_snapshots += 1
        return e

    def _steer_dict(self, st: RequestState, info) -> dict:
        """The event's ``steer`` object: what grounded correction did to this token."""
        span = None
        if info.source_span is not None:
            a, b = info.source_span
            span = {"start": a, "end": b, "unit": "token",
                    "text": self.tok.decode(st.seq.prompt_ids[a:b], skip_special_tokens=True)}
        return {"mechanism": info.mechanism, "original_token": self.tok.decode([info.original_token]),
                "token": self.tok.decode([info.token]), "changed": info.changed, "supported": info.supported,
                "unsupported": info.supported is False, "source_span": span, "reason": info.reason or None,
                "lambda": info.lam, "alpha": info.alpha}

    def _flush(self, st: RequestState) -> list[tuple[str, EngineEvent]]:
        """What a request is owed before it ends: its overlapped lookup's snapshot event and the
        text the detokenizer still holds back."""
        rid = st.seq.request_id
        ev: list[tuple[str, EngineEvent]] = self._resolve(st) if st.pending is not None else []
        tail = st.detok.flush()
        if tail:
            ev.append((rid, TextDelta(text=tail, token_index=len(st.seq.output_ids) - 1)))
        return ev

    def _finish(self, st: RequestState, reason: str, stop_seq: str | None) -> list[tuple[str, EngineEvent]]:
        seq, rid = st.seq, st.seq.request_id
        ev = self._flush(st)
        self.scheduler.finish(seq, reason)
        n_out = len(seq.output_ids)
        lib = st.bind.snap.lib if st.bind is not None else self.library
        summary = {
            "mode": seq.params.snapshot_mode,
            "lookups": st.n_snapshots,
            "lookups_per_1k_tokens": round(1000.0 * st.n_snapshots / max(1, n_out), 2),
            "triggers": dict(st.trigger_counts),
            "top_anchors": [
                {"anchor_id": a, "count": c, "span": lib.span(a) if lib is not None and a >= 0 else None}
                for a, c in st.anchor_counts.most_common(5)
            ],
        }
        now = time.monotonic()
        ttft = ((seq.first_token_s or now) - seq.arrival_s) * 1e3
        ev.append((rid, Finished(stop_reason=reason, stop_sequence=stop_seq, prompt_tokens=len(seq.prompt_ids),
                                 completion_tokens=n_out, snapshot_summary=summary, ttft_ms=ttft,
                                 queue_ms=((seq.scheduled_s or now) - seq.arrival_s) * 1e3,
                                 e2e_ms=(now - seq.arrival_s) * 1e3,
                                 token_gaps_ms=[g * 1e3 for g in seq.token_gaps_s], tag=seq.params.tag)))
        self._drop(rid)
        return ev

    def _drop(self, rid: str) -> None:
        self.requests.pop(rid, None)
        self.pending.pop(rid, None)  # an aborted request's overlapped lookup finishes unread
        self.runner.release(rid)


def run_to_completion(engine: LLMEngine, prompts: list[tuple[list[int], SamplingParams]]) -> list[list[EngineEvent]]:
    """Drive ``engine`` synchronously (no thread) until every prompt finished; events per prompt.
    For the CLI's batch tools, benchmarks and tests."""
    events: dict[str, list[EngineEvent]] = {}
    for i, (ids, params) in enumerate(prompts):
        rid = f"sync-{i}"
        events[rid] = [e for _, e in engine.add_request(rid, ids, params)]
    while engine.has_work():
        for rid, ev in engine.step():
            events[rid].append(ev)
    return [events[f"sync-{i}"] for i in range(len(prompts))]
