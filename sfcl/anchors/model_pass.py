"""The anchor builder's model pass: the serving model over corpus windows, computing only what a
library keeps.

Owns :func:`run_windows` (called by ``sfcl.anchors.builder.collect``), the FLOP model of a pass
(:func:`flops_per_token`) and the GEMM-rate probe the build's floor is measured against
(:func:`gemm_rate`). Data lives on the model's device; results come back as CPU tensors.

For every position i of a window except the last (which has no next token in the window) a pass
returns, from one causal forward of ``sfcl.model.llama.LlamaModel``'s own layers:

- the residual-stream hidden state after the snapshot layer (what the runner taps when serving);
- the top-K next tokens and their probabilities, and the surprisal of the token that actually
  followed: the logits are made ``LOGIT_ROWS`` rows at a time and reduced at once (:func:`logit_stats`:
  one native pass per row computing its logsumexp, top-K and surprisal), so no (T, V) float32
  log-softmax is ever materialised;
- the normalised attention entropy (dispersion) of query i at the snapshot layer
  (``sfcl.snapshot.triggers.attention_dispersion``, the serving rule), for every position.

Windows are packed into batches of at most ``batch_tokens`` tokens: every linear layer runs once
over the whole batch, attention once per run of equal-length windows with the windows as its batch
(``sfcl.model.llama.prefill_attention``: SFCL's kernels, bf16 on AMX tiles or AVX-512 BF16 vectors,
float32 on AVX2 and FMA, where :func:`native_attention`; torch's causal SDPA elsewhere), except at the snapshot layer, whose weights the dispersion needs: there per window,
the scores by one matmul and the causal softmax with each row's entropy by one native pass
(``torch.ops.sfcl.causal_softmax_entropy_``; torch's eager softmax where SFCL's kernels are not
loaded). A window is one causal pass from position 0, so no
KV cache is involved. Everything runs in the model's dtype (``--dtype auto``: fp32 on AVX2-only
CPUs, bf16 where native), logits reductions in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sfcl.model import decode_kernel
from sfcl.model.hardware import gemm_gflops
from sfcl.model.llama import native_prefill_attention, prefill_attention
from sfcl.snapshot.triggers import attention_dispersion, dispersion_from_entropy

# Rows of logits made and reduced at once, into one block reused across a forward's rows: (512, V) =
# 50 MB in bf16 for V = 49,152. Intel Xeon with AMX, bf16, 2 threads, 2026-12-05, a batch of 4 windows
# (scripts/profile_model_pass.py --logit-rows 128,512, alternating): 1.32-1.36 s at 512 rows against
# 1.40-1.44 at 128. A fresh 50 MB block per 512 rows (above glibc's largest mmap threshold, 32 MB: new
# pages every time) had doubled a whole build's system time (20.7 against 9.9-12.1 s).
LOGIT_ROWS = 512
RATE_SHAPE = (1024, 576, 1536)  # (M, K, N) of the GEMM-rate probe: a window through an MLP projection


@dataclass(slots=True)
class WindowOut:
    """What one window of T tokens yields (CPU tensors)."""

    hidden: torch.Tensor  # (T-1, H) float32 tap hidden state of positions 0..T-2 (not normalised)
    top_ids: torch.Tensor  # (T-1, K) int64 most likely next tokens, best first
    top_probs: torch.Tensor  # (T-1, K) float32 their probabilities
    surprisal: torch.Tensor  # (T-1,) float32 -log p(token i+1), nats
    dispersion: torch.Tensor  # (T,) float32 snapshot-layer dispersion of queries 0..T-1


def flops_per_token(args, mean_attended: float) -> float:
    """Model FLOP per token of a causal pass: 2 x the weights of every matmul (q/k/v, o, gate/up,
    down per layer; the LM head) plus attention, 4 x heads x head_dim x attended positions per
    layer (scores and weighted values). ``mean_attended``: mean attended length over the tokens
    ((T + 1) / 2 for a window of T). Embedding lookups and norms are not counted."""
    a = args
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    per_layer = a.hidden_size * (q + 2 * kv) + q * a.hidden_size + 3 * a.hidden_size * a.intermediate_size
    weights = a.n_layers * per_layer + a.hidden_size * a.vocab_size
    return 2.0 * weights + 4.0 * a.n_layers * q * mean_attended


def gemm_rate(dtype: torch.dtype) -> float:
    """GFLOP/s of a window-sized GEMM (``RATE_SHAPE``) in ``dtype`` on the calling thread's torch
    threads (``sfcl.model.hardware.gemm_gflops``, best of ~0.25 s of calls)."""
    return gemm_gflops(dtype, RATE_SHAPE, budget_s=0.25)


def logit_stats(logits: torch.Tensor, nxt: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a pass keeps of logits (c, V) in the model's dtype: top-K probabilities (c, K) float32
    and ids (c, K) int64, largest first, and the surprisal (c,) float32 nats of the ids ``nxt`` (c,).
    One native pass per row (``torch.ops.sfcl.logit_stats``, ``csrc/logit_stats.cpp``) on CPU once
    SFCL's kernels are loaded; elsewhere torch's logsumexp / topk / gather in float32 (no (c, V)
    log-softmax either way). The two agree to float32 rounding; tied logits may order differently."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16) and decode_kernel.loaded():
        tp, ti, sur, _ = torch.ops.sfcl.logit_stats(logits.contiguous(), nxt, top_k)
        return tp, ti, sur
    logits = logits.float()
    lse = torch.logsumexp(logits, -1)  # (c,)
    tv, ti = logits.topk(top_k, dim=-1)  # (c, K)
    return (tv - lse[:, None]).exp(), ti, lse - logits.gather(1, nxt[:, None])[:, 0]


# Whether run_windows adds o_proj's and down_proj's products into h inside the GEMMs (add_linear_) or after them;
# scripts/profile_model_pass.py --residual both alternates the two (whole 61-NDA pass 38.4-39.8 s against 41.1-42.1 s,
# Intel Xeon AMX, twenty-sixth session).
RESIDUAL_IN_GEMM = True


def add_linear_(h: torch.Tensor, x: torch.Tensor, lin: torch.nn.Module) -> torch.Tensor:
    """h += lin(x) in place: h (N, H), x (N, in) in h's dtype. A bias-free ``nn.Linear`` adds its
    product into h inside the GEMM (``addmm_``, beta = 1: the sum in the GEMM's float32 accumulators,
    rounded once), instead of writing the product and reading both back for the add. Other layers
    (weight-quantized ones) add their output. Returns h."""
    if type(lin) is torch.nn.Linear and lin.bias is None and lin.weight.dtype == h.dtype == x.dtype:
        return h.addmm_(x, lin.weight.t())
    return h.add_(lin(x))


def native_softmax(q: torch.Tensor) -> bool:
    """Whether the snapshot layer's weights and entropies come from the native kernel
    (``torch.ops.sfcl.causal_softmax_entropy_``): a CPU tensor in float32 / bf16 / fp16, SFCL's
    kernels loaded, no autograd. Elsewhere (CUDA, no compiler) torch's eager softmax."""
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and decode_kernel.loaded() and not torch.is_grad_enabled())


def native_attention(q: torch.Tensor) -> bool:
    """Whether a layer's causal attention (all but the snapshot layer's) runs on one of SFCL's kernels
    (``sfcl.model.llama.native_prefill_attention``: float32 on AVX2 and FMA, bf16 with head size 64 on
    AMX tiles or AVX-512 BF16 vectors). Elsewhere torch's causal SDPA."""
    return native_prefill_attention(q, q.shape[-1])


def windows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, native: bool) -> torch.Tensor:
    """Causal attention of n windows of T tokens, each from its position 0: q (n, T, nh, hd), k and v
    (n, T, nkv, hd) in the model's dtype; ``scale`` the layer's (1 / sqrt(hd), SDPA's default, which it
    keeps). Returns (n T, nh hd): SFCL's kernel for the dtype where ``native`` (:func:`native_attention`,
    ``sfcl.model.llama.prefill_attention``), torch's causal SDPA (GQA) otherwise."""
    n, T = q.shape[:2]
    if native:
        return prefill_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale).view(n * T, -1)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                       enable_gqa=True)  # (n, nh, T, hd)
    return o.transpose(1, 2).reshape(n * T, -1)


def _snapshot_attention(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The snapshot layer's causal attention of one window from position 0, with its weights' dispersion.
    q (1, nh, T, hd), k/v (1, nkv, T, hd). Returns o (T, nh hd) and the dispersion (T,) float32 of
    every query (``sfcl.snapshot.triggers.dispersion_from_entropy``): weights and entropies from
    ``torch.ops.sfcl.causal_softmax_entropy_`` where ``native_softmax``, else torch's eager softmax in
    float32 and ``attention_dispersion`` (as ``Attention.prefill_attn`` does for "all")."""
    T = q.shape[2]
    a = attn.a
    nh, nkv, hd = a.n_heads, a.n_kv_heads, a.head_dim
    g = nh // nkv
    qg = q.reshape(1, nkv, g * T, hd)  # heads of a group share K
    n_att = torch.arange(1, T + 1, device=q.device)  # (T,) positions query i attends
    if native_softmax(q):
        s = torch.matmul(qg, k.transpose(-1, -2))  # (1, nkv, g T, T) raw scores, model dtype
        ent = torch.ops.sfcl.causal_softmax_entropy_(s.view(nh, T, T), attn.scale)  # s -> weights; (nh, T) fp32
        o = torch.matmul(s, v).view(nh, T, hd)  # (nh, T, hd)
        return o.transpose(0, 1).reshape(T, nh * hd), dispersion_from_entropy(ent.mean(0), n_att)
    s = torch.matmul(qg, k.transpose(-1, -2)).view(1, nkv, g, T, T) * attn.scale  # (1, nkv, g, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    p = s.float().masked_fill(~causal, float("-inf")).softmax(-1)  # (1, nkv, g, T, T) fp32
    o = torch.matmul(p.to(v.dtype).view(1, nkv, g * T, T), v).view(nh, T, hd)  # (nh, T, hd)
    disp = attention_dispersion(p.view(nh, T, T).transpose(0, 1), n_att)  # (T,)
    return o.transpose(0, 1).reshape(T, nh * hd), disp


def _equal_runs(lens: list[int]) -> list[tuple[int, int, int]]:
    """(first token, number of windows, window length) of each run of consecutive windows of one
    length, in order: a build's windows are all ``window_tokens`` long but each document's last."""
    runs, start = [], 0
    for n in lens:
        if runs and runs[-1][2] == n:
            runs[-1][1] += 1
        else:
            runs.append([start, 1, n])
        start += n
    return [tuple(r) for r in runs]


@torch.inference_mode()
def run_windows(model, windows: list[list[int]], tap_layer: int, top_k: int) -> list[WindowOut]:
    """One forward over ``windows`` (token id lists, each of >= 2 tokens, each starting at
    position 0) through ``model`` (``sfcl.model.llama.LlamaModel``); returns one
    :class:`WindowOut` per window, in order. The caller sizes the batch (total tokens).
    Raises ValueError for a window shorter than 2 tokens or top_k < 1."""
    if any(len(w) < 2 for w in windows) or top_k < 1:
        raise ValueError("every window needs >= 2 tokens and top_k must be >= 1")
    dev = model.embed_tokens.weight.device
    lens = [len(w) for w in windows]
    ids = torch.tensor([t for w in windows for t in w], device=dev)  # (N,)
    pos = torch.cat([torch.arange(n, device=dev) for n in lens])  # (N,)
    h = model.embed_tokens(ids)[None]  # (1, N, H)
    cos, sin = model.rope(pos, h.dtype)  # (N, 1, hd)
    cos, sin = cos[None], sin[None]  # (1, N, 1, hd)
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    runs = _equal_runs(lens)  # (first token, windows, length) of consecutive windows of one length
    tap = disp = None
    native = None  # whether native_attention, decided at the first layer
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        q, k, v = attn.project(layer.input_layernorm(h), cos, sin)  # (1, N, heads, hd)
        outs, disps = [], []
        if i == tap_layer:
            for a, b in zip(starts[:-1], starts[1:]):
                o, d = _snapshot_attention(attn, q[:, a:b].transpose(1, 2), k[:, a:b].transpose(1, 2),
                                           v[:, a:b].transpose(1, 2))
                outs.append(o)  # (T, nh hd)
                disps.append(d)
        else:
            native = native_attention(q) if native is None else native
            for a, n, T in runs:  # windows of one length: one causal attention call with the windows as its batch
                b = a + n * T
                qb, kb, vb = (x[0, a:b].view(n, T, x.shape[2], x.shape[3]) for x in (q, k, v))  # (n, T, heads, hd)
                outs.append(windows_attention(qb, kb, vb, attn.scale, native))  # (n T, nh hd)
        o = outs[0] if len(outs) == 1 else torch.cat(outs)  # (N, nh hd)
        if RESIDUAL_IN_GEMM:
            add_linear_(h[0], o, attn.o_proj)
            mlp = layer.mlp
            x = layer.post_attention_layernorm(h[0])  # (N, H)
            add_linear_(h[0], mlp.act(mlp.gate_up_proj(x)), mlp.down_proj)
        else:
            h = h + attn.o_proj(o[None])  # (1, N, H)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        if i == tap_layer:
            tap, disp = h[0].clone(), disps  # (N, H): later layers add into h in place
    # rows with a next token inside their window: all but each window's last position
    rows = torch.cat([torch.arange(a, b - 1, device=dev) for a, b in zip(starts[:-1], starts[1:])])  # (R,)
    nxt = ids[rows + 1]  # (R,)
    top_p, top_i, sur = [], [], []
    head = model.lm_head
    buf = None  # (LOGIT_ROWS, V): one block of logits reused, not fresh pages per block (see LOGIT_ROWS)
    for c in range(0, rows.shape[0], LOGIT_ROWS):
        r = rows[c : c + LOGIT_ROWS]
        x = model.norm(h[0, r])  # (n, H)
        if type(head) is torch.nn.Linear and head.bias is None:
            if buf is None:
                buf = torch.empty(min(LOGIT_ROWS, rows.shape[0]), head.weight.shape[0], dtype=x.dtype, device=dev)
            logits = torch.mm(x, head.weight.t(), out=buf[: x.shape[0]])  # (n, V)
        else:
            logits = head(x)
        tp, ti, s = logit_stats(logits, nxt[c : c + LOGIT_ROWS], top_k)
        top_p.append(tp)
        top_i.append(ti)
        sur.append(s)
    hid = tap[rows].float().cpu()  # (R, H)
    top_p, top_i, sur = torch.cat(top_p).cpu(), torch.cat(top_i).cpu(), torch.cat(sur).cpu()
    out, r0 = [], 0
    for n, d in zip(lens, disp):
        r1 = r0 + n - 1
        out.append(WindowOut(hidden=hid[r0:r1], top_ids=top_i[r0:r1], top_probs=top_p[r0:r1],
                             surprisal=sur[r0:r1], dispersion=d.float().cpu()))
        r0 = r1
    return out
