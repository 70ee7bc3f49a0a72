"""Incremental State Snapshotter: per-step trigger evaluation and batched anchor lookups.

Owned by the model runner (engine thread). Per step it receives, for every sequence in the batch,
the sampled token, its model log-probability, the snapshot layer's attention dispersion, per-head
lookback ratios and hidden state (all tensors on the model's device), keeps a little per-KV-slot
state (last dispersion and lookback values, previous token's entity state), computes the trigger
signals (``step_signals``; which triggers fire is ``sfcl.snapshot.triggers.fire``), and runs *one*
batched top-k search for the rows that fired. Snapshots observe only, unless a request asked for
steering (``sfcl.snapshot.grounding`` corrects that token before it is emitted).

Each request is bound at admission to the Snapshotter current at that time (a ``Binding``), so a
library reload (``LLMEngine.swap_library``) never changes the anchors under an in-flight request;
the old library is unmapped once the last request bound to it is released. Steering requests
also search their own prompt (``sfcl.snapshot.context``), and keyword-boost rules
(``sfcl.snapshot.boost``) scale the confidence of matching anchor kinds.

The anchor library is CPU-resident and memory-mapped (``sfcl.library.store``) and searched by
``sfcl.library.index.AnchorIndex``: for large libraries an inverted file over 4-bit codes (of the
cell centroids and of each anchor's residual from its centroid) in one native call that also
returns the confidences as Python lists (~0.1 ms for one row right after a decode step and ~0.03
ms for each more, 17,069 x 576, Intel Xeon; docs/benchmarks.md). On a GPU the runner's fused lookup
searches a device copy instead (``device_index``, ``sfcl.snapshot.device_search``) and hands
``lookup`` the results (``found``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sfcl.library.index import AnchorIndex
from sfcl.library.store import KIND_NAMES, AnchorLibrary
from sfcl.model.hardware import fast_float_dtype
from sfcl.snapshot import entity
from sfcl.snapshot.boost import KeywordRule, boosted_confidence, kind_multipliers, library_rules
from sfcl.snapshot.context import ContextAnchors
from sfcl.snapshot.lookback import LookbackModel, features
from sfcl.snapshot.steering import SteerConfig, SteerInfo
from sfcl.snapshot.triggers import Calibration, TriggerConfig, anchor_confidence_each, trigger_signals, window_mean

if TYPE_CHECKING:
    from sfcl.snapshot.device_search import DeviceAnchorIndex

MODE_OFF, MODE_TRIGGERED, MODE_ALWAYS = 0, 1, 2
MODE_CODES = {"off": MODE_OFF, "triggered": MODE_TRIGGERED, "always": MODE_ALWAYS}


@dataclass(slots=True)
class SnapshotHit:
    """Plain result of one lookup (crosses into the engine's update)."""

    triggers: list[str]  # names of the triggers that fired ("always" in always mode without one)
    anchor_ids: list[int]  # top-k, best first: library row, or prompt position where context[i]
    scores: list[float]  # cosine similarities
    confidence: float  # in [0, 1], after keyword boost
    lookup_ms: float  # wall time of the batched search this hit was part of
    context: list[bool] = field(default_factory=list)  # per entry: a context (prompt) anchor
    kinds: list[str] = field(default_factory=list)  # per entry: "general" | "domain" | "context" ...
    next_ids: list[int] = field(default_factory=list)  # per context entry: the prompt's next token
    library_version: str = ""  # version of the library this lookup searched
    steer: SteerInfo | None = None  # set when the token was re-sampled from the steered mixture

    @property
    def best_library_anchor(self) -> int:
        """Best library anchor id (-1 if every entry is a context anchor)."""
        return next((a for a, c in zip(self.anchor_ids, self.context) if not c), -1) if self.context \
            else (self.anchor_ids[0] if self.anchor_ids else -1)


def library_version(lib: AnchorLibrary) -> str:
    """Short id of a library version: ``vNNNN:<content hash[:12]>`` for a version written under a
    versioned root (``sfcl.library.versions``), else the first 12 hex digits of its content hash
    (each write is a new immutable directory, so equal ids mean equal anchors)."""
    files = lib.manifest.get("files") or {}
    h = getattr(lib, "content_hash", None) or files.get("anchors.safetensors") or lib.path.name
    v = lib.manifest.get("version")
    if isinstance(v, dict) and isinstance(v.get("number"), int):
        return f"v{v['number']:04d}:{h[:12]}"
    return h[:12]


class SnapshotState:
    """Per-KV-slot trigger state on the device; rows follow the scheduler's slot moves.
    n_heads: query heads of the snapshot layer (the lookback-ratio window; 0: none kept)."""

    def __init__(self, n_slots: int, window: int, device: str, n_heads: int = 0):
        self.disp = torch.zeros(n_slots, window, device=device)  # last `window` dispersion values
        self.lb = torch.zeros(n_slots, window, n_heads, device=device)  # last `window` lookback ratios per head
        self.count = torch.zeros(n_slots, dtype=torch.int64, device=device)  # values seen (capped)
        self.ent = torch.full((n_slots,), entity.SENT_END, dtype=torch.uint8, device=device)
        self.ent_prev = self.ent.clone()  # entity state before the last token (steering re-derives it)
        self.window = window

    def reset(self, slot: int) -> None:
        for t in (self.disp, self.lb, self.count):
            t[slot] = 0
        self.ent[slot] = entity.SENT_END
        self.ent_prev[slot] = entity.SENT_END

    def move(self, src: int, dst: int) -> None:
        for t in (self.disp, self.lb, self.count, self.ent, self.ent_prev):
            t[dst] = t[src]


@dataclass(slots=True)
class StepSignals:
    """Per-row trigger inputs and signals of one step (device tensors, B rows)."""

    signals: torch.Tensor  # (B, 5) float32 ``trigger_signals`` (fire: ``triggers.fire``; the number column is -inf)
    in_entity: torch.Tensor  # (B,) bool
    d3: torch.Tensor  # (B,) float32 windowed dispersion, NaN before the window is full
    features: torch.Tensor | None  # (B, F) float32 lookback features (None without lookback ratios)

    def record(self, token_logp: torch.Tensor, n_attended: torch.Tensor) -> torch.Tensor:
        """(B, 5 + F) float64 columns a calibration replays (``sfcl.snapshot.calibration.TokenRecords``;
        ``triggers.RECORD_FEATURES_AT``): token logprob, in_entity, d3, n_attended, the number check
        (NaN here: the runner fills it in on the host), then the lookback features."""
        cols = [token_logp.double(), self.in_entity.double(), self.d3.double(), n_attended.double(),
                torch.full_like(token_logp, float("nan"), dtype=torch.float64)]
        f = [] if self.features is None else [self.features.double()]
        return torch.cat([torch.stack(cols, 1)] + f, 1)


@dataclass(slots=True)
class Binding:
    """A request's snapshot set-up, fixed at admission."""

    snap: "Snapshotter"  # the library version this request runs on until it ends
    boost: dict[str, float]  # keyword-boost multiplier per anchor kind for this request's text


class Snapshotter:
    """Triggers + anchor search over one library version.

    keyword_boost: extra rules (e.g. from ``--keyword-boost``) added to the library's own.
    steer: kNN-LM settings. n_heads: query heads of the snapshot layer (checks that the library's
    lookback model reads this model's heads). context_weight / context_decay: weight and decay of context anchors in
    ``anchor_confidence`` (default decay: the library's median, so a prompt position as close as a
    typical cluster member gets confidence 0.5). approximate_search: on a CPU model, large
    libraries are searched through an IVF index (``sfcl.library.index.AnchorIndex``,
    approximate). search_dtype: the dense search copy (default ``fast_float_dtype()``: bf16 on
    CPUs with native bf16, float32 elsewhere).
    Raises ValueError for incomplete calibration or bad rules.
    """

    def __init__(self, library: AnchorLibrary, class_table: torch.Tensor, cfg: TriggerConfig | None = None,
                 top_k: int = 3, search_dtype: torch.dtype | None = None,
                 keyword_boost: list[KeywordRule] | None = None, steer: SteerConfig | None = None,
                 context_weight: float = 1.0, context_decay: float | None = None, approximate_search: bool = True,
                 n_heads: int | None = None):
        self.lib = library
        self.cfg = cfg or TriggerConfig()
        self.cal = Calibration.from_dict(library.calibration)
        lb = (library.calibration or {}).get("lookback")
        self.lookback = LookbackModel.from_dict(lb) if lb else None  # trigger 4's model (None: it never fires)
        if self.lookback is not None and n_heads:
            self.lookback.check(n_heads)
        # on CUDA the fused lookup searches on the device (DeviceAnchorIndex, dense): no IVF to build
        self.index = AnchorIndex(library, dtype=search_dtype or fast_float_dtype(),
                                 approximate=approximate_search and class_table.device.type == "cpu")
        self.class_table = class_table  # (V,) uint8, on the model's device
        self.top_k = top_k
        self.weights = library.weights.float().contiguous()  # (N,) per anchor (the native pass reads them)
        self.decay = library.decay.float().contiguous()
        # numpy views for the CPU lookup's epilogue without the native pass (``lookup``): per-anchor weight and decay
        self._weights_np, self._decay_np = self.weights.numpy(), self.decay.numpy()
        self._kind_names = [KIND_NAMES[x] for x in library.kinds.tolist()]  # per anchor (a list: the lookup indexes it)
        self.rules = library_rules(library) + list(keyword_boost or [])
        self.steer = steer or SteerConfig()
        self.context_weight = float(context_weight)
        self.context_decay = float(context_decay) if context_decay is not None else \
            (float(self.decay.median()) if len(self.decay) else 10.0)
        self.version = library_version(library)

    def bind(self, text: str | None = None) -> Binding:
        """Binding for a new request whose prompt text is ``text`` (for keyword boost)."""
        return Binding(self, kind_multipliers(self.rules, text or ""))

    @property
    def layer(self) -> int:
        return self.lib.layer

    def step_signals(self, tokens: torch.Tensor, token_logp: torch.Tensor, dispersion: torch.Tensor,
                     ratios: torch.Tensor | None, slots: torch.Tensor, state: SnapshotState,
                     n_attended: torch.Tensor | None = None) -> StepSignals:
        """Advance the per-slot state by one token and compute the trigger signals.

        tokens (B,) int64, token_logp (B,) float32, dispersion (B,) float32, ratios (B, nh) float32
        lookback ratios (None: not available, e.g. CUDA-graph decode), slots (B,) int64, n_attended
        (B,) int64 positions the producing query attended (dispersion statistics of that length;
        None: the library's flat statistics). Which triggers fire: ``triggers.fire(out.signals, cfg)``.
        """
        w = state.window
        cnt = (state.count[slots] + 1).clamp_max(w)
        state.count[slots] = cnt
        hist = torch.cat([state.disp[slots, 1:], dispersion[:, None]], dim=1)  # (B, w): shift, append
        state.disp[slots] = hist
        d3 = window_mean(hist, cnt, w)  # (B,) NaN until w generated tokens
        state.ent_prev[slots] = state.ent[slots]
        ent_state = entity.entity_flags(self.class_table[tokens], state.ent[slots])
        state.ent[slots] = ent_state
        in_entity = (ent_state & entity.IN_ENTITY) != 0
        feats = lb_p = None
        if ratios is not None and state.lb.shape[-1] == ratios.shape[1]:
            lbh = torch.cat([state.lb[slots, 1:], ratios[:, None]], dim=1)  # (B, w, nh)
            state.lb[slots] = lbh
            mean = lbh.sum(1) / cnt.float()[:, None]  # (B, nh) over the tokens seen so far (<= w)
            feats = features(ratios, mean, in_entity, -token_logp)  # (B, F)
            lb_p = self.lookback.score(feats) if self.lookback is not None else None
        sig = trigger_signals(token_logp, in_entity, d3, n_attended, lb_p, self.cal)  # (B, 5), number column -inf
        return StepSignals(signals=sig, in_entity=in_entity, d3=d3, features=feats)

    def retoken(self, tokens: torch.Tensor, slots: torch.Tensor, state: SnapshotState) -> None:
        """Re-derive the entity state of ``slots`` after steering replaced their last token
        (tokens (n,) int64, slots (n,) int64, on the state's device)."""
        state.ent[slots] = entity.entity_flags(self.class_table[tokens], state.ent_prev[slots])

    def device_index(self, device: str | torch.device) -> "DeviceAnchorIndex":
        """This library's search index on ``device`` for the fused lookup (built on first use,
        then cached on this Snapshotter, so it goes away with the library version)."""
        from sfcl.snapshot.device_search import DeviceAnchorIndex

        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:  # "cuda" and "cuda:0" must share one copy
            dev = torch.device("cuda", torch.cuda.current_device())
        cache = self.__dict__.setdefault("_device_indexes", {})  # not in __init__: built only when fused
        di = cache.get(dev)
        if di is None:
            di = cache[dev] = DeviceAnchorIndex(self.index, self.weights, self.decay, dev)
        return di

    def lookup(self, hidden: torch.Tensor | None, boosts: list[dict[str, float]] | None = None,
               context: ContextAnchors | None = None, context_ids: list[str | None] | None = None,
               triggers: list[list[str]] | None = None,
               found: tuple[list[list[float]], list[list[int]], list[list[float]]] | None = None,
               search_ms: float = 0.0) -> list[SnapshotHit]:
        """Top-k anchors for each row of hidden (n, H) in one batched library search.

        boosts: per row, keyword-boost multiplier per kind. context / context_ids: per row, the
        request id whose prompt anchors are searched too (None: library only); the k best of both
        sets are kept. triggers: per row, the trigger names for the hit. Returns n hits.
        found: the library search already done elsewhere (the fused lookup searched on the
        device): per row, (scores, anchor ids, confidences) host lists of ``DeviceAnchorIndex``;
        hidden is then read only for rows with a context id (and may be None when none has one).
        search_ms: time of that search, added to each hit's ``lookup_ms``.
        """
        t0 = time.perf_counter()
        if found is None:
            found = self.index.search_lists(hidden, self.top_k, self.weights, self.decay)  # native: lists, no tensor
        if found is None:
            scores, ids, conf = self.index.search_confidence(hidden, self.top_k, self.weights, self.decay)  # (n, k) each
            if conf is None:  # not the native IVF pass (or a row searched exactly): the epilogue in numpy
                i_np = ids.numpy()
                conf = anchor_confidence_each(scores.numpy(), self._weights_np[i_np], self._decay_np[i_np])
            s_l, i_l, c_l = scores.tolist(), ids.tolist(), conf.tolist()
        else:
            s_l, i_l, c_l = found
        n = len(s_l)
        kind = self._kind_names
        hits = []
        for r in range(n):
            rid = context_ids[r] if context_ids else None
            mult = boosts[r] if boosts else {}
            if rid is None or context is None or not context.has(rid):  # library anchors only: the lists as found
                kinds = [kind[a] for a in i_l[r]]
                hits.append(SnapshotHit(
                    triggers=triggers[r] if triggers else [], anchor_ids=i_l[r], scores=s_l[r],
                    confidence=boosted_confidence(c_l[r], kinds, mult), lookup_ms=0.0, context=[False] * len(kinds),
                    kinds=kinds, next_ids=[-1] * len(kinds), library_version=self.version))
                continue
            ent = [(s_l[r][j], i_l[r][j], False, c_l[r][j], kind[i_l[r][j]], -1) for j in range(len(i_l[r]))]
            cs, cp, cn = context.search(rid, hidden[r], self.top_k)
            cc = anchor_confidence_each(cs[None], torch.full((1, len(cs)), self.context_weight),
                                        torch.full((1, len(cs)), self.context_decay))[0]
            ent += [(float(a), int(p), True, float(c), "context", int(t))
                    for a, p, c, t in zip(cs.tolist(), cp.tolist(), cc.tolist(), cn.tolist())]
            best_lib = ent[0]
            ent.sort(key=lambda e: -e[0])
            ent = ent[:self.top_k]
            if all(e[2] for e in ent):  # keep the best library anchor: events always name one
                ent = ent[:-1] + [best_lib]
            hits.append(SnapshotHit(
                triggers=triggers[r] if triggers else [], anchor_ids=[e[1] for e in ent],
                scores=[e[0] for e in ent],
                confidence=boosted_confidence([e[3] for e in ent], [e[4] for e in ent], mult),
                lookup_ms=0.0, context=[e[2] for e in ent], kinds=[e[4] for e in ent],
                next_ids=[e[5] for e in ent], library_version=self.version))
        ms = (time.perf_counter() - t0) * 1e3 + search_ms
        for h in hits:
            h.lookup_ms = ms
        return hits

    def next_lists(self, hits: list[SnapshotHit]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The retrieved anchors' next-token lists, for steering.

        Returns scores (n, k) float32 (-inf pads rows with fewer hits), next_ids (n, k, K) int64
        (-1 pad), next_probs (n, k, K) float32; a context anchor's list is its one-hot next token.
        """
        n, k, K = len(hits), max(len(h.anchor_ids) for h in hits), self.lib.top_k_next
        sc = torch.full((n, k), float("-inf"))
        nid = torch.full((n, k, K), -1, dtype=torch.int64)
        npr = torch.zeros(n, k, K)
        for r, h in enumerate(hits):
            for j, (a, s, ctx) in enumerate(zip(h.anchor_ids, h.scores, h.context or [False] * len(h.anchor_ids))):
                sc[r, j] = s
                if ctx:
                    nid[r, j, 0], npr[r, j, 0] = h.next_ids[j], 1.0
                else:
                    nid[r, j] = self.lib.next_ids[a].long()
                    npr[r, j] = self.lib.next_probs[a].float()
        return sc, nid, npr
