"""Static Anchor Generator: corpus -> hidden states of the snapshot layer -> at most N anchors.

``build_library(lm, docs, out_dir, cfg)`` runs in three timed phases, each with a progress bar:

1. **Model pass** (``collect``, ``sfcl.anchors.model_pass``): the serving model over each
   document in windows of ``window_tokens``, several windows per forward (``batch_tokens``),
   keeping at every position i (CPU tensors) the snapshot layer's residual-stream hidden state
   h_i (what the runner taps when serving), the model's top-K next tokens at i and the surprisal
   of the token that actually followed, and the attention dispersion of query i (``triggers``).
   Before it the build measures the GEMM rate and prints the pass's floor (model FLOP / rate);
   after it, the achieved rate and the ratio to the floor.
2. **Clustering** (``sfcl.anchors.kmeans.two_level_kmeans``): the unit-normalised h_i into at most
   N anchors (each point is its own anchor when there are fewer points than N), then per anchor
   its member count, spread, representative span and averaged next-token distribution.
3. **Calibration**: the statistics of the trigger signals (surprisal and 3-token dispersion
   mean/std, and the share of corpus tokens each trigger would fire on) and the serving
   calibration below go into the manifest.

The library is written with ``sfcl.library.store.save_library`` (or as the next version of a root,
``sfcl.library.versions.write_version``); the manifest's ``build`` records the settings, the model
pass against its floor and the seconds of each phase. Same corpus, model, seed and thread count ->
same library.

Measured on this project's AVX2-only AMD EPYC (2 cores, shared): see ``sfcl anchors build``'s
printed floor ratio; the 61 ContractNLI NDAs (148,497 tokens) are 45 TFLOP of model work.

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
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from sfcl.anchors.corpus import Document, corpus_hash
from sfcl.anchors.kmeans import two_level_kmeans
from sfcl.anchors.model_pass import RATE_SHAPE, flops_per_token, gemm_rate, run_windows
from sfcl.library.store import save_library
from sfcl.model import decode_kernel
from sfcl.model.kv_cache import KVCache
from sfcl.model.llama import AttnBatch, ChunkSpec, StepBatch
from sfcl.snapshot.triggers import LN2, attention_dispersion, dispersion_length_table

log = logging.getLogger("sfcl.anchors")
SKIP_POSITIONS = 16  # first positions of a window have too little context to calibrate on
# The shortest window whose statistics reach the library's calibration: past SKIP_POSITIONS, the
# dispersion statistic averages 3 positions and needs one more after them.
MIN_CALIBRATION_WINDOW = SKIP_POSITIONS + 3
CALIBRATION_FORMAT = 3  # 2: per-length dispersion table + serving thresholds; 3: the thresholds leave the
# unsupported_number trigger its share of the budget (part of the default library's cache name)
MODEL_PASS_VERSION = 2  # 2: RoPE in float32 in every dtype (1: bf16 models rounded its frequencies to bf16;
# part of the default library's cache name, so a library of the old hidden states is rebuilt)
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
    window_tokens: int = 1024  # tokens per window: a position attends to the earlier tokens of its window
    batch_tokens: int = 4096  # tokens per forward (windows and calibration prompts are batched up to this)
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
        if self.window_tokens < MIN_CALIBRATION_WINDOW:  # a full window must give a dispersion statistic
            raise ValueError(f"window_tokens must be >= {MIN_CALIBRATION_WINDOW}")
        if self.batch_tokens < 1:
            raise ValueError("batch_tokens must be >= 1")
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


@dataclass(slots=True)
class PassStats:
    """The model pass against its floor (printed by the build, recorded in the manifest)."""

    tokens: int  # corpus tokens run through the model
    windows: int
    tflop: float  # model FLOP of the pass (``model_pass.flops_per_token``), 1e12
    gemm_gflops: float  # GEMM rate measured at the start (``model_pass.gemm_rate``), GFLOP/s
    floor_s: float  # tflop / gemm rate: the pass at the measured GEMM rate
    seconds: float = 0.0  # wall time of the pass

    @property
    def ratio(self) -> float:
        return self.seconds / self.floor_s if self.floor_s > 0 else float("inf")


def _secs(s: float) -> str:
    """Seconds for the build's log: whole seconds from 10 s, else two significant digits (a small
    corpus's floor is well under a second)."""
    return f"{s:.0f} s" if s >= 10 else f"{s:.2g} s"


def _say(msg: str, progress: bool) -> None:
    """A build progress line: on stderr (``[ANCHOR] ...``) with progress bars, else to the log."""
    if progress:
        tqdm.write(f"[ANCHOR] {msg}", file=sys.stderr)
    else:
        log.info(msg)


def _windows(lm, docs: list[Document], cfg: BuildConfig) -> list[tuple[int, list[int], list]]:
    """(doc index, token ids, char offsets) per window of ``window_tokens``; stops once
    ``max_points`` positions are covered."""
    out, points = [], 0
    for di, d in enumerate(docs):
        enc = lm.tokenizer(d.text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offs = enc["input_ids"], enc["offset_mapping"]
        for s in range(0, max(0, len(ids) - 1), cfg.window_tokens):
            w_ids = ids[s : s + cfg.window_tokens]
            if len(w_ids) >= 2:
                out.append((di, w_ids, offs[s : s + cfg.window_tokens]))
                points += len(w_ids) - 1
                if cfg.max_points and points >= cfg.max_points:
                    return out
    return out


def _batches(windows: list, max_tokens: int) -> list[list]:
    """Consecutive windows in batches of at most ``max_tokens`` tokens (a longer window alone)."""
    out, cur, n = [], [], 0
    for w in windows:
        if cur and n + len(w[1]) > max_tokens:
            out.append(cur)
            cur, n = [], 0
        cur.append(w)
        n += len(w[1])
    return out + ([cur] if cur else [])


def collect(lm, docs: list[Document], cfg: BuildConfig, layer: int, progress: bool = True) -> tuple[_Collected, PassStats]:
    """The model pass (``sfcl.anchors.model_pass``) over the corpus windows, batched, with its
    floor: prints the pass's FLOP, the GEMM rate measured now and the floor before, and the
    achieved rate and floor ratio after. Raises ValueError for a corpus without text."""
    windows = _windows(lm, docs, cfg)
    if not windows:
        raise ValueError("the corpus has no text to build anchors from (no document of 2 tokens or more)")
    dtype = next(lm.model.parameters()).dtype
    if next(lm.model.parameters()).device.type == "cpu":
        decode_kernel.load(verbose=progress)  # the logits' reductions in one native pass (model_pass.logit_stats)
    lens = np.array([len(w[1]) for w in windows], np.float64)
    tokens = int(lens.sum())
    mean_attended = float((lens * (lens + 1) / 2).sum() / tokens)
    rate = gemm_rate(dtype)
    tflop = flops_per_token(lm.args, mean_attended) * tokens / 1e12
    st = PassStats(tokens=tokens, windows=len(windows), tflop=tflop, gemm_gflops=rate, floor_s=tflop * 1e3 / rate)
    _say(f"model pass: {tokens:,} tokens in {len(windows)} windows, {tflop:.1f} TFLOP; GEMM {rate:.1f} GFLOP/s "
         f"({str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads, a "
         + "x".join(map(str, RATE_SHAPE)) + f" GEMM) -> floor {_secs(st.floor_s)}", progress)
    H, K, KP, DOC, SS, SE, SUR, D3, NA = [], [], [], [], [], [], [], [], []
    t0 = time.perf_counter()
    with tqdm(total=tokens, desc="anchors: model pass", unit="tok", unit_scale=True, disable=not progress) as bar:
        for batch in _batches(windows, cfg.batch_tokens):
            outs = run_windows(lm.model, [w[1] for w in batch], layer, cfg.top_k_next)
            for (di, w_ids, w_offs), o in zip(batch, outs):
                T = len(w_ids)
                H.append(torch.nn.functional.normalize(o.hidden, dim=-1))
                K.append(o.top_ids)
                KP.append(o.top_probs)
                DOC.append(np.full(T - 1, di, np.int32))
                SS.append(np.asarray([w_offs[max(0, i - cfg.span_tokens)][0] for i in range(T - 1)], np.int32))
                SE.append(np.asarray([w_offs[i + 1][1] for i in range(T - 1)], np.int32))
                d3 = (torch.nn.functional.avg_pool1d(o.dispersion[None, None], 3, stride=1)[0, 0] if T >= 3
                      else o.dispersion[:0])  # (T-2,) mean of i-2..i
                SUR.append(o.surprisal[SKIP_POSITIONS:].double().numpy())
                D3.append(d3[SKIP_POSITIONS:].double().numpy())  # d3[j] averages disp[j..j+2]
                NA.append(np.arange(SKIP_POSITIONS + 3, T + 1, dtype=np.int64))  # query j+2 attends j+3 positions
                bar.update(T)
    st.seconds = time.perf_counter() - t0
    _say(f"model pass: {_secs(st.seconds)}, {tflop * 1e3 / st.seconds:.1f} GFLOP/s, {st.ratio:.2f}x the floor", progress)
    col = _Collected(hidden=torch.cat(H), next_ids=torch.cat(K), next_probs=torch.cat(KP),
                     doc=np.concatenate(DOC), span_start=np.concatenate(SS), span_end=np.concatenate(SE),
                     surprisal=np.concatenate(SUR), d3=np.concatenate(D3), n_attended=np.concatenate(NA))
    return col, st


def _aggregate(col: _Collected, labels: np.ndarray, cent: torch.Tensor, top_k: int):
    """Per-cluster counts, spread, representative member and next-token distribution."""
    k = cent.shape[0]
    lab = torch.from_numpy(np.asarray(labels, np.int64))
    sims = (col.hidden * cent[lab]).sum(-1)  # (n,) cosine of each member to its centroid
    counts = torch.bincount(lab, minlength=k)
    mean_sim = torch.zeros(k).index_add_(0, lab, sims) / counts.clamp_min(1)
    best = torch.full((k,), -2.0).scatter_reduce(0, lab, sims, reduce="amax")
    # the first member (lowest position) attaining the max: members tie where their hidden states are
    # equal (repeated boilerplate), and an index_put with repeated indices kept any one of them, so two
    # builds of one corpus could name different spans (28 of 32,731 anchors, AMD EPYC, 2026-12-06)
    n, K = col.next_ids.shape
    cand = torch.nonzero(sims >= best[lab])[:, 0]
    rep = torch.full((k,), n, dtype=torch.int64).scatter_reduce(0, lab[cand], cand, reduce="amin")
    rep[rep == n] = -1  # empty clusters
    # next-token distribution: average member top-K distributions, keep the top_k ids
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
    over the corpus). Each prompt leaves ``calibration_tokens`` of the model's context for its answer:
    a longer one has its text cut further; one that cannot fit even with no text is left out."""
    tok = lm.tokenizer
    n_long = min(len(docs), max(1, cfg.calibration_prompts // 6))
    parts = []  # (text, its prefix, its suffix)
    for d in docs[:n_long]:
        ids = tok(d.text, add_special_tokens=False)["input_ids"][: cfg.calibration_long_tokens]
        parts.append((tok.decode(ids), "", f"\n\n{CALIBRATION_QUESTION}"))
    n_short = max(0, cfg.calibration_prompts - len(parts))
    shorts = [p for d in docs for p in _paragraphs(d.text)]
    shorts = shorts[:: max(1, len(shorts) // max(1, n_short))][:n_short]  # spread over the corpus
    parts += [(p, f"{CALIBRATION_INSTRUCTIONS[i % len(CALIBRATION_INSTRUCTIONS)]}\n\n", "") for i, p in enumerate(shorts)]
    limit = lm.args.max_position_embeddings - cfg.calibration_tokens  # prompt tokens at most
    out = []
    for text, head, tail in parts[: cfg.calibration_prompts]:
        for _ in range(8):  # a cut text may tokenise a little longer: check again, a few times at most
            rendered = tok.apply_chat_template([{"role": "user", "content": f"{head}{text}{tail}"}], tokenize=False,
                                               add_generation_prompt=True)
            prompt = list(tok(rendered, add_special_tokens=False)["input_ids"])
            if len(prompt) <= limit or not text:
                break
            ids = tok(text, add_special_tokens=False)["input_ids"]
            text = tok.decode(ids[: max(0, len(ids) - (len(prompt) - limit))])  # cut by the excess, check again
        if len(prompt) <= limit:
            out.append(prompt)
    return out


@torch.inference_mode()
def serving_signals(lm, prompts: list[list[int]], layer: int, max_new: int, progress: bool = True,
                    batch_tokens: int = 4096):
    """Greedy answers to ``prompts`` (token id lists; prefilled as the runner prefills prompt
    chunks, several per forward up to ``batch_tokens`` tokens, each attending only to itself;
    then decoded together as one batch, as the runner does; a row stops at EOS) with the runner's
    per-token trigger inputs, as ``sfcl.snapshot.calibration.TokenRecords`` (log-probability,
    entity flag, D3, attended length, the unsupported_number check against the prompt; no
    lookback features)."""
    from sfcl.snapshot.calibration import TokenRecords, records_from_tokens
    from sfcl.snapshot.entity import vocab_class_table
    from sfcl.snapshot.source import SourceIndex, canonical_table, number_joiners, token_texts

    model = lm.model
    device = next(model.parameters()).device
    table = vocab_class_table(lm.tokenizer, lm.args.vocab_size).tolist()
    eos = set(lm.eos_token_ids or [])
    B = len(prompts)
    model.fit_rope(max(len(p) for p in prompts) + max_new, "calibration prompts and their answers")
    kv = KVCache(lm.args, B, max(len(p) for p in prompts) + max_new, next(model.parameters()).dtype, str(device))
    if device.type == "cpu":
        decode_kernel.enable(kv, lm.args, verbose=progress)  # decode as the server decodes (when it can)
    lens = torch.tensor([len(p) for p in prompts], device=device)  # (B,)
    logits, disp = [], []
    with tqdm(total=int(lens.sum()), desc="anchors: calibration prefill", unit="tok", unit_scale=True,
              disable=not progress) as bar:
        for group in _batches(list(enumerate(prompts)), batch_tokens):
            ids, pos, chunks, last = [], [], [], []
            for r, p in group:  # prompt r -> KV row r, its last token's logits and attention row come back
                chunks.append(ChunkSpec(slot=r, start=0, offset=len(ids), length=len(p), want_probs=True))
                ids += p
                pos += range(len(p))
                last.append(len(ids) - 1)
            step = StepBatch(positions=torch.tensor(pos, device=device), decode=None, chunks=chunks,
                             sample_index=torch.tensor(last, device=device))
            so = model.forward_step(torch.tensor([ids], device=device), step, kv, layer)
            logits.append(so.logits)  # (g, V)
            disp += [attention_dispersion(pr[:, :, -1], lens[r:r + 1]) for (r, _), pr in zip(group, so.tap_probs)]
            bar.update(len(ids))
    logits_t, disp_t = torch.cat(logits), torch.cat(disp)  # (B, V), (B,)
    toks, lps, dps = [], [], []
    for i in tqdm(range(max_new), desc="anchors: calibration decode", unit="tok", disable=not progress):
        logp = torch.log_softmax(logits_t.float(), -1)
        t = logp.argmax(-1)  # (B,)
        toks.append(t)
        lps.append(logp.gather(1, t[:, None])[:, 0])
        dps.append(disp_t)
        if i == max_new - 1:  # the last token needs no forward (and a break would leave the bar at n - 1)
            continue
        pos = lens + i  # (B,) position of the token fed now
        S = int(pos.max()) + 1
        kv.ensure_initialized(B, S)
        mask = torch.arange(S, device=device)[None, :] <= pos[:, None]  # (B, S)
        b = AttnBatch(is_prefill=False, slots=torch.arange(B, device=device), positions=pos, kv_len=S,
                      mask=mask.view(B, 1, 1, S), slot_range=(0, B))
        step = StepBatch(positions=pos.clone(), decode=b, chunks=[], sample_index=torch.arange(B, device=device))
        so = model.forward_step(t[None, :], step, kv, layer)
        logits_t = so.logits
        disp_t = attention_dispersion(so.tap_probs[0][:, :, -1], pos + 1)
    T_, L_, D_ = (torch.stack(x, 1).cpu().tolist() for x in (toks, lps, dps))  # (B, max_new) each
    texts = token_texts(lm.tokenizer, lm.args.vocab_size)
    canon = canonical_table(lm.tokenizer, lm.args.vocab_size, texts)  # the unsupported_number check, as serving runs it
    joiners = number_joiners(lm.tokenizer, lm.args.vocab_size, texts)
    parts = []
    for r in range(B):
        n = next((j + 1 for j, t in enumerate(T_[r]) if t in eos), len(T_[r]))  # up to and with EOS
        parts.append(records_from_tokens(T_[r][:n], L_[r][:n], D_[r][:n], table, 3, prompt_len=len(prompts[r]),
                                         source=SourceIndex(prompts[r], canon, joiners), canon=canon))
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
    rec = serving_signals(lm, prompts, layer, cfg.calibration_tokens, progress, cfg.batch_tokens)
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
    (``sfcl.library.versions``; ``command`` is recorded in the lineage); otherwise ``out_dir`` is
    a plain library directory. Raises ValueError for an empty corpus or bad settings,
    FileExistsError if out_dir is a non-empty directory (versioned: one that is not a root).
    Returns the library (version) path.
    """
    from sfcl.library.versions import is_root, write_version

    cfg = cfg or BuildConfig()
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not (versioned and is_root(out)):
        # fail before the model pass
        raise FileExistsError(f"{out} already exists and is not empty; anchor libraries are immutable, "
                              "write a new version directory instead")
    layer = default_layer(lm.args.n_layers) if cfg.layer is None else cfg.layer
    if not 0 <= layer < lm.args.n_layers:
        raise ValueError(f"--layer {layer} is outside 0..{lm.args.n_layers - 1}")
    lm.model.fit_rope(cfg.window_tokens, f"--window-tokens {cfg.window_tokens}")
    torch.manual_seed(cfg.seed)
    t_start = time.perf_counter()
    col, stats = collect(lm, docs, cfg, layer, progress)
    if col.d3.size < 2:  # the corpus statistics (triggers.Calibration) need a spread
        raise ValueError(f"the corpus' documents are too short to calibrate on: a window needs at least "
                         f"{MIN_CALIBRATION_WINDOW} tokens, and these give {col.d3.size} calibration "
                         f"position(s) in all")
    n = col.hidden.shape[0]
    t0 = time.perf_counter()
    labels, cent = two_level_kmeans(col.hidden, min(cfg.n_anchors, n), cfg.seed, cfg.kmeans_iters, progress)
    counts, mean_sim, rep, nid, npb = _aggregate(col, labels, cent, cfg.top_k_next)
    t_kmeans = time.perf_counter() - t0
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
    t0 = time.perf_counter()
    if cfg.calibration_prompts > 0:
        cal.update(serving_calibration(lm, docs, cfg, layer, cal, progress))
    else:
        cal["dispersion_by_length"] = dispersion_length_table(col.d3, col.n_attended,
                                                              source="teacher-forced corpus positions")
    t_cal = time.perf_counter() - t0
    seconds = {"model_pass": round(stats.seconds, 2), "kmeans": round(t_kmeans, 2), "calibration": round(t_cal, 2),
               "total": round(time.perf_counter() - t_start, 2)}
    _say(f"built in {_secs(seconds['total'])}: model pass {_secs(stats.seconds)} ({stats.ratio:.2f}x its "
         f"{_secs(stats.floor_s)} floor), k-means {_secs(t_kmeans)}, calibration {_secs(t_cal)}", progress)
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
               "model_pass_version": MODEL_PASS_VERSION,
               "clustering": "identity" if len(idx) == n else "two-level spherical k-means",
               "model_pass": {**asdict(stats), "dtype": str(next(lm.model.parameters()).dtype).removeprefix("torch."),
                              "threads": torch.get_num_threads()},
               "seconds": seconds},
        corpus_hash=corpus_hash(docs), calibration=cal,
    )
    log.info("built %d anchors from %d positions into %s", len(idx), n, path)
    return path


def library_cache_name(fingerprint: str, chash: str, layer: int, n: int) -> str:
    """Cache directory name of a default library; the calibration format and the model pass's version
    are part of it, so a library cached by an older SFCL is rebuilt with the current ones."""
    return f"{fingerprint[:12]}-{chash[:12]}-L{layer}-N{n}-c{CALIBRATION_FORMAT}-p{MODEL_PASS_VERSION}"

