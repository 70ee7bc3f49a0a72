"""Model runner: turns a ``SchedulerOutput`` into tensors, runs the model, samples, evaluates the
snapshot triggers and does the step's anchor lookups; hands back plain Python results.

It never decides anything (the scheduler does). Lives in the engine thread; tensors stay on the
model's device. Per step: KV moves and prefix-cache restores, one batched decode forward for the
decoding sequences, one forward per prompt chunk, prefix-cache saves, then sampling and trigger
evaluation over all sampled rows at once, one host transfer of the packed per-row results, and
(only when some row looks up an anchor) one transfer of the looked-up rows' hidden states (plus
their logits when they steer) and one batched search per library version in use (normally one;
two for a while after a reload).

Steering timing: the triggers judge the token just sampled, and the lookup uses the hidden state
of the same forward, i.e. the state that *produced* that token. Anchor next-token lists answer
"what followed states like this one", so they are a distribution over that same position: the
runner re-samples the token from the kNN-LM mixture before it is emitted (the logits are at hand,
no extra forward, no extra transfer), rather than nudging the next position with stale evidence.
Context anchors cost one copy of the prompt's snapshot-layer states to the CPU per prefill forward
of a steering request (``ContextAnchors.add``; free on a CPU device, nothing for other requests).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from sfcl.engine.kv_cache import KVCache
from sfcl.engine.sampler import sample, steer_resample
from sfcl.engine.scheduler import SchedulerOutput, Sequence
from sfcl.model.llama import AttnBatch, LlamaModel
from sfcl.snapshot.context import ContextAnchors
from sfcl.snapshot.snapshotter import (MODE_ALWAYS, MODE_CODES, MODE_OFF, Binding, SnapshotHit, Snapshotter,
                                       SnapshotState)
from sfcl.snapshot.steering import SteerInfo
from sfcl.snapshot.triggers import TRIGGER_NAMES, attention_dispersion


@dataclass(slots=True)
class SeqResult:
    token_id: int  # sampled token
    logprob: float  # model log-probability of that token (temperature 1), nats
    entropy: float  # entropy of the model's next-token distribution, nats
    dispersion: float  # snapshot-layer normalised attention entropy of the producing query
    snapshot: SnapshotHit | None  # set when this token was looked up


@dataclass(slots=True)
class RunnerOutput:
    results: dict[str, SeqResult] = field(default_factory=dict)  # by request id
    prefill_tokens: int = 0  # prompt tokens computed this step
    restored_tokens: int = 0  # prompt tokens copied from the prefix cache this step
    decode_batch: int = 0
    forward_ms: float = 0.0
    lookups: int = 0
    lookup_ms: float = 0.0


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCache, tap_layer: int,
                 snapshotter: Snapshotter | None = None, device: str = "cpu",
                 context: ContextAnchors | None = None):
        if not 0 <= tap_layer < model.a.n_layers:
            raise ValueError(f"snapshot layer {tap_layer} is outside 0..{model.a.n_layers - 1}")
        self.model, self.kv, self.tap_layer = model, kv, tap_layer
        self.snapshotter = snapshotter  # current library version; requests bind to it at admission
        self.device = device
        self.state = SnapshotState(kv.n_slots + 1, snapshotter.cfg.dispersion_window if snapshotter else 3, device)
        self.generators: dict[tuple[str, str], torch.Generator] = {}
        self.bindings: dict[str, Binding] = {}
        self.context = context if context is not None else ContextAnchors()  # prompt anchors (steering requests)

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

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        out = RunnerOutput()
        t0 = time.perf_counter()
        for mv in plan.moves:
            self.kv.move(mv.src, mv.dst, mv.length)
            self.state.move(mv.src, mv.dst)
        for r in plan.restores:
            self.kv.restore(r.slot, r.first_block, r.pool_blocks)
            out.restored_tokens += len(r.pool_blocks) * self.kv.block_size
        seqs: list[Sequence] = []
        logits, hidden, disp, natt = [], [], [], []  # natt: attended positions per row
        if plan.decode:
            B = len(plan.decode)
            ids = torch.tensor([[s.last_token] for s in plan.decode], device=self.device)  # (B, 1)
            pos = torch.tensor([s.num_tokens - 1 for s in plan.decode], device=self.device)  # (B,)
            S = int(max(s.num_tokens for s in plan.decode))
            self.kv.ensure_initialized(B, S)
            mask = torch.arange(S, device=self.device)[None, :] <= pos[:, None]  # (B, S)
            batch = AttnBatch(is_prefill=False, slots=torch.arange(B, device=self.device), positions=pos,
                              kv_len=S, mask=mask.view(B, 1, 1, S), slot_range=(0, B))
            fo = self.model(ids, batch, self.kv, self.tap_layer)
            seqs.extend(plan.decode)
            logits.append(fo.logits)  # (B, V)
            hidden.append(fo.tap_hidden[:, -1])  # (B, H)
            disp.append(attention_dispersion(fo.tap_probs[:, :, -1], pos + 1))
            natt.append(pos + 1)
            out.decode_batch = B
        for ch in plan.prefill:
            seq = ch.seq
            ids = torch.tensor([seq.prompt_ids[ch.start:ch.end]], device=self.device)  # (1, T)
            batch = AttnBatch(is_prefill=True, slots=torch.tensor([seq.slot]),
                              positions=torch.arange(ch.start, ch.end, device=self.device), kv_len=ch.end)
            steer = seq.params.steer and self.snapshotter is not None
            fo = self.model(ids, batch, self.kv, self.tap_layer, want_probs=ch.is_last, tap_all=steer)
            if steer:  # context anchors (prefix-cached positions come back from their LRU)
                self.context.add(seq.request_id, ch.start, fo.tap_hidden[0], seq.prompt_ids)
            out.prefill_tokens += ch.end - ch.start
            if not ch.is_last:
                continue
            self.state.reset(seq.slot)
            seqs.append(seq)
            logits.append(fo.logits)  # (1, V)
            hidden.append(fo.tap_hidden[:, -1])  # (1, H)
            natt.append(torch.tensor([ch.end], device=self.device))
            disp.append(attention_dispersion(fo.tap_probs[:, :, -1], natt[-1]))
        for w in plan.saves:
            self.kv.save(w.slot, w.first_block, w.pool_blocks)
        if not seqs:
            return out
        logits_t = torch.cat(logits)  # (N, V) float32
        hidden_t = torch.cat(hidden)  # (N, H)
        disp_t = torch.cat(disp)  # (N,)
        natt_t = torch.cat(natt)  # (N,) int64
        tokens = sample(logits_t, [s.params.temperature for s in seqs], [s.params.top_p for s in seqs],
                        [self._generator(s) for s in seqs])  # (N,)
        logp = torch.log_softmax(logits_t, dim=-1)  # (N, V)
        tok_logp = logp.gather(1, tokens[:, None])[:, 0]  # (N,)
        ent = -(logp.exp() * logp).sum(-1)  # (N,) nats
        slots = torch.tensor([s.slot for s in seqs], device=self.device)
        modes = torch.tensor([MODE_CODES[s.params.snapshot_mode] for s in seqs], device=self.device)
        fired = torch.zeros(len(seqs), 3, dtype=torch.bool, device=self.device)
        has_snap = torch.zeros(len(seqs), dtype=torch.bool, device=self.device)
        binds = [self.binding(s) for s in seqs]
        for snap, idx in _groups(binds):  # one group per library version (one, except after a reload)
            if len(idx) == len(seqs):
                fired = snap.triggers(tokens, tok_logp, disp_t, slots, self.state, natt_t)  # (N, 3)
                has_snap[:] = True
            else:
                ix = torch.tensor(idx, device=self.device)
                fired[ix] = snap.triggers(tokens[ix], tok_logp[ix], disp_t[ix], slots[ix], self.state, natt_t[ix])
                has_snap[ix] = True
        fired = fired & (modes != MODE_OFF)[:, None]
        look = fired.any(1) | ((modes == MODE_ALWAYS) & has_snap)
        packed = torch.stack([tokens.double(), tok_logp.double(), ent.double(), disp_t.double(),
                              look.double()] + [fired[:, j].double() for j in range(3)], 1)  # (N, 8)
        rows = packed.tolist()  # the step's one device->host transfer
        out.forward_ms = (time.perf_counter() - t0) * 1e3
        hits: dict[int, SnapshotHit] = {}
        look_rows = [i for i, r in enumerate(rows) if r[4] > 0.5]
        if look_rows:
            hits = self._lookup(seqs, binds, look_rows, rows, hidden_t, logits_t, slots, out)
        for i, (seq, r) in enumerate(zip(seqs, rows)):
            out.results[seq.request_id] = SeqResult(token_id=int(r[0]), logprob=r[1], entropy=r[2],
                                                    dispersion=r[3], snapshot=hits.get(i))
        return out

    def _lookup(self, seqs: list[Sequence], binds: list[Binding | None], look_rows: list[int], rows: list[list],
                hidden_t: torch.Tensor, logits_t: torch.Tensor, slots: torch.Tensor,
                out: RunnerOutput) -> dict[int, SnapshotHit]:
        """Batched anchor search for the looked-up rows (one per library version) and, for rows
        that steer, the kNN-LM re-sample of their token. Updates ``rows`` in place for steered
        rows (token id, model logprob of the new token)."""
        steer_rows = [i for i in look_rows if seqs[i].params.steer]
        sel = torch.tensor(look_rows, device=self.device)
        h = hidden_t[sel].float()  # (n, H)
        if steer_rows:  # one transfer carries both: hidden for the search, logits for the mixture
            both = torch.cat([h, logits_t[sel].float()], 1).cpu()  # (n, H + V)
            h_cpu, lg_cpu = both[:, :h.shape[1]], both[:, h.shape[1]:]
        else:
            h_cpu, lg_cpu = h.cpu(), None
        hits: dict[int, SnapshotHit] = {}
        pos = {i: j for j, i in enumerate(look_rows)}
        for snap, idx in _groups([binds[i] for i in look_rows]):
            rws = [look_rows[j] for j in idx]
            names = [[TRIGGER_NAMES[k] for k in range(3) if rows[i][5 + k] > 0.5] or ["always"] for i in rws]
            got = snap.lookup(h_cpu[idx], boosts=[binds[i].boost for i in rws], context=self.context,
                              context_ids=[seqs[i].request_id if seqs[i].params.steer else None for i in rws],
                              triggers=names)
            out.lookups += len(rws)
            out.lookup_ms += got[0].lookup_ms if got else 0.0
            hits.update(zip(rws, got))
            # lambda 0 leaves the distribution as it was: no re-draw (a sampled row keeps its token)
            st = [i for i in rws if seqs[i].params.steer and hits[i].confidence * snap.steer.lambda_max > 0]
            if st:
                j = [pos[i] for i in st]
                new, new_logp, lam = steer_resample(
                    lg_cpu[j], [hits[i] for i in st], snap,
                    [seqs[i].params.temperature for i in st], [seqs[i].params.top_p for i in st],
                    [self._generator(seqs[i], "cpu") for i in st])
                changed = []
                for i, t, lp, l in zip(st, new, new_logp, lam):
                    hits[i].steer = SteerInfo(lam=l, original_token=int(rows[i][0]), changed=t != int(rows[i][0]))
                    if t != int(rows[i][0]):
                        rows[i][0], rows[i][1] = float(t), lp
                        changed.append(i)
                if changed:  # the entity state must follow the token actually emitted
                    ix = torch.tensor(changed, device=self.device)
                    snap.retoken(torch.tensor([int(rows[i][0]) for i in changed], device=self.device),
                                 slots[ix], self.state)
        return hits


def _groups(binds: list[Binding | None]) -> list[tuple[Snapshotter, list[int]]]:
    """Row indices grouped by bound Snapshotter (library version), in first-seen order."""
    out: dict[int, tuple[Snapshotter, list[int]]] = {}
    for i, b in enumerate(binds):
        if b is not None:
            out.setdefault(id(b.snap), (b.snap, []))[1].append(i)
    return list(out.values())
