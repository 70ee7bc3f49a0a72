"""Static Anchor Generator: corpus -> hidden states of the snapshot layer -> at most N anchors.

``build_library(lm, docs, out_dir, cfg)`` runs the serving model (``sfcl.model``) over each
document in windows of ``window_tokens``, collecting at every position i (CPU tensors):
- the snapshot layer's residual-stream hidden state h_i (what the runner taps when serving),
- the model's top-K next-token distribution at i and the token that actually followed (i+1),
- the surprisal of that next token and the attention dispersion of query i (``triggers``),
then clusters the unit-normalised h_i into at most N anchors (each point is its own anchor when
there are fewer points than N; spherical k-means otherwise), and
writes an immutable library with ``sfcl.anchors.store.save_library``. The calibration statistics
of the trigger signals (surprisal and 3-token dispersion mean/std, and the share of corpus tokens
each trigger would fire on) go into the manifest. Same corpus, model and seed -> same library.

Serving calibration (``BuildConfig.calibration_prompts`` > 0, the default): normalised attention
entropy depends on the attended length and on the prompt format (chat template, generated vs
teacher-forced text), so statistics of corpus text do not describe what the triggers see when
serving (on SmolLM2-135M, short chat prompts fired the dispersion trigger on ~31% of tokens with
flat corpus statistics). The builder therefore also answers a few chat-format prompts made from
the corpus greedily (short ones: an instruction + one paragraph; long ones: a whole document, up
to ``calibration_long_tokens``, + a question) and from those generated tokens stores D3 statistics
per attended-length bucket (``calibration.dispersion_by_length``, ``sfcl.snapshot.triggers``) and
thresholds for a target share of triggering tokens (``calibration.thresholds``, the rule of
``sfcl anchors calibrate``: ``sfcl.snapshot.calibration.calibrate_thresholds``). With
``calibration_prompts=0`` the length table comes from the corpus positions and the source
design's default thresholds stay.
"""

from __future__ import annotations

import logging
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from sfcl.anchors.corpus import Document, corpus_hash
from sfcl.anchors.store import save_library
from sfcl.engine.kv_cache import KVCache
from sfcl.model.hardware import fast_float_dtype
from sfcl.model.llama import AttnBatch
from sfcl.snapshot.triggers import LN2, attention_dispersion, dispersion_length_table

log = logging.getLogger("sfcl.anchors")
SKIP_POSITIONS = 16  # first positions of a window have too little context to calibrate on
CALIBRATION_FORMAT = 2  # 2: per-length dispersion table + serving thresholds (part of the default library's cache name)
# Instructions of the serving-calibration prompts (generic; not the benchmark's instructions).
CALIBRATION_INSTRUCTIONS = (
    "What does this passage say? Answer in a few sentences:",
    "List the main points of the following text:",
    "Who has to do what according to this text?",
    "Describe this passage to a colleague who has not read it:",
)
CALIBRATION_QUESTION = "Question: What are the main obligations and deadlines in this document? Answer briefly."


def default_layer(n_layers: int) -> int:
    """Snapshot layer default: 3/4 of the depth. Late enough that the state encodes the coming
    token (kNN-LM, Khandelwal et al. 2020, retrieves on late-layer states), early enough not to be
    the vocabulary-specialised last layers."""
    return max(0, min(n_layers - 1, int(0.75 * n_layers)))


@dataclass(slots=True)
class BuildConfig:
    n_anchors: int = 32768  # at most this many anchors
    layer: int | None = None  # snapshot layer; None -> default_layer(n_layers)
    seed: int = 0
    window_tokens: int = 1024  # tokens per forward pass over a document
    top_k_next: int = 8  # next-token entries kept per anchor
    span_tokens: int = 12  # tokens of left context in an anchor's representative span
    max_points: int | None = None  # cap on collected positions (None = all)
    kmeans_iters: int = 10  # spherical k-means iterations when clustering is needed
    calibration_prompts: int = 24  # serving-calibration prompts (0: corpus statistics only)
    calibration_tokens: int = 48  # greedy tokens generated per calibration prompt
    calibration_long_tokens: int = 1536  # document tokens at most in a long calibration prompt
    calibration_target: float = 1.0 / 16.0  # share of calibration tokens the thresholds fire on

    def __post_init__(self) -> None:
        if self.n_anchors < 1:
            raise ValueError("n_anchors must be >= 1")
        if self.window_tokens < SKIP_POSITIONS + 2:
            raise ValueError(f"window_tokens must be >= {SKIP_POSITIONS + 2}")
        if self.top_k_next < 1:
            raise ValueError("top_k_next must be >= 1")
        if self.calibration_prompts < 0 or self.calibration_tokens < 4 or self.calibration_long_tokens < 16:
            raise ValueError("calibration_prompts must be >= 0, calibration_tokens >= 4, calibration_long_tokens >= 16")
        if not 0.0 < self.calibration_target < 1.0:
            raise ValueError("calibration_target must be in (0, 1)")


@dataclass(slots=True)
class _Collected:
    hidden: torch.Tensor  # (n, H) float32, unit norm
    next_ids: torch.Tensor  # (n, K) int64
    next_probs: torch.Tensor  # (n, K) float32
    doc: np.ndarray  # (n,) int32 doc index
    span_start: np.ndarray  # (n,) int32 char offsets
    span_end: np.ndarray  # (n,) int32
    surprisal: np.ndarray  # (m,) float64, calibration positions only
    d3: np.ndarray  # (m,) float64
    n_attended: np.ndarray  # (m,) int64, positions attended by the last query of each d3 value


@torch.inference_mode()
def collect(lm, docs: list[Document], cfg: BuildConfig, layer: int, progress: bool = True) -> _Collected:
    tok, model = lm.tokenizer, lm.model
    device = next(model.parameters()).device
    kv = KVCache(lm.args, 1, cfg.window_tokens, next(model.parameters()).dtype, str(device))
    windows = []
    for di, d in enumerate(docs):
        enc = tok(d.text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offs = enc["input_ids"], enc["offset_mapping"]
        for s in range(0, max(0, len(ids) - 1), cfg.window_tokens):
            w_ids = ids[s : s + cfg.window_tokens]
            if len(w_ids) >= 2:
                windows.append((di, w_ids, offs[s : s + cfg.window_tokens]))
    if not windows:
        raise ValueError("the corpus has no text to build anchors from")
    H, K = [], []
    KP, DOC, SS, SE, SUR, D3, NA = [], [], [], [], [], [], []
    total = 0
    for di, w_ids, w_offs in tqdm(windows, desc="anchors: model pass", unit="win", disable=not progress):
        T = len(w_ids)
        ids = torch.tensor([w_ids], device=device)
        b = AttnBatch(is_prefill=True, slots=torch.tensor([0]), positions=torch.arange(T, device=device), kv_len=T)
        fo = model(ids, b, kv, layer, all_positions=True)
        logp = torch.log_softmax(fo.logits[0, :-1].float(), -1)  # (T-1, V) predicts positions 1..T-1
        nxt = torch.tensor(w_ids[1:], device=device)
        sur = -logp.gather(1, nxt[:, None])[:, 0]  # (T-1,)
        top_p, top_i = logp.exp().topk(cfg.top_k_next, dim=-1)  # (T-1, K)
        probs = fo.tap_probs[0].transpose(0, 1)  # (T, nh, S)
        disp = attention_dispersion(probs, torch.arange(1, T + 1, device=device))  # (T,)
        d3 = torch.nn.functional.avg_pool1d(disp[None, None], 3, stride=1)[0, 0]  # (T-2,) mean of i-2..i
        h = fo.tap_hidden[0, :-1].float()  # (T-1, H)
        H.append(torch.nn.functional.normalize(h, dim=-1).cpu())
        K.append(top_i.cpu())
        KP.append(top_p.float().cpu())
        DOC.append(np.full(T - 1, di, np.int32))
        lo = [w_offs[max(0, i - cfg.span_tokens)][0] for i in range(T - 1)]
        SS.append(np.asarray(lo, np.int32))
        SE.append(np.asarray([w_offs[i + 1][1] for i in range(T - 1)], np.int32))
        SUR.append(sur[SKIP_POSITIONS:].double().cpu().numpy())
        D3.append(d3[SKIP_POSITIONS:].double().cpu().numpy())  # d3[j] averages disp[j..j+2]
        NA.append(np.arange(SKIP_POSITIONS + 3, T + 1, dtype=np.int64))  # query j+2 attends j+3 positions
        total += T - 1
        if cfg.max_points and total >= cfg.max_points:
            break
    return _Collected(hidden=torch.cat(H), next_ids=torch.cat(K), next_probs=torch.cat(KP),
                      doc=np.concatenate(DOC), span_start=np.concatenate(SS), span_end=np.concatenate(SE),
                      surprisal=np.concatenate(SUR), d3=np.concatenate(D3), n_attended=np.concatenate(NA))


def cluster(x: torch.Tensor, k: int, seed: int, iters: int, progress: bool = True) -> tuple[np.ndarray, torch.Tensor]:
    """Spherical k-means (Lloyd iterations on unit vectors, cosine assignment).

    x: (n, H) float32 unit rows. Returns (labels (n,) int64, centroids (k, H) float32 unit).
    Seeded initialisation from k distinct random points; an emptied cluster is re-seeded with the
    point worst served by its centroid. Assignment runs in chunks in ``fast_float_dtype()``
    (bfloat16 on CPUs with native bf16, about 2x float32 there; float32 elsewhere, where bf16 is
    emulated and 30-47x slower); centroid updates accumulate in float32. scikit-learn's
    MiniBatchKMeans needs a first batch of >= k points and a float32 distance matrix, which at
    k = 32,768 was several times slower here; our loop is ~40 lines and deterministic.
    """
    n = x.shape[0]
    if k >= n:
        return np.arange(n), x.clone()
    g = torch.Generator().manual_seed(seed)
    cent = x[torch.randperm(n, generator=g)[:k]].clone()  # (k, H)
    labels = torch.zeros(n, dtype=torch.int64)
    best = torch.zeros(n)
    fast = fast_float_dtype()
    xb = x.to(fast)
    chunk = max(1, (1 << 26) // k)  # rows per chunk: ~64M similarity entries
    for _ in tqdm(range(iters), desc="anchors: k-means", unit="iter", disable=not progress):
        cb = cent.to(fast).T.contiguous()  # (H, k)
        for s in range(0, n, chunk):
            sim = xb[s : s + chunk] @ cb  # (c, k)
            v, i = sim.max(1)
            labels[s : s + chunk], best[s : s + chunk] = i, v.float()
        new = torch.zeros_like(cent).index_add_(0, labels, x)  # (k, H) sums
        counts = torch.bincount(labels, minlength=k)
        empty = torch.nonzero(counts == 0)[:, 0]
        if len(empty):
            worst = torch.argsort(best)[: len(empty)]
            new[empty] = x[worst]
        cent = torch.nn.functional.normalize(new, dim=-1)
    return labels.numpy(), cent


def _aggregate(col: _Collected, labels: np.ndarray, cent: torch.Tensor, top_k: int):
    """Per-cluster counts, spread, representative member and next-token distribution."""
    k = cent.shape[0]
    lab = torch.from_numpy(np.asarray(labels, np.int64))
    sims = (col.hidden * cent[lab]).sum(-1)  # (n,) cosine of each member to its centroid
    counts = torch.bincount(lab, minlength=k)
    mean_sim = torch.zeros(k).index_add_(0, lab, sims) / counts.clamp_min(1)
    best = torch.full((k,), -2.0).scatter_reduce(0, lab, sims, reduce="amax")
    rep = torch.full((k,), -1, dtype=torch.int64)
    is_best = sims >= best[lab]
    rep[lab[is_best]] = torch.nonzero(is_best)[:, 0]  # one member attaining the max
    # next-token distribution: average member top-K distributions, keep the top_k ids
    n, K = col.next_ids.shape
    keys = lab[:, None] * (1 << 20) + col.next_ids  # (n, K) cluster-major key (vocab < 2^20)
    uk, inv = torch.unique(keys.reshape(-1), return_inverse=True)
    mass = torch.zeros(len(uk)).index_add_(0, inv, col.next_probs.reshape(-1))
    cl = uk // (1 << 20)
    tokid = uk % (1 << 20)
    mass = mass / counts[cl].float()
    order = torch.argsort(cl * 4.0 + (1.0 - mass.clamp(0, 1)) * 2.0, stable=True)  # by cluster, mass desc
    cl_o, tok_o, mass_o = cl[order], tokid[order], mass[order]
    first = torch.searchsorted(cl_o, torch.arange(k))
    rank = torch.arange(len(cl_o)) - first[cl_o]
    keep = rank < top_k
    nid = torch.full((k, top_k), -1, dtype=torch.int64)
    npb = torch.zeros(k, top_k)
    nid[cl_o[keep], rank[keep]] = tok_o[keep]
    npb[cl_o[keep], rank[keep]] = mass_o[keep]
    return counts, mean_sim, rep, nid, npb


def _spread(col: _Collected, counts: torch.Tensor, mean_sim: torch.Tensor, seed: int) -> torch.Tensor:
    """1 - typical member similarity per anchor; singletons get the median spread."""
    multi = counts > 1
    spread = (1.0 - mean_sim).clamp_min(0.02)
    if multi.any():
        fill = float(spread[multi].median())
    else:  # every point is its own anchor: use half the median distance to the nearest other point
        g = torch.Generator().manual_seed(seed)
        sample = col.hidden[torch.randperm(col.hidden.shape[0], generator=g)[:2048]]
        s = sample @ col.hidden.T  # (m, n)
        s[s > 0.9999] = -1.0  # exclude the point itself
        fill = max(0.02, float((1.0 - s.amax(1)).median()) / 2)
    return torch.where(multi, spread, torch.full_like(spread, fill))


def _paragraphs(text: str) -> list[str]:
    """Paragraphs of 200-900 characters (whitespace collapsed): blank-line separated ones, or, for
    text without blank lines (ContractNLI), consecutive lines joined until 200 characters."""
    parts = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    good = [p for p in parts if 200 <= len(p) <= 900 and not p.startswith("#")]
    if good:
        return good
    out, cur = [], ""
    for line in text.splitlines():
        cur = f"{cur} {' '.join(line.split())}".strip()
        if len(cur) >= 200:
            out.append(cur[:900])
            cur = ""
    return out


def calibration_prompts(lm, docs: list[Document], cfg: BuildConfig) -> list[list[int]]:
    """Chat-format prompt token ids for the serving calibration (deterministic): a sixth of
    ``calibration_prompts`` long ones (a document's text cut to ``calibration_long_tokens`` + a
    question, one per document) and short ones (an instruction + one paragraph, paragraphs spread
    over the corpus)."""
    tok = lm.tokenizer
    n_long = min(len(docs), max(1, cfg.calibration_prompts // 6))
    texts = []
    for d in docs[:n_long]:
        ids = tok(d.text, add_special_tokens=False)["input_ids"][: cfg.calibration_long_tokens]
        texts.append(f"{tok.decode(ids)}\n\n{CALIBRATION_QUESTION}")
    n_short = max(0, cfg.calibration_prompts - len(texts))
    shorts = [p for d in docs for p in _paragraphs(d.text)]
    shorts = shorts[:: max(1, len(shorts) // max(1, n_short))][:n_short]  # spread over the corpus
    texts += [f"{CALIBRATION_INSTRUCTIONS[i % len(CALIBRATION_INSTRUCTIONS)]}\n\n{p}" for i, p in enumerate(shorts)]
    out = []
    for t in texts[: cfg.calibration_prompts]:
        rendered = tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
        out.append(list(tok(rendered, add_special_tokens=False)["input_ids"]))
    return out


@torch.inference_mode()
def serving_signals(lm, prompts: list[list[int]], layer: int, max_new: int, progress: bool = True):
    """Greedy answers to ``prompts`` (token id lists; each prefilled alone, then decoded together
    as one batch, as the runner does; a row stops at EOS) with the runner's per-token trigger
    inputs, as ``sfcl.snapshot.calibration.TokenRecords`` (log-probability, entity flag, D3,
    attended length; no lookback features)."""
    from sfcl.snapshot.calibration import TokenRecords, records_from_tokens
    from sfcl.snapshot.entity import vocab_class_table

    model = lm.model
    device = next(model.parameters()).device
    table = vocab_class_table(lm.tokenizer, lm.args.vocab_size).tolist()
    eos = set(lm.eos_token_ids or [])
    B = len(prompts)
    kv = KVCache(lm.args, B, max(len(p) for p in prompts) + max_new, next(model.parameters()).dtype, str(device))
    lens = torch.tensor([len(p) for p in prompts], device=device)  # (B,)
    logits, disp = [], []
    for r, ids in enumerate(tqdm(prompts, desc="anchors: calibration prefill", unit="prompt", disable=not progress)):
        T = len(ids)
        b = AttnBatch(is_prefill=True, slots=torch.tensor([r]), positions=torch.arange(T, device=device), kv_len=T)
        fo = model(torch.tensor([ids], device=device), b, kv, layer)
        logits.append(fo.logits)  # (1, V)
        disp.append(attention_dispersion(fo.tap_probs[:, :, -1], lens[r:r + 1]))
    logits_t, disp_t = torch.cat(logits), torch.cat(disp)  # (B, V), (B,)
    toks, lps, dps = [], [], []
    for i in tqdm(range(max_new), desc="anchors: calibration decode", unit="tok", disable=not progress):
        logp = torch.log_softmax(logits_t.float(), -1)
        t = logp.argmax(-1)  # (B,)
        toks.append(t)
        lps.append(logp.gather(1, t[:, None])[:, 0])
        dps.append(disp_t)
        if i == max_new - 1:
            break
        pos = lens + i  # (B,) position of the token fed now
        S = int(pos.max()) + 1
        kv.ensure_initialized(B, S)
        mask = torch.arange(S, device=device)[None, :] <= pos[:, None]  # (B, S)
        b = AttnBatch(is_prefill=False, slots=torch.arange(B, device=device), positions=pos, kv_len=S,
                      mask=mask.view(B, 1, 1, S), slot_range=(0, B))
        fo = model(t[:, None], b, kv, layer)
        logits_t = fo.logits
        disp_t = attention_dispersion(fo.tap_probs[:, :, -1], pos + 1)
    T_, L_, D_ = (torch.stack(x, 1).cpu().tolist() for x in (toks, lps, dps))  # (B, max_new) each
    parts = []
    for r in range(B):
        n = next((j + 1 for j, t in enumerate(T_[r]) if t in eos), len(T_[r]))  # up to and with EOS
        parts.append(records_from_tokens(T_[r][:n], L_[r][:n], D_[r][:n], table, 3, prompt_len=len(prompts[r])))
    return TokenRecords.concat(parts)


def serving_calibration(lm, docs: list[Document], cfg: BuildConfig, layer: int, corpus_cal: dict,
                        progress: bool = True) -> dict:
    """Calibration entries from greedy serving-format answers (module docstring):
    ``dispersion_by_length``, ``thresholds`` and ``threshold_calibration``. Raises ValueError when
    the corpus yields no prompt or too few generated tokens for any length bucket."""
    from sfcl.snapshot.calibration import calibrate_thresholds
    from sfcl.snapshot.triggers import Calibration

    prompts = calibration_prompts(lm, docs, cfg)
    if not prompts:
        raise ValueError("the corpus gives no serving-calibration prompt")
    rec = serving_signals(lm, prompts, layer, cfg.calibration_tokens, progress)
    n_d3 = int(np.isfinite(rec.d3).sum())
    table = dispersion_length_table(rec.d3, rec.n_attended, min_count=min(32, max(1, n_d3 // 4)),
                                    source="greedy answers to chat-format prompts from the corpus (builder)")
    cal = Calibration.from_dict({**corpus_cal, "dispersion_by_length": table})
    res = calibrate_thresholds(rec.signals(cal), cal, cfg.calibration_target)
    return {"dispersion_by_length": table, "thresholds": res.thresholds,
            "threshold_calibration": {"target_rate": res.target, "achieved_rate": res.achieved,
                                      "per_trigger_rate": res.per_trigger, "per_trigger_share_q": res.q,
                                      "n_tokens": res.n_tokens, "prompts": len(prompts),
                                      "rule": "equal per-trigger share, union = target",
                                      "signals": "greedy answers to chat-format prompts from the corpus (builder)"}}


def build_library(lm, docs: list[Document], out_dir, cfg: BuildConfig | None = None, progress: bool = True,
                  versioned: bool = False, command: str = "") -> Path:
    """Build an anchor library for ``lm`` (a ``LoadedModel``) from ``docs`` into ``out_dir``.

    ``versioned``: ``out_dir`` is a library root and the library becomes its next version
    (``sfcl.anchors.versions``; ``command`` is recorded in the lineage); otherwise ``out_dir`` is
    a plain library directory. Raises ValueError for an empty corpus or bad settings,
    FileExistsError if out_dir is a non-empty directory (versioned: one that is not a root).
    Returns the library (version) path.
    """
    from sfcl.anchors.versions import is_root, write_version

    cfg = cfg or BuildConfig()
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not (versioned and is_root(out)):
        # fail before the model pass
        raise FileExistsError(f"{out} already exists and is not empty; anchor libraries are immutable, "
                              "write a new version directory instead")
    layer = default_layer(lm.args.n_layers) if cfg.layer is None else cfg.layer
    if not 0 <= layer < lm.args.n_layers:
        raise ValueError(f"--layer {layer} is outside 0..{lm.args.n_layers - 1}")
    torch.manual_seed(cfg.seed)
    col = collect(lm, docs, cfg, layer, progress)
    n = col.hidden.shape[0]
    labels, cent = cluster(col.hidden, min(cfg.n_anchors, n), cfg.seed, cfg.kmeans_iters, progress)
    counts, mean_sim, rep, nid, npb = _aggregate(col, labels, cent, cfg.top_k_next)
    nonempty = counts > 0
    idx = torch.nonzero(nonempty)[:, 0]
    spread = _spread(col, counts, mean_sim, cfg.seed)
    r = rep[idx].numpy()
    span_texts = [docs[int(col.doc[j])].text[int(col.span_start[j]) : int(col.span_end[j])][-300:] for j in r]
    cal = {
        "surprisal_mean": float(col.surprisal.mean()), "surprisal_std": float(col.surprisal.std()),
        "dispersion_mean": float(col.d3.mean()), "dispersion_std": float(col.d3.std()),
        "n_positions": int(col.surprisal.shape[0]),
        "share_surprisal_z2": float((np.abs(col.surprisal - col.surprisal.mean()) > 2 * col.surprisal.std()).mean()),
        "share_dispersion_z1.2": float(((col.d3 - col.d3.mean()) > 1.2 * col.d3.std()).mean()),
        "share_next_prob_below_0.85": float((np.exp(-col.surprisal) < 0.85).mean()),
        "format": CALIBRATION_FORMAT,
    }
    if cfg.calibration_prompts > 0:
        cal.update(serving_calibration(lm, docs, cfg, layer, cal, progress))
    else:
        cal["dispersion_by_length"] = dispersion_length_table(col.d3, col.n_attended,
                                                              source="teacher-forced corpus positions")
    save = (lambda **f: write_version(out_dir, f, command=command)) if versioned else \
        (lambda **f: save_library(out_dir, **f))
    path = save(
        vectors=cent[idx], counts=counts[idx], weights=torch.ones(len(idx)),
        decay=LN2 / spread[idx], next_ids=nid[idx], next_probs=npb[idx],
        kinds=torch.zeros(len(idx), dtype=torch.uint8), span_doc=torch.from_numpy(col.doc[r].astype(np.int64)),
        span_start=torch.from_numpy(col.span_start[r].astype(np.int64)),
        span_end=torch.from_numpy(col.span_end[r].astype(np.int64)), span_texts=span_texts,
        doc_ids=[d.doc_id for d in docs], model_fingerprint=lm.fingerprint, model_name=lm.name, layer=layer,
        build={**asdict(cfg), "layer": layer, "n_points": int(n), "n_docs": len(docs),
               "clustering": "identity" if len(idx) == n else "spherical k-means"},
        corpus_hash=corpus_hash(docs), calibration=cal,
    )
    log.info("built %d anchors from %d positions into %s", len(idx), n, path)
    return path


def library_cache_name(fingerprint: str, chash: str, layer: int, n: int) -> str:
    """Cache directory name of a default library; the calibration format is part of it, so a
    library cached by an older SFCL is rebuilt with the current calibration."""
    return f"{fingerprint[:12]}-{chash[:12]}-L{layer}-N{n}-c{CALIBRATION_FORMAT}"

