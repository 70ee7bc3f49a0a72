"""Model runner: turns a ``SchedulerOutput`` into tensors, runs the model, samples, evaluates the
snapshot triggers and does the step's anchor lookups; hands back plain Python results.

It never decides anything (the scheduler does). Lives in the engine thread; tensors stay on the
model's device. Per step: KV moves, releases of vacated KV rows and prefix-cache restores, ONE forward for all the step's tokens
(decode rows and prompt chunks flattened: the linear layers read the weights once, attention runs
per part; ``LlamaModel.forward_step``), prefix-cache saves, then sampling and trigger
evaluation over all sampled rows at once, one host transfer of the packed per-row results, and
(only when some row looks up an anchor) one transfer of the looked-up rows' hidden states (plus
their logits when they steer) and one batched search per library version in use (normally one;
two for a while after a reload), inside the step by default; with ``overlap_lookup`` (CPU) a
search none of whose rows steers runs on a lookup thread, overlapped with the engine's next step.

Steering timing: the triggers judge the token just sampled, and the lookup uses the hidden state
of the same forward, i.e. the state that *produced* that token. The steering mechanisms
(``sfcl.snapshot.grounding``: source-constrained entities, adaptive CAD, the kNN-LM mixture) all
correct that same position before the token is emitted: its logits are at hand (no extra forward
for source and knn, no extra transfer); CAD runs one forward of the short no-document sequences
of the step's triggered rows. Context anchors (knn only) cost one copy of the prompt's
snapshot-layer states to the CPU per prefill forward of such a request (``ContextAnchors.add``).

On CUDA (``sfcl.engine_stack.make_llm_engine``): pure-decode steps run the decode forward from
captured CUDA graphs (``sfcl.engine.graph_runner``; ``--enforce-eager`` turns that off), and the
lookup is fused (``sfcl.engine.fused_lookup``): every row is searched on the device and the
results ride in the step's one transfer, so a step waits on the device once, lookups or not.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import random
import time
import zlib
from dataclasses import dataclass, field

import torch

from sfcl.engine import fused_lookup
from sfcl.engine.graph_runner import DecodeGraphRunner
from sfcl.engine.scheduler import SchedulerOutput, Sequence
from sfcl.engine.threads import set_thread_count
from sfcl.model.kv_cache import KVCache
from sfcl.model.llama import AttnBatch, ChunkSpec, LlamaModel, RowGroup, StepBatch
from sfcl.model.quant import prompt_rows
from sfcl.model.sampler import sample
from sfcl.snapshot.context import ContextAnchors
from sfcl.snapshot.grounding import Grounding, SteerRow
from sfcl.snapshot.lookback import lookback_ratios
from sfcl.snapshot.snapshotter import (MODE_ALWAYS, MODE_CODES, MODE_OFF, Binding, SnapshotHit, SnapshotState,
                                       Snapshotter)
from sfcl.snapshot.triggers import RECORD_NUMBER_COL, TRIGGER_NAMES, attention_dispersion, fire

PREFILL_THREADS_MIN_TOKENS = 64  # a step computing this many prompt tokens runs on prefill_threads

@dataclass(slots=True)
class PendingSnapshot:
    """A lookup running on the runner's lookup thread while the engine goes on to the next step
    (``ModelRunner(overlap_lookup=True)``). ``result()`` waits for it: the engine calls it after
    the next step's forward, or before the request's ``Finished``."""

    future: cf.Future  # -> list[SnapshotHit], one per row of the batched search
    row: int  # this sequence's row in that search

    def result(self) -> SnapshotHit:
        """The hit; re-raises what the search raised."""
        return self.future.result()[self.row]


def _lookup_thread_init() -> None:
    set_thread_count(1)  # a search of a few rows; the cores belong to the engine's forward


@dataclass(slots=True)
class SeqResult:
    token_id: int  # sampled token
    logprob: float  # model log-probability of that token (temperature 1), nats
    entropy: float  # entropy of the model's next-token distribution, nats
    dispersion: float  # snapshot-layer normalised attention entropy of the producing query
    snapshot: SnapshotHit | None  # set when this token was looked up (and the lookup is done)
    pending: PendingSnapshot | None = None  # set when this token's lookup runs overlapped
    signals: list[float] = field(default_factory=list)  # the 5 trigger signals (TRIGGER_NAMES order), [] without snapshots
    record: list[float] | None = None  # ModelRunner(record_signals=True): StepSignals.record columns


@dataclass(slots=True)
class RunnerOutput:
    results: dict[str, SeqResult] = field(default_factory=dict)  # by request id
    prefill_tokens: int = 0  # prompt tokens computed this step
    restored_tokens: int = 0  # prompt tokens copied from the prefix cache this step
    decode_batch: int = 0
    forward_ms: float = 0.0
    lookups: int = 0  # lookups done in this step (not the overlapped ones: see SeqResult.pending)
    lookup_ms: float = 0.0


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCache, tap_layer: int,
                 snapshotter: Snapshotter | None = None, device: str = "cpu",
                 context: ContextAnchors | None = None, graphs: DecodeGraphRunner | None = None,
                 fused_lookup: bool = False, compiled_decode=None, prefill_threads: int | None = None,
                 decode_threads: int | None = None, overlap_lookup: bool = False,
                 grounding: Grounding | None = None, record_signals: bool = False):
        """graphs: static-buffer (CUDA-graph) decode for pure-decode steps (None: eager).
        fused_lookup: search every sampled row on the device and bring the results over in the
        step's one transfer (``sfcl.engine.fused_lookup``; the default on CUDA).
        compiled_decode: ``sfcl.model.compiled.CompiledDecode`` for pure-decode steps (``--compile``).
        prefill_threads, decode_threads: torch threads for steps that compute at least
        ``PREFILL_THREADS_MIN_TOKENS`` prompt tokens, and for the others (None, either: never
        switch). Why: a prompt chunk is a compute-bound GEMM that scales with cores (2,437 vs
        1,297 prompt tokens/s on 2 vs 1 thread here), while a decode step behind HTTP is faster on
        one thread less than the cores (the event loop needs one: 14.6 vs 25.6 ms per token on 2
        cores), and while a wave of prompts is prefilled few tokens are streamed.
        overlap_lookup: run a step's batched anchor search on a lookup thread (one torch thread),
        overlapped with the engine's next step; the rows' ``SeqResult.pending`` is set instead of
        ``snapshot``. Not when a looked-up row steers: its hit must re-sample the token before
        it is emitted, so that step's search (still one for all its rows) runs in the step, as
        every search does without this flag. Ignored with ``fused_lookup`` (the device search
        already rides in the step's one transfer).
        grounding: steering state (``sfcl.snapshot.grounding``; None: requests steering with
        source or cad get ``reason`` "no_source" / "cad_unavailable" in their events).
        record_signals: every sampled row also carries its trigger inputs (``SeqResult.record``),
        for calibration and the evaluation."""
        if not 0 <= tap_layer < model.a.n_layers:
            raise ValueError(f"snapshot layer {tap_layer} is outside 0..{model.a.n_layers - 1}")
        self.model, self.kv, self.tap_layer = model, kv, tap_layer
        self.snapshotter = snapshotter  # current library version; requests bind to it at admission
        self.device = device
        self.state = SnapshotState(kv.n_slots + 1, snapshotter.cfg.dispersion_window if snapshotter else 3, device,
                                   model.a.n_heads)
        self.grounding, self.record_signals = grounding, record_signals
        self._random: dict[str, random.Random] = {}  # random-trigger control draws per request
        self.generators: dict[tuple[str, str], torch.Generator] = {}
        self.bindings: dict[str, Binding] = {}
        self.context = context if context is not None else ContextAnchors()  # prompt anchors (steering requests)
        self.compiled_decode = compiled_decode
        self.graphs, self.fused_lookup = graphs, fused_lookup
        self.prefill_threads, self.decode_threads = prefill_threads, decode_threads
        self.overlap_lookup = overlap_lookup and not fused_lookup
        self._lookup_pool: cf.ThreadPoolExecutor | None = None  # started at the first overlapped lookup

    def close(self) -> None:
        """Stop the lookup thread (lookups already submitted finish first)."""
        if self._lookup_pool is not None:
            self._lookup_pool.shutdown(wait=True)
            self._lookup_pool = None

    def _submit_lookup(self, fn, *args, **kwargs) -> cf.Future:
        if self._lookup_pool is None:
            mine = torch.get_num_threads()  # the calling (engine) thread's count
            self._lookup_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="sfcl-lookup",
                                                      initializer=_lookup_thread_init)
            self._lookup_pool.submit(int).result()  # the initializer has run
            # torch.set_num_threads there also set torch's process-wide default, which a thread started
            # later (the library reload threads) takes at its first parallel op: give it this thread's back
            torch.set_num_threads(mine)
        return self._lookup_pool.submit(fn, *args, **kwargs)

    def _use_threads(self, prompt_tokens: int) -> None:
        """Set torch's intra-op threads for this step (see ``prefill_threads``). Explicit counts, not
        the thread's current one: a thread's first parallel op re-reads torch's process-wide count
        (``at::init_num_threads``), which another thread may have changed since."""
        if not (self.prefill_threads and self.decode_threads):
            return
        want = self.prefill_threads if prompt_tokens >= PREFILL_THREADS_MIN_TOKENS else self.decode_threads
        if torch.get_num_threads() != want:  # get_num_threads runs that first-op initialisation
            torch.set_num_threads(want)

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """Every device->host transfer of a step goes through here (a device sync on CUDA)."""
        return t.cpu()

    def admit(self, request_id: str, prompt_text: str | None = None) -> Binding | None:
        """Bind a new request to the current library version (None without snapshots)."""
        if self.snapshotter is None:
            return None
        b = self.bindings[request_id] = self.snapshotter.bind(prompt_text)
        return b

    def binding(self, seq: Sequence) -> Binding | None:
        b = self.bindings.get(seq.request_id)
        return b if b is not None else self.admit(seq.request_id)

    def release(self, request_id: str) -> None:
        for key in [k for k in self.generators if k[0] == request_id]:
            del self.generators[key]
        self.bindings.pop(request_id, None)
        self.context.release(request_id)
        self._random.pop(request_id, None)
        if self.grounding is not None:
            self.grounding.release(request_id)

    def _generator(self, seq: Sequence, device: str | None = None) -> torch.Generator | None:
        if seq.params.temperature <= 0:
            return None
        device = device or self.device
        g = self.generators.get((seq.request_id, device))
        if g is None:
            g = torch.Generator(device=device)
            if seq.params.seed is not None:
                g.manual_seed(int(seq.params.seed))
            else:
                g.seed()
            self.generators[(seq.request_id, device)] = g
        return g

    @torch.no_grad()  # not inference_mode: the compiled decode step writes the KV cache in place
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        out = RunnerOutput()
        t0 = time.perf_counter()
        for mv in plan.moves:
            self.kv.move(mv.src, mv.dst, mv.length)
            self.state.move(mv.src, mv.dst)
        for slot in plan.release:  # after the moves (they may read these rows), before any write
            self.kv.release(slot)
        for r in plan.restores:
            self.kv.restore(r.slot, r.first_block, r.pool_blocks)
            out.restored_tokens += len(r.pool_blocks) * self.kv.block_size
        self._use_threads(sum(ch.end - ch.start for ch in plan.prefill))
        seqs: list[Sequence] = list(plan.decode)
        ids: list[int] = [s.last_token for s in plan.decode]
        positions: list[int] = [s.num_tokens - 1 for s in plan.decode]
        decode = graph_out = None
        if plan.decode and self.graphs is not None and not plan.prefill:  # static buffers / CUDA graph
            graph_out = self.graphs.run(ids, positions)
            out.decode_batch = len(plan.decode)
        elif plan.decode:
            B = len(plan.decode)
            pos = torch.tensor(positions, device=self.device)  # (B,)
            S = max(positions) + 1
            self.kv.ensure_initialized(B, S)
            mask = torch.arange(S, device=self.device)[None, :] <= pos[:, None]  # (B, S)
            decode = AttnBatch(is_prefill=False, slots=torch.arange(B, device=self.device), positions=pos,
                               kv_len=S, mask=mask.view(B, 1, 1, S), slot_range=(0, B),
                               groups=self._row_groups(plan, B) if self.compiled_decode is None else None)
            out.decode_batch = B
        chunks: list[ChunkSpec] = []
        sample_index = list(range(len(plan.decode)))
        n_valid = [p + 1 for p in positions]  # attended length of each sampled row's query
        steer_chunks = []
        for ch in plan.prefill:
            seq = ch.seq
            off = len(ids)
            ids.extend(seq.prompt_ids[ch.start:ch.end])
            positions.extend(range(ch.start, ch.end))
            chunks.append(ChunkSpec(slot=seq.slot, start=ch.start, offset=off, length=ch.end - ch.start,
                                    want_probs=ch.is_last))
            if "knn" in seq.params.steer and self.snapshotter is not None:
                steer_chunks.append((ch, off))
            out.prefill_tokens += ch.end - ch.start
            if ch.is_last:
                self.state.reset(seq.slot)
                if self.grounding is not None and self.snapshotter is not None and (  # the source index, at prefill:
                        "source" in seq.params.steer  # source steering, and the unsupported_number trigger
                        or len(seq.prompt_ids) >= self.grounding.cfg.min_source_tokens):
                    self.grounding.prepare(seq.request_id, seq.prompt_ids)
                seqs.append(seq)
                sample_index.append(len(ids) - 1)
                n_valid.append(ch.end)
        if ids and graph_out is None:
            step = StepBatch(positions=torch.tensor(positions, device=self.device), decode=decode, chunks=chunks,
                             sample_index=torch.tensor(sample_index, dtype=torch.long, device=self.device),
                             keep_tap_states=bool(steer_chunks))
            ids_t = torch.tensor([ids], device=self.device)  # (1, N)
            if self.compiled_decode is not None and not chunks:
                so = self.compiled_decode(ids_t, step, self.tap_layer)
            else:
                with prompt_rows(bool(chunks)):  # prompt rows on the same kernels, cached or not
                    so = self.model.forward_step(ids_t, step, self.kv, self.tap_layer)
            for ch, off in steer_chunks:  # context anchors (prefix-cached positions come back from their LRU)
                self.context.add(ch.seq.request_id, ch.start, so.tap_states[off:off + ch.end - ch.start],
                                 ch.seq.prompt_ids)
        for w in plan.saves:
            self.kv.save(w.slot, w.first_block, w.pool_blocks)
        if not seqs:
            return out
        natt_t = torch.tensor(n_valid, device=self.device)  # (N,) int64 attended positions per row
        ratios_t = None  # (N, nh) lookback ratios (not from a captured CUDA graph)
        if graph_out is not None:
            logits_t, hidden_t, disp_t = graph_out.logits, graph_out.hidden, graph_out.dispersion
        else:
            logits_t, hidden_t = so.logits, so.tap_hidden
            nprompt_t = torch.tensor([len(s.prompt_ids) for s in seqs], device=self.device)  # (N,)
            disp_t, ratios_t = self._attention_signals(so.tap_probs, natt_t, nprompt_t)
        logp = torch.log_softmax(logits_t, dim=-1)  # (N, V)
        probs = logp.exp()  # (N, V): the entropy's, and the sampling distribution of rows at temperature 1
        ent = -(probs * logp).sum(-1)  # (N,) nats
        tokens = sample(logits_t, [s.params.temperature for s in seqs], [s.params.top_p for s in seqs],
                        [self._generator(s) for s in seqs], probs=probs)  # (N,)
        tok_logp = logp.gather(1, tokens[:, None])[:, 0]  # (N,)
        slots = torch.tensor([s.slot for s in seqs], device=self.device)
        modes = torch.tensor([MODE_CODES[s.params.snapshot_mode] for s in seqs], device=self.device)
        K = len(TRIGGER_NAMES)
        fired = torch.zeros(len(seqs), K, dtype=torch.bool, device=self.device)
        sig = torch.full((len(seqs), K), float("-inf"), device=self.device)
        has_snap = torch.zeros(len(seqs), dtype=torch.bool, device=self.device)
        rec = None
        binds = [self.binding(s) for s in seqs]
        for snap, idx in _groups(binds):  # one group per library version (one, except after a reload)
            ix = slice(None) if len(idx) == len(seqs) else torch.tensor(idx, device=self.device)
            ss = snap.step_signals(tokens[ix], tok_logp[ix], disp_t[ix], None if ratios_t is None else ratios_t[ix],
                                   slots[ix], self.state, natt_t[ix])
            sig[ix], fired[ix], has_snap[ix] = ss.signals, fire(ss.signals, snap.cfg), True
            if self.record_signals:
                r_ = ss.record(tok_logp[ix], natt_t[ix])  # (n, 5 + F)
                if rec is None:
                    rec = torch.full((len(seqs), r_.shape[1]), float("nan"), dtype=torch.float64, device=self.device)
                rec[ix] = r_
        fired = fired & (modes != MODE_OFF)[:, None]
        look = fired.any(1) | ((modes == MODE_ALWAYS) & has_snap)
        rand = [i for i, s in enumerate(seqs) if s.params.random_trigger > 0 and s.params.snapshot_mode != "off"]
        if rand:  # evaluation control: a Bernoulli(rate) draw per token replaces the triggers
            hit = [self._random_draw(seqs[i]) for i in rand]
            ix = torch.tensor(rand, device=self.device)
            fired[ix] = False
            look[ix] = torch.tensor(hit, device=self.device) & has_snap[ix]
        cols = [tokens.double(), tok_logp.double(), ent.double(), disp_t.double(), look.double(),
                fired.double(), sig.double()]
        if rec is not None:
            cols.append(rec)
        packed = torch.cat([c if c.dim() == 2 else c[:, None] for c in cols], 1)  # (N, 5 + 2K [+ record])
        fused = None
        if self.fused_lookup:  # device search of every row, one transfer for everything
            steer = [i for i, s in enumerate(seqs) if s.params.steer and binds[i] is not None
                     and s.params.snapshot_mode != "off"]
            fused = fused_lookup.transfer(self._to_host, packed, hidden_t, logits_t,
                                          [snap for snap, _ in _groups(binds)], steer)
            rows = fused.rows
        else:
            rows = self._to_host(packed).tolist()  # the step's one device->host transfer
        if self.grounding is not None:
            self._number_trigger(seqs, binds, rows)
        out.forward_ms = (time.perf_counter() - t0) * 1e3
        hits: dict[int, SnapshotHit] = {}
        pending: dict[int, PendingSnapshot] = {}
        look_rows = [i for i, r in enumerate(rows) if r[4] > 0.5]
        if look_rows:
            hits, pending = self._lookup(seqs, binds, look_rows, rows, hidden_t, logits_t, slots, out, fused)
        K = len(TRIGGER_NAMES)
        for i, (seq, r) in enumerate(zip(seqs, rows)):
            out.results[seq.request_id] = SeqResult(
                token_id=int(r[0]), logprob=r[1], entropy=r[2], dispersion=r[3], snapshot=hits.get(i),
                pending=pending.get(i), signals=r[5 + K:5 + 2 * K] if binds[i] is not None else [],
                record=r[5 + 2 * K:] if len(r) > 5 + 2 * K else None)
        return out

    def _row_groups(self, plan: SchedulerOutput, B: int) -> list[RowGroup] | None:
        """The plan's ``decode_groups`` as attention row groups, plus one group (shared = 0) of the
        rows in none; None when the plan has no group (plain batched decode)."""
        if not plan.decode_groups:
            return None
        out, grouped = [], set()
        for g in plan.decode_groups:
            out.append(_row_group(g.rows, g.shared, self.device))
            grouped.update(g.rows)
        rest = [i for i in range(B) if i not in grouped]
        if rest:
            out.append(_row_group(rest, 0, self.device))
        return out

    def _number_trigger(self, seqs: list[Sequence], binds: list[Binding | None], rows: list[list]) -> None:
        """The ``unsupported_number`` trigger, on the host after the step's transfer (it needs the
        sampled token and the request's source index, ``Grounding.number_signal``): fills in its
        signal (and the recorded column) of every row with snapshots, and for ``triggered`` and
        ``always`` rows where it fires (``triggers.fire``, the one rule) sets the row's fired and
        lookup flags (the device's rule: fired flags in every mode but ``off``; random-trigger rows
        fire nothing but their draw).
        Rows hold [token, logprob, entropy, dispersion, lookup, fired (K), signals (K), record...].
        A list lookup per row for tokens that are not digits."""
        K = len(TRIGGER_NAMES)
        k = TRIGGER_NAMES.index("unsupported_number")
        g = self.grounding
        for i, (seq, r) in enumerate(zip(seqs, rows)):
            if binds[i] is None:
                continue
            v = g.number_signal(seq.request_id, seq.output_ids, int(r[0]))
            if math.isnan(v):
                continue
            r[5 + K + k] = v
            if len(r) > 5 + 2 * K + RECORD_NUMBER_COL:
                r[5 + 2 * K + RECORD_NUMBER_COL] = v
            if seq.params.snapshot_mode != "off" and not seq.params.random_trigger > 0 \
                    and bool(fire(torch.tensor([r[5 + K:5 + 2 * K]]), binds[i].snap.cfg)[0, k]):
                r[5 + k] = 1.0
                r[4] = 1.0

    def _random_draw(self, seq: Sequence) -> bool:
        """One Bernoulli(``random_trigger``) draw for ``seq``, from a generator seeded by the
        request's ``seed`` when it has one (so a run repeats whatever the request ids), else by its
        request id."""
        g = self._random.get(seq.request_id)
        if g is None:
            seed = seq.params.seed if seq.params.seed is not None else zlib.crc32(seq.request_id.encode())
            g = self._random[seq.request_id] = random.Random(seed)
        return g.random() < seq.params.random_trigger

    @staticmethod
    def _attention_signals(tap_probs: list, nv: torch.Tensor, n_prompt: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention dispersion (N,) and per-head lookback ratios (N, nh) of the sampled rows from
        the snapshot layer's weights, one (B_part, nh, 1, S_part) tensor per part that samples
        (parts attend different lengths); nv (N,) int64 attended positions per row, n_prompt (N,)
        int64 prompt length of each row's sequence."""
        probs = [p[:, :, -1] for p in tap_probs if p is not None]  # (B_part, nh, S_part)
        disp, ratios, i = [], [], 0
        for p in probs:
            b = p.shape[0]
            disp.append(attention_dispersion(p, nv[i:i + b]))
            ratios.append(lookback_ratios(p, nv[i:i + b], n_prompt[i:i + b]))
            i += b
        if len(probs) == 1:
            return disp[0], ratios[0]
        return torch.cat(disp), torch.cat(ratios)

    def _lookup(self, seqs: list[Sequence], binds: list[Binding | None], look_rows: list[int], rows: list[list],
                hidden_t: torch.Tensor, logits_t: torch.Tensor, slots: torch.Tensor,
                out: RunnerOutput, fused: fused_lookup.FusedTransfer | None = None
                ) -> tuple[dict[int, SnapshotHit], dict[int, PendingSnapshot]]:
        """Batched anchor search for the looked-up rows (one per library version) and, for rows
        that steer, the grounded correction of their token (``_steer``). Updates ``rows`` in place for steered
        rows (token id, model logprob of the new token). With ``fused`` the searches were done on
        the device and everything needed came over in the step's one transfer. Returns the hits
        by row, and the overlapped searches by row (``overlap_lookup``, no row steering)."""
        steer_rows = [i for i in look_rows if seqs[i].params.steer]
        if fused is not None:
            h_cpu, lg_cpu = fused.hidden_logits(look_rows)  # steering rows only (context search, mixture)
        else:
            sel = torch.tensor(look_rows, device=self.device)
            h = hidden_t[sel].float()  # (n, H)
            if steer_rows:  # one transfer carries both: hidden for the search, logits for the mixture
                both = self._to_host(torch.cat([h, logits_t[sel].float()], 1))  # (n, H + V)
                h_cpu, lg_cpu = both[:, :h.shape[1]], both[:, h.shape[1]:]
            else:
                h_cpu, lg_cpu = self._to_host(h), None
        hits: dict[int, SnapshotHit] = {}
        pending: dict[int, PendingSnapshot] = {}
        pos = {i: j for j, i in enumerate(look_rows)}
        for snap, idx in _groups([binds[i] for i in look_rows]):
            rws = [look_rows[j] for j in idx]
            K = len(TRIGGER_NAMES)
            names = [[TRIGGER_NAMES[k] for k in range(K) if rows[i][5 + k] > 0.5]
                     or (["random"] if seqs[i].params.random_trigger > 0 else ["always"]) for i in rws]
            if self.overlap_lookup and fused is None and not any(seqs[i].params.steer for i in rws):
                # nothing here steers: the search runs on the lookup thread, overlapped with the next step
                fut = self._submit_lookup(snap.lookup, h_cpu[idx], boosts=[binds[i].boost for i in rws],
                                          triggers=names)
                pending.update((i, PendingSnapshot(fut, r)) for r, i in enumerate(rws))
                continue
            got = snap.lookup(h_cpu[idx] if h_cpu is not None else None, boosts=[binds[i].boost for i in rws],
                              context=self.context,
                              context_ids=[seqs[i].request_id if "knn" in seqs[i].params.steer else None for i in rws],
                              triggers=names, found=fused.found_for(snap, rws) if fused is not None else None,
                              search_ms=fused.search_ms[id(snap)] if fused is not None else 0.0)
            out.lookups += len(rws)
            out.lookup_ms += got[0].lookup_ms if got else 0.0
            hits.update(zip(rws, got))
            st = [i for i in rws if seqs[i].params.steer]
            if st:
                self._steer(seqs, st, [pos[i] for i in st], lg_cpu, rows, hits, snap, slots)
        return hits, pending

    def _steer(self, seqs: list[Sequence], st: list[int], j: list[int], lg_cpu: torch.Tensor, rows: list[list],
               hits: dict[int, SnapshotHit], snap: Snapshotter, slots: torch.Tensor) -> None:
        """Grounded correction of the steered rows ``st`` (step rows; ``j`` their rows in lg_cpu)
        before their tokens are emitted (``sfcl.snapshot.grounding``). Updates ``rows`` (token,
        model logprob) and the entity state of rows whose token changed."""
        if self.grounding is None:  # built without one (tests): no source index, no CAD side sequences
            self.grounding = Grounding(snap.class_table, [])
        g = self.grounding
        todo = [SteerRow(request_id=seqs[i].request_id, mechanisms=seqs[i].params.steer,
                         prompt_ids=seqs[i].prompt_ids, output_ids=seqs[i].output_ids, token=int(rows[i][0]),
                         temperature=seqs[i].params.temperature, top_p=seqs[i].params.top_p,
                         generator=self._generator(seqs[i], "cpu"), cad_prompt_ids=seqs[i].params.cad_prompt_ids,
                         hit=hits[i], snap=snap) for i in st]
        lg = lg_cpu[j]  # (n, V)
        res = g.steer(todo, lg)
        changed = []
        for i, k, (t, info) in zip(st, range(len(st)), res):
            hits[i].steer = info
            if info.changed:
                rows[i][0], rows[i][1] = float(t), float(torch.log_softmax(lg[k].float(), -1)[t])
                changed.append(i)
        if changed:  # the entity state must follow the token actually emitted
            ix = torch.tensor(changed, device=self.device)
            snap.retoken(torch.tensor([int(rows[i][0]) for i in changed], device=self.device), slots[ix], self.state)


def _row_group(rows: list[int], shared: int, device) -> RowGroup:
    """rows (ascending decode indices) -> RowGroup, with a slice when they are consecutive."""
    span = slice(rows[0], rows[-1] + 1) if rows[-1] - rows[0] + 1 == len(rows) else None
    return RowGroup(rows=torch.tensor(rows, device=device), span=span, source=rows[0], shared=shared)


def _groups(binds: list[Binding | None]) -> list[tuple[Snapshotter, list[int]]]:
    """Row indices grouped by bound Snapshotter (library version), in first-seen order."""
    out: dict[int, tuple[Snapshotter, list[int]]] = {}
    for i, b in enumerate(binds):
        if b is not None:
            out.setdefault(id(b.snap), (b.snap, []))[1].append(i)
    return list(out.values())
