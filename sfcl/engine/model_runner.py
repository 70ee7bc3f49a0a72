"""Model runner: turns a ``SchedulerOutput`` into tensors, runs the model, samples, evaluates the
snapshot triggers and does the step's anchor lookups; hands back plain Python results.

It never decides anything (the scheduler does). Lives in the engine thread; tensors stay on the
model's device. Per step: KV moves and prefix-cache restores, one batched decode forward for the
decoding sequences, one forward per prompt chunk, prefix-cache saves, then sampling and trigger
evaluation over all sampled rows at once, one host transfer of the packed per-row results, and
(only when some row looks up an anchor) one batched search plus its transfer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from sfcl.engine.kv_cache import KVCache
from sfcl.engine.sampler import sample
from sfcl.engine.scheduler import SchedulerOutput, Sequence
from sfcl.model.llama import AttnBatch, LlamaModel
from sfcl.snapshot.snapshotter import MODE_ALWAYS, MODE_CODES, MODE_OFF, SnapshotHit, Snapshotter, SnapshotState
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
                 snapshotter: Snapshotter | None = None, device: str = "cpu"):
        if not 0 <= tap_layer < model.a.n_layers:
            raise ValueError(f"snapshot layer {tap_layer} is outside 0..{model.a.n_layers - 1}")
        self.model, self.kv, self.tap_layer = model, kv, tap_layer
        self.snapshotter = snapshotter
        self.device = device
        self.state = SnapshotState(kv.n_slots + 1, snapshotter.cfg.dispersion_window if snapshotter else 3, device)
        self.generators: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.temperature <= 0:
            return None
        g = self.generators.get(seq.request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            if seq.params.seed is not None:
                g.manual_seed(int(seq.params.seed))
            else:
                g.seed()
            self.generators[seq.request_id] = g
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
        logits, hidden, disp = [], [], []
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
            out.decode_batch = B
        for ch in plan.prefill:
            seq = ch.seq
            ids = torch.tensor([seq.prompt_ids[ch.start:ch.end]], device=self.device)  # (1, T)
            batch = AttnBatch(is_prefill=True, slots=torch.tensor([seq.slot]),
                              positions=torch.arange(ch.start, ch.end, device=self.device), kv_len=ch.end)
            fo = self.model(ids, batch, self.kv, self.tap_layer, want_probs=ch.is_last)
            out.prefill_tokens += ch.end - ch.start
            if not ch.is_last:
                continue
            self.state.reset(seq.slot)
            seqs.append(seq)
            logits.append(fo.logits)  # (1, V)
            hidden.append(fo.tap_hidden[:, -1])  # (1, H)
            disp.append(attention_dispersion(fo.tap_probs[:, :, -1], torch.tensor([ch.end], device=self.device)))
        for w in plan.saves:
            self.kv.save(w.slot, w.first_block, w.pool_blocks)
        if not seqs:
            return out
        logits_t = torch.cat(logits)  # (N, V) float32
        hidden_t = torch.cat(hidden)  # (N, H)
        disp_t = torch.cat(disp)  # (N,)
        tokens = sample(logits_t, [s.params.temperature for s in seqs], [s.params.top_p for s in seqs],
                        [self._generator(s) for s in seqs])  # (N,)
        logp = torch.log_softmax(logits_t, dim=-1)  # (N, V)
        tok_logp = logp.gather(1, tokens[:, None])[:, 0]  # (N,)
        ent = -(logp.exp() * logp).sum(-1)  # (N,) nats
        slots = torch.tensor([s.slot for s in seqs], device=self.device)
        modes = torch.tensor([MODE_CODES[s.params.snapshot_mode] for s in seqs], device=self.device)
        if self.snapshotter is not None:
            fired = self.snapshotter.triggers(tokens, tok_logp, disp_t, slots, self.state)  # (N, 3)
            fired = fired & (modes != MODE_OFF)[:, None]
            look = fired.any(1) | (modes == MODE_ALWAYS)
        else:
            fired = torch.zeros(len(seqs), 3, dtype=torch.bool, device=self.device)
            look = torch.zeros(len(seqs), dtype=torch.bool, device=self.device)
        packed = torch.stack([tokens.double(), tok_logp.double(), ent.double(), disp_t.double(),
                              look.double()] + [fired[:, j].double() for j in range(3)], 1)  # (N, 8)
        rows = packed.tolist()  # the step's one device->host transfer
        out.forward_ms = (time.perf_counter() - t0) * 1e3
        hits: dict[int, SnapshotHit] = {}
        look_rows = [i for i, r in enumerate(rows) if r[4] > 0.5]
        if look_rows:
            sc, ids_, conf, ms = self.snapshotter.lookup(hidden_t[look_rows])
            out.lookups, out.lookup_ms = len(look_rows), ms
            for j, i in enumerate(look_rows):
                names = [TRIGGER_NAMES[k] for k in range(3) if rows[i][5 + k] > 0.5] or ["always"]
                hits[i] = SnapshotHit(triggers=names, anchor_ids=ids_[j], scores=sc[j], confidence=conf[j], lookup_ms=ms)
        for i, (seq, r) in enumerate(zip(seqs, rows)):
            out.results[seq.request_id] = SeqResult(token_id=int(r[0]), logprob=r[1], entropy=r[2],
                                                    dispersion=r[3], snapshot=hits.get(i))
        return out
