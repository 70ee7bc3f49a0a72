"""Our Llama-family forward pass (SmolLM2, Llama 2/3, Mistral, Qwen2/Qwen3) with per-layer taps.

Why our own definition rather than transformers' model classes: the engine needs (a) a KV cache
whose layout *we* own (slot-contiguous today, paged/INT8 next) written in place during the
forward, (b) a tap at one "snapshot layer" that returns both its residual-stream hidden state and
its attention row for the new token, without switching every layer to eager attention, and (c)
batched decode over sequences of different lengths with one mask. transformers' classes would need
a custom Cache subclass plus hooks plus ``attn_implementation="eager"`` for (b), which costs every
layer. Weights still come from transformers (HF folder or GGUF), see ``sfcl.model.loader``.

Data lives wherever the weights were moved (CPU here; CUDA works unchanged). Shapes use
B = sequences in the batch, T = new tokens per sequence, S = attended KV length, H = hidden size,
nh = query heads, nkv = KV heads, g = nh // nkv, hd = head dim, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from sfcl.model import decode_kernel, decode_stack


@dataclass(slots=True, frozen=True)
class LlamaArgs:
    """Architecture of a Llama-family decoder; built from a transformers config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: bias on q/k/v projections
    qk_norm: bool  # Qwen3: RMSNorm on per-head q and k

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

    def check_positions(self, n_positions: int, what: str) -> None:
        """Raise ValueError, naming ``what``, when ``n_positions`` positions (0 to n_positions - 1)
        do not fit the model's context (``max_position_embeddings``): past it the rotary tables end
        (``LlamaModel.rope``) and the model was never trained there. The one check for every caller
        that feeds the model a text of its own choosing (the anchor builder's windows, a clause
        anchor, a teacher-forced text, the engine's ``max_model_len``), through ``LlamaModel.fit_rope``."""
        if n_positions > self.max_position_embeddings:
            raise ValueError(f"{what}: {n_positions} positions, more than the model's context of "
                             f"{self.max_position_embeddings} tokens")


SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# Eager decode attention over a 16-bit KV cache runs in float32 (K and V upcast per step) when the
# step attends to at most this many positions in all (B x S): a small 16-bit batched matmul carries a
# fixed ~45 us on CPU (oneDNN), a float32 one ~15 us. Measured per layer, one thread, bf16 cache, on
# an AMD EPYC with AVX-512 BF16 (upcast / bf16 time): B = 1: 0.43 / 0.65 / 0.76 / 1.27 at S = 64 /
# 256 / 1,024 / 2,048; B = 2: 0.68 / 0.90 at S = 64 / 256; B = 8: 0.80 at S = 64 and 1.42 at 256.
SMALL_ATTN_FP32_POSITIONS = 1024


def args_from_config(cfg) -> LlamaArgs:
    """Map a transformers PretrainedConfig to LlamaArgs. Raises ValueError if unsupported."""
    mt = getattr(cfg, "model_type", "?")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model type {mt!r}; SFCL runs Llama-family decoders: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    n_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    return LlamaArgs(
        model_type=mt,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        n_layers=cfg.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(cfg, "attention_bias", mt == "qwen2")),
        qk_norm=(mt == "qwen3"),
    )


def native_rows(x: torch.Tensor, *more: torch.Tensor) -> bool:
    """Whether SFCL's element-wise operators (``torch.ops.sfcl.rms_norm`` / ``silu_mul`` / ``rope_``,
    ``csrc/elementwise.cpp``) take ``x`` and the other tensors ``more`` they read (RMSNorm's weight):
    contiguous float32 / bf16 / float16 CPU tensors of one dtype, none needing autograd (the operators
    have no autograd kernel), the kernel library loaded (``decode_kernel.loaded``), and not under
    torch.compile (which fuses these steps itself). Elsewhere torch's operators run: the same
    arithmetic up to the order of RMSNorm's float32 sum and SiLU's exp."""
    if torch.compiler.is_compiling() or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    grad = torch.is_grad_enabled()
    return (all(t.dtype == x.dtype and t.device.type == "cpu" and t.is_contiguous() and not (t.requires_grad and grad)
                for t in (x, *more))
            and decode_kernel.loaded())


def native_prefill_attention(x: torch.Tensor, head_dim: int) -> bool:
    """Whether a prompt chunk's causal attention runs on one of SFCL's kernels
    (:func:`prefill_attention`) instead of torch's SDPA, for queries like ``x`` (any activation of the
    layer: dtype, device, autograd): on the CPU, no autograd, the kernel library loaded
    (``decode_kernel.loaded``), not under torch.compile, and either float32 with ``head_dim`` 64 or 128
    on a build with AVX2 (``torch.ops.sfcl.prefill_attention_ready``) or bf16 with ``head_dim`` 64 on a
    build that runs AVX-512 BF16 or AMX (``torch.ops.sfcl.causal_attention_ready``). float32: the same
    softmax up to the order of the sums (max |difference| ~1e-6 on unit-variance inputs); bf16: the
    exponentials rounded to bf16 before P V, as torch's CPU flash attention does."""
    if (x.device.type != "cpu" or torch.compiler.is_compiling() or (torch.is_grad_enabled() and x.requires_grad)
            or not decode_kernel.loaded()):
        return False
    if x.dtype == torch.float32:
        return head_dim in (64, 128) and torch.ops.sfcl.prefill_attention_ready()
    return x.dtype == torch.bfloat16 and head_dim == 64 and torch.ops.sfcl.causal_attention_ready()


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of prompt chunks on SFCL's kernel for their dtype, where
    :func:`native_prefill_attention` allows it: q (B, nh, T, hd), k and v (B, nkv, S, hd) (S >= T; the
    last dimension contiguous, any other strides; nh a multiple of nkv) in float32 or bf16, the queries
    at positions [S - T, S) over keys [0, S), softmax of ``scale`` q . k. Returns o (B, T, nh, hd) in
    q's dtype, contiguous. float32: ``torch.ops.sfcl.prefill_attention`` (``csrc/prefill_attention.cpp``,
    flash-attention recurrence on AVX2 and FMA); bf16: ``torch.ops.sfcl.causal_attention``
    (``csrc/causal_attention.cpp``, AMX tiles or AVX-512 BF16 vectors). Raises RuntimeError for
    arguments the kernel cannot take."""
    if q.dtype == torch.float32:
        return torch.ops.sfcl.prefill_attention(q, k, v, scale)
    return torch.ops.sfcl.causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if native_rows(x, self.weight):  # one pass over the rows
            return torch.ops.sfcl.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # one call into C++ for the same fp32 arithmetic
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 like the reference implementations, return the input dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (..., heads, hd) in the half-split layout (Llama / transformers):
    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``, computed as the
    halves swapped (one ``flip``) times ``sin_signed = cat(-sin1, sin2)``: the same products,
    bit for bit, in 4 operators instead of 6."""
    *lead, hd = x.shape
    swapped = x.view(*lead, 2, hd // 2).flip(-2).view(*lead, hd)  # (x2, x1)
    return x * cos + swapped * sin_signed


@dataclass(slots=True)
class RowGroup:
    """Decode rows attended together (``Attention.decode_attn``): positions [0, shared) of their
    cache rows hold identical KV (the same prefix-cache blocks; ``sfcl.engine.scheduler.decode_groups``)
    and are read once, from cache row ``source``; each row reads its own positions [shared, S).
    shared = 0: rows with nothing shared (each reads its whole row)."""

    rows: torch.Tensor  # (G,) int64 indices into the decode batch (== their cache rows)
    span: slice | None  # the same rows as a slice when they are consecutive (views, no gather)
    source: int  # cache row holding the shared positions
    shared: int  # positions; a whole number of KV blocks


@dataclass(slots=True)
class AttnBatch:
    """How the tokens of one forward call map onto the KV cache.

    Two layouts, both writing new K/V into slot-contiguous cache rows:
    - prefill: one sequence, T new tokens at positions [start, start+T), cache slot ``slots[0]``;
    - decode: B sequences, one token each, cache slots ``slots`` (B,), positions ``positions`` (B,).
    """

    is_prefill: bool
    slots: torch.Tensor  # (B,) int64 cache slot per sequence
    positions: torch.Tensor  # prefill: (T,) int64; decode: (B,) int64 — absolute positions of new tokens
    kv_len: int  # S: attend to cache positions [0, S) (prefill: start+T; decode: max(positions)+1)
    mask: torch.Tensor | None = None  # decode: (B, 1, 1, S) bool, True = attend; row b: positions [0, positions[b]]
    slot_range: tuple[int, int] | None = None  # decode: slots are exactly range(a, b) -> views, no gather
    groups: list[RowGroup] | None = None  # decode: shared-prefix row groups covering every row (eager only)


@dataclass(slots=True)
class ChunkSpec:
    """One prompt chunk inside a ``StepBatch``: tokens [offset, offset+length) of the step are
    prompt positions [start, start+length) of cache row ``slot``."""

    slot: int
    start: int
    offset: int
    length: int
    want_probs: bool = False  # snapshot-layer weights of its last query (the chunk that samples)


@dataclass(slots=True)
class StepBatch:
    """All tokens of one engine step, flattened: ``n_decode`` decode rows (one token each, cache
    rows [0, n_decode), described by ``decode``) followed by the prompt chunks. One forward call
    computes them all, so the weights are read once per step rather than once per part."""

    positions: torch.Tensor  # (N,) int64 absolute position of every token
    decode: AttnBatch | None  # the decode rows (is_prefill False), or None
    chunks: list[ChunkSpec]
    sample_index: torch.Tensor  # (M,) int64 tokens whose logits/tap are returned: decode rows, then last chunks
    keep_tap_states: bool = False  # return the tap hidden state of every token (context anchors)

    @property
    def n_decode(self) -> int:
        return 0 if self.decode is None else int(self.decode.positions.shape[0])


class Attention(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.a = a
        q_out, kv_out = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        self.qkv_proj = nn.Linear(a.hidden_size, q_out + 2 * kv_out, bias=a.attention_bias)
        self.o_proj = nn.Linear(q_out, a.hidden_size, bias=False)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None
        self.scale = a.head_dim ** -0.5

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x (B, T, H) or (N, H) (= (1, N, H)) -> rotated q (B, T, nh, hd), k (B, T, nkv, hd) and
        v (B, T, nkv, hd);
        cos / sin_signed (``LlamaModel.rope``) broadcast over (B, T, heads, hd). Without per-head
        norms q and k are rotated together, as one (B, T, nh + nkv, hd) view."""
        a = self.a
        B, T = (1, x.shape[0]) if x.dim() == 2 else x.shape[:2]  # (N, H): one step's tokens, B = 1
        nh, nkv, hd = a.n_heads, a.n_kv_heads, a.head_dim
        qkv = self.qkv_proj(x)  # (B, T, (nh + 2 nkv) hd)
        if self.q_norm is None and cos.numel() == B * T * hd and native_rows(qkv):  # one row of cos per token
            rows = torch.ops.sfcl.rope_(qkv.view(B * T, -1), cos.reshape(B * T, hd), sin.reshape(B * T, hd),
                                        nh + nkv, hd)  # q and k heads rotated in place
            qk = rows[:, :(nh + nkv) * hd].view(B, T, nh + nkv, hd)
            return qk[:, :, :nh], qk[:, :, nh:], rows[:, (nh + nkv) * hd:].view(B, T, nkv, hd)
        if self.q_norm is None:
            qk = apply_rope(qkv[..., :(nh + nkv) * hd].view(B, T, nh + nkv, hd), cos, sin)  # (B, T, nh + nkv, hd)
            return qk[:, :, :nh], qk[:, :, nh:], qkv[..., (nh + nkv) * hd:].view(B, T, nkv, hd)
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q = self.q_norm(q.view(B, T, nh, hd))
        k = self.k_norm(k.view(B, T, nkv, hd))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.view(B, T, nkv, hd)

    def prefill_attn(self, q, k, v, start: int, slot: int, kv, layer: int, want_probs: str | None,
                     mask: torch.Tensor | None = None):
        """One sequence's prompt chunk. q (1, nh, T, hd), k/v (1, nkv, T, hd) at positions
        [start, start+T) of cache row ``slot``; attends to [0, start+T). mask: the (T, S) bool
        causal mask for ``start > 0`` when the caller has it (``chunk_mask``; else built here), for
        torch's SDPA: chunks take SFCL's kernel (``prefill_attention``) where
        ``native_prefill_attention`` allows, which needs none (and returns o as a transposed view).
        Returns o (1, nh, T, hd) and probs (None, or float32 (1, nh, 1, S) for "last" /
        (1, nh, T, S) for "all")."""
        a = self.a
        T = q.shape[2]
        nh, nkv, hd = a.n_heads, a.n_kv_heads, a.head_dim
        g = nh // nkv
        S = start + T
        probs = None
        kv.write_prefill(layer, slot, start, k[0], v[0])
        kk, vv = kv.read(layer, slice(slot, slot + 1), S)  # (1, nkv, S, hd)
        if want_probs == "all":
            # Eager attention for this one layer: the builder calibrates on every position.
            qg = q.reshape(1, nkv, g * T, hd)  # (1, nkv, g T, hd): heads of a group share K
            s = torch.matmul(qg, kk.transpose(-1, -2)).view(1, nkv, g, T, S) * self.scale
            causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=start)
            s = s.float().masked_fill(~causal, float("-inf"))
            p = s.softmax(-1)  # (1, nkv, g, T, S) fp32
            o = torch.matmul(p.to(vv.dtype).view(1, nkv, g * T, S), vv)  # (1, nkv, g T, hd)
            return o.view(1, nh, T, hd), p.view(1, nh, T, S)
        if kk.dtype == q.dtype and native_prefill_attention(q, hd):  # no mask to build
            o = prefill_attention(q, kk, vv, self.scale).transpose(1, 2)  # (1, T, nh, hd) -> (1, nh, T, hd)
        else:
            if start and mask is None:
                mask = chunk_mask(T, start, q.device)
            o = F.scaled_dot_product_attention(q, kk, vv, is_causal=not start, enable_gqa=True,
                                               attn_mask=mask if start else None)  # (1, nh, T, hd)
        if want_probs == "last":
            # Only the last query's weights are needed: one (g, S) row per KV head.
            ql = q[:, :, -1:].reshape(1, nkv, g, hd)
            s = torch.matmul(ql, kk.transpose(-1, -2)).float() * self.scale  # (1, nkv, g, S)
            probs = s.softmax(-1).view(1, nh, 1, S)
        return o, probs

    def decode_attn(self, q, k, v, batch: AttnBatch, kv, layer: int, want_probs: bool,
                    bias: torch.Tensor | None = None):
        """B sequences, one new token each. q (B, nh, hd), k/v (B, nkv, hd). bias: the additive
        float32 (B, 1, 1, S) form of ``batch.mask`` (``decode_bias``, built once per step by the
        caller; else built here). Returns o (B, nh * hd) and probs (None, or float32
        (B, nh, 1, S)). With ``kv.fused_decode`` (CPU, set by the engine) rows in a slot range
        without shared-prefix groups go through SFCL's fused kernel (``sfcl.model.decode_kernel``);
        the torch operators below do the same arithmetic otherwise."""
        a = self.a
        B = q.shape[0]
        nh, nkv, hd = a.n_heads, a.n_kv_heads, a.head_dim
        g = nh // nkv
        S = batch.mask.shape[-1]  # == batch.kv_len; read off the tensor so a compiled step keeps B, S symbolic
        if kv.fused_decode and batch.slot_range is not None and not batch.groups and not torch.compiler.is_compiling():
            # one fused operator: writes K/V, attends each row to [0, positions[b]] (== the mask)
            return decode_kernel.decode_attention(q, kv.k[layer], kv.v[layer], k, v, batch.positions,
                                                  batch.slot_range[0], S, self.scale, want_probs)
        kv.write_decode(layer, batch.slots, batch.positions, k, v)  # (B, nkv, hd)
        # Grouped-query decode as batched matmul: on CPU this beats SDPA(enable_gqa) ~3x. Scores as
        # K q^T, not q K^T: the cache views are strided, which CPU bmm copies to contiguous first, and
        # K^T's copy is a transpose (S=1000: 124 us per layer against 36 us for K's plain copy). The
        # scale goes on q (nh hd numbers, not nh S; exact for hd = 64, where it is 1/8).
        qg = (q * self.scale).reshape(B, nkv, g, hd)
        if bias is None and B > 1:
            bias = decode_bias(batch.mask)
        if batch.groups:
            return self._grouped_decode(qg, batch.groups, kv, layer, S, want_probs, bias)
        rows = slice(batch.slot_range[0], batch.slot_range[0] + B) if batch.slot_range is not None else batch.slots
        kk, vv = kv.read(layer, rows, S)  # (B, nkv, S, hd): views when not INT8
        # eager only, tested first: under torch.compile B x S is symbolic and a comparison would become a guard
        small = not torch.compiler.is_compiling() and kk.dtype != torch.float32 and B * S <= SMALL_ATTN_FP32_POSITIONS
        if small:  # K and V upcast: float32 matmuls throughout
            kk, vv, qg = kk.float(), vv.float(), qg.float()
            s = torch.matmul(qg, kk.transpose(-1, -2))  # (B, nkv, g, S)
        else:
            s = torch.matmul(kk, qg.transpose(-1, -2)).transpose(-1, -2)  # (B, nkv, S, g) -> (B, nkv, g, S)
        if s.dtype != torch.float32:
            s = s.float()
        if bias is not None:  # else a single row of forward_step, whose kv_len is its own: nothing to mask
            s = s + bias  # (B, 1, 1, S) broadcast over (nkv, g)
        p = s.softmax(-1)  # (B, nkv, g, S) fp32
        o = torch.matmul(p if p.dtype == vv.dtype else p.to(vv.dtype), vv).to(q.dtype).view(B, nh * hd)  # (B, nh hd)
        return o, (p.view(B, nh, 1, S) if want_probs else None)  # one query per sequence: "last" == "all"

    def _grouped_decode(self, qg, groups: list[RowGroup], kv, layer: int, S: int, want_probs: bool,
                        bias: torch.Tensor | None):
        """``decode_attn`` by row groups (cascade / shared-prefix attention: Juravsky et al. 2024,
        "Hydragen"). qg: (B, nkv, g, hd), scaled. For a group of G rows sharing positions [0, P),
        the scores of those positions are one GEMM of the group's G g queries per KV head against
        the source row's keys, (nkv, P, hd) x (nkv, hd, G g), so the shared keys and values are read
        once per group rather than once per row (decode attention is bound by that read: ~5.6 ms
        per layer for 16 rows x 1,500 fp32 positions on one AVX2 core); positions [P, S) are read
        per row as in the ungrouped path. Scores of both parts are joined before one softmax, so
        the result equals the ungrouped one up to float rounding. Returns (o (B, nh hd), probs)."""
        B, nkv, g, hd = qg.shape
        o = qg.new_empty(B, nkv, g, hd)
        probs = torch.empty(B, nkv, g, S, dtype=torch.float32, device=qg.device) if want_probs else None
        for grp in groups:
            at = grp.span if grp.span is not None else grp.rows
            P, G = grp.shared, grp.rows.shape[0]
            qi = qg[at]  # (G, nkv, g, hd)
            ks, vs = kv.read(layer, at, S, start=P)  # (G, nkv, S - P, hd)
            s = torch.matmul(ks, qi.transpose(-1, -2)).transpose(-1, -2)  # (G, nkv, g, S - P)
            if P:
                kp, vp = kv.read(layer, slice(grp.source, grp.source + 1), P)  # (1, nkv, P, hd)
                qt = qi.permute(1, 0, 2, 3).reshape(nkv, G * g, hd)  # (nkv, G g, hd)
                sp = torch.matmul(qt, kp[0].transpose(-1, -2))  # (nkv, G g, P)
                s = torch.cat([sp.view(nkv, G, g, P).transpose(0, 1), s], dim=-1)  # (G, nkv, g, S)
            if s.dtype != torch.float32:
                s = s.float()
            if bias is not None:
                s = s + bias[at]  # (G, 1, 1, S)
            p = s.softmax(-1)  # (G, nkv, g, S) fp32
            pc = p if p.dtype == vs.dtype else p.to(vs.dtype)
            oi = torch.matmul(pc[..., P:], vs)  # (G, nkv, g, hd)
            if P:
                pp = pc[..., :P].transpose(0, 1).reshape(nkv, G * g, P)
                oi = oi + torch.matmul(pp, vp[0]).view(nkv, G, g, hd).transpose(0, 1)
            o[at] = oi
            if probs is not None:
                probs[at] = p
        return o.view(B, nkv * g * hd), (probs.view(B, nkv * g, 1, S) if want_probs else None)

    def forward(self, x, cos, sin, batch: AttnBatch, kv, layer: int, want_probs: str | None):
        """x: (B, T, H). kv: ``sfcl.model.kv_cache.KVCache`` (writes and reads layer ``layer``).
        cos, sin: ``LlamaModel.rope`` of the new tokens' positions. Returns (out (B, T, H), probs).

        want_probs: None, "last" or "all". probs: attention weights, float32, rows summing to 1
        over attended positions: (B, nh, 1, S) for the last new token, or (1, nh, T, S) for all.
        """
        B, T, _ = x.shape
        q, k, v = self.project(x, cos, sin)  # (B, T, heads, hd)
        if batch.is_prefill:
            o, probs = self.prefill_attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         batch.kv_len - T, int(batch.slots[0]), kv, layer, want_probs)
            o = o.transpose(1, 2).reshape(B, T, -1)
        else:
            # the mask always applies here: callers such as the CUDA-graph runner pad kv_len to a
            # bucket, so even a single row may have positions beyond its own to mask out
            bias = decode_bias(batch.mask) if batch.mask is not None else None
            o, probs = self.decode_attn(q[:, 0], k[:, 0], v[:, 0], batch, kv, layer, bool(want_probs), bias)
            o = o.view(B, 1, -1)
        return self.o_proj(o), probs

    def forward_step(self, x, cos, sin, step: "StepBatch", kv, layer: int, tap: bool,
                     bias: torch.Tensor | None = None, masks: list | None = None):
        """One engine step's tokens in one call: x (N, H) = decode rows then prompt chunks.
        The projections run once over all N tokens; attention runs per part (the decode rows as
        one batch, each chunk on its own or with the chunks of its sequence that follow it,
        ``attention_runs``). bias / masks: the decode rows' additive mask and each
        chunk's causal mask, built once per step (``LlamaModel.forward_step``). Returns
        (out (N, H), probs per part: list, one entry for the decode batch (if any) then one
        per chunk; float32 (B, nh, 1, S) or None; only when ``tap``)."""
        q, k, v = self.project(x, cos, sin)  # (1, N, heads, hd)
        outs, probs = [], []
        nd = step.n_decode
        if nd:
            o, p = self.decode_attn(q[0, :nd], k[0, :nd], v[0, :nd], step.decode, kv, layer, tap, bias)
            outs.append(o)  # (nd, nh hd)
            probs.append(p)
        for i, n in attention_runs(step.chunks, masks is None):  # chunks [i, i + n): one sequence's, back to back
            c, last = step.chunks[i], step.chunks[i + n - 1]
            a, b = c.offset, last.offset + last.length
            o, p = self.prefill_attn(q[:, a:b].transpose(1, 2), k[:, a:b].transpose(1, 2), v[:, a:b].transpose(1, 2),
                                     c.start, c.slot, kv, layer, "last" if tap and last.want_probs else None,
                                     masks[i] if masks is not None else None)
            outs.append(o[0].transpose(0, 1).reshape(b - a, -1))  # (T, nh hd)
            probs += [None] * (n - 1) + [p]
        o = outs[0] if len(outs) == 1 else torch.cat(outs)  # (N, nh hd)
        return self.o_proj(o), probs


def attention_runs(chunks: list[ChunkSpec], merge: bool) -> list[tuple[int, int]]:
    """(first chunk, number of chunks) of each attention call a step's prompt chunks take, in order.
    With ``merge`` (no per-chunk masks built), chunks that continue the previous one (same cache row,
    next positions, next tokens of the step) and only the last of which wants probabilities share one
    call: a repeated prompt's restored prefix is followed by two chunks (the blocks up to its last full
    one, then its tail, which the scheduler keeps apart for its GEMM shapes), and each call packs the
    row's whole K and V (~0.5 ms a layer at 3,100 cached positions, Intel Xeon with AMX). A query's
    result does not depend on which queries share its call (``prefill_attention``), so this changes
    no output."""
    runs: list[list[int]] = []
    for i, c in enumerate(chunks):
        if merge and runs:
            p = chunks[i - 1]
            if (c.slot == p.slot and c.start == p.start + p.length and c.offset == p.offset + p.length
                    and not p.want_probs):
                runs[-1][1] += 1
                continue
        runs.append([i, 1])
    return [(i, n) for i, n in runs]


def chunk_mask(T: int, start: int, device) -> torch.Tensor | None:
    """Causal mask of a prompt chunk: T queries at positions [start, start+T) over keys [0, start+T),
    bool (T, start+T), True = attend; None for ``start == 0`` (plain causal: ``is_causal``)."""
    if not start:
        return None
    return torch.ones(T, start + T, dtype=torch.bool, device=device).tril(diagonal=start)


def decode_bias(mask: torch.Tensor) -> torch.Tensor:
    """Additive form of a decode mask: bool (B, 1, 1, S), True = attend -> float32 (B, 1, 1, S)
    holding 0 where attended and -inf elsewhere."""
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))


class MLP(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.gate_up_proj = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    @staticmethod
    def act(gu: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up of gu (..., 2 I) = cat(gate, up) -> (..., I), in gu's dtype."""
        if native_rows(gu):
            return torch.ops.sfcl.silu_mul(gu)
        gate, up = gu.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward(self, x):
        return self.down_proj(self.act(self.gate_up_proj(x)))  # gate_up (..., 2 I) -> (..., H)


class Block(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MLP(a)


@dataclass(slots=True)
class ForwardOut:
    """Result of one forward call (tensors stay on the model's device)."""

    logits: torch.Tensor  # (B, V) float32 for the last new token of each sequence (all T if all_logits)
    tap_hidden: torch.Tensor  # (B, T_out, H) residual stream after the snapshot layer (T_out = T or 1; T with tap_all)
    tap_probs: torch.Tensor | None  # (B, nh, T_out, S) float32 snapshot-layer attention weights


ROPE_BLOCK = 65536  # positions per block of rope_tables' float64 temporaries


def rope_tables(inv_freq: torch.Tensor, scaling: float, n_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and sin (RoFormer, Su et al. 2021) for positions 0..n_positions-1: inv_freq
    (hd/2,) float32 -> cos, sin (n_positions, hd/2) float32, each times ``scaling`` (the rope type's
    attention scaling). The angles are float32 products position x inv_freq, as transformers computes
    them; their cos and sin are taken in float64 by numpy and rounded to float32 (memory:
    n_positions x hd x 4 bytes: 2 MiB for SmolLM2's 8,192 x 64, 64 MiB for a 131,072-token context
    at head size 128; on a GPU the CPU masters stay besides the device copy).

    Not torch's float32 ``cos``: on CPU it calls MKL's ``vsCos``, which in some processes (about 1 in
    8 here, after an MKL GEMM on 1 thread and a return to 2 threads, as the start-up dtype probe does)
    returns cos(1) = 0.5403335 for 0.5403023 on the main thread's share of the rows. That made two
    anchor builds with one seed differ (Intel Xeon with AMX, torch 2.13.0+cpu, 2026-12-06)."""
    inv = inv_freq.float().cpu()[None, :]  # (1, hd/2)
    cos = torch.empty(n_positions, inv.shape[1], dtype=torch.float32, device="cpu")  # whatever the defaults
    sin = torch.empty_like(cos)
    for a in range(0, n_positions, ROPE_BLOCK):  # float64 temporaries of one block at a time
        b = min(n_positions, a + ROPE_BLOCK)
        angles = (torch.arange(a, b, dtype=torch.float32, device="cpu")[:, None] * inv).double().numpy()  # (n, hd/2)
        cos[a:b] = torch.from_numpy(np.cos(angles)).float() * scaling
        sin[a:b] = torch.from_numpy(np.sin(angles)).float() * scaling
    return cos, sin


class LlamaModel(nn.Module):
    """Decoder with a slot-contiguous KV cache and a tap at one layer.

    ``forward(ids, batch, kv, tap_layer)``: ids (B, T) int64. kv: ``sfcl.model.kv_cache.KVCache``.
    The tap returns the hidden state *after* block ``tap_layer`` (0-based) and that block's
    attention weights. Rotary embeddings follow RoFormer (Su et al. 2021), parameters from the
    checkpoint's config via transformers' ``ROPE_INIT_FUNCTIONS`` (default, llama3, yarn, ...).
    """

    def __init__(self, a: LlamaArgs, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
        super().__init__()
        self.a = a
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        self.attention_scaling = attention_scaling
        for name in ("inv_freq", "rope_cos", "rope_sin"):  # (hd/2,), (P, hd/2), (P, hd/2)
            self.register_buffer(name, None, persistent=False)
        self._rope_need = 0  # the most positions a caller has asked the tables for (fit_rope)
        self.set_rope(inv_freq, a.max_position_embeddings)

    def set_rope(self, inv_freq: torch.Tensor, n_positions: int) -> None:
        """Rotary frequencies inv_freq (hd/2,) and their tables for positions 0..n_positions-1
        (:func:`rope_tables`, this model's attention scaling): float32 masters on the CPU, restored
        after every .to() / .half() (see _apply), placed on the weights' device."""
        # a copy of its own: the loader's inv_freq is a view into the cached weights file's memory map,
        # and holding it kept the whole mapping resident (+513 MiB RSS for SmolLM2, twenty-fourth
        # to twenty-fifth session)
        inv = inv_freq.detach().to("cpu", torch.float32).clone()
        self._rope_master = (inv, *rope_tables(inv, self.attention_scaling, n_positions))
        self._place_rope()

    def fit_rope(self, n_positions: int, what: str = "rotary tables", slack_bytes: int = 64 << 20) -> None:
        """Make the rotary tables cover positions 0..n_positions-1 for a caller that will feed the
        model that many: raises ValueError naming ``what`` past the model's context
        (``LlamaArgs.check_positions``), grows the tables when they are shorter, and cuts them to the
        most any caller has asked for so far when the rest would hold more than ``slack_bytes`` (the
        engine's ``max_model_len`` under a long-context checkpoint: a 1M-position Qwen2.5 with
        head_dim 128 held 0.5 GiB of tables; SmolLM2's 8,192 positions, 2 MiB, are never cut). A
        later, smaller need never cuts under an earlier caller (two engines on one model)."""
        self.a.check_positions(n_positions, what)
        self._rope_need = max(self._rope_need, n_positions)
        have, half = self._rope_master[1].shape
        if have < self._rope_need or (have - self._rope_need) * half * 4 * 2 > slack_bytes:
            self.set_rope(self._rope_master[0], self._rope_need)

    def _place_rope(self) -> None:
        """The rotary buffers: the float32 masters on the weights' device (on the CPU, the masters
        themselves, no copy)."""
        dev = self.embed_tokens.weight.device
        for name, t in zip(("inv_freq", "rope_cos", "rope_sin"), self._rope_master):
            setattr(self, name, t.to(dev))

    def _apply(self, fn, recurse=True):
        """``nn.Module.to(dtype)`` casts every floating buffer. The rotary frequencies and tables stay
        float32 whatever the weights' dtype (in bf16, inv_freq would keep 8 bits: 0.69921875 for
        0.69783, a phase error of 1.4 rad at position 1,000), on the weights' device."""
        super()._apply(fn, recurse)
        self._place_rope()
        return self

    def rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (...,) int64 within the tables (:meth:`fit_rope`; at most
        ``max_position_embeddings``) -> cos, sin_signed (..., 1, hd) in ``dtype``, broadcastable over
        heads; sin_signed is ``cat(-sin, sin)`` of the half-split layout, what ``apply_rope``
        multiplies by. Rows of the float32 tables (:func:`rope_tables`). A position past the tables
        raises IndexError in eager CPU code (a RuntimeError when compiled, a device-side assert on
        CUDA); every caller declares its positions with :meth:`fit_rope` first (the engine its
        ``max_model_len``, the builder its windows and calibration prompts, a clause anchor or a
        teacher-forced text its length)."""
        cos = self.rope_cos[positions].to(dtype)  # (..., hd/2)
        sin = self.rope_sin[positions].to(dtype)
        return torch.cat((cos, cos), -1)[..., None, :], torch.cat((-sin, sin), -1)[..., None, :]

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, batch: AttnBatch, kv, tap_layer: int,
                all_positions: bool = False, want_probs: bool = True, tap_all: bool = False) -> ForwardOut:
        """tap_all: return the tap hidden state for every position (B, T, H) while logits and
        attention weights stay last-position only (context-anchor capture during prefill)."""
        B, T = ids.shape
        h = self.embed_tokens(ids)  # (B, T, H)
        if batch.is_prefill:
            cos, sin = self.rope(batch.positions, h.dtype)  # (T, 1, hd)
            cos, sin = cos[None], sin[None]  # (1, T, 1, hd)
        else:
            cos, sin = self.rope(batch.positions, h.dtype)  # (B, 1, hd)
            cos, sin = cos[:, None], sin[:, None]  # (B, 1, 1, hd)
        tap_hidden = tap_probs = None
        for i, layer in enumerate(self.layers):
            is_tap = i == tap_layer
            attn_out, probs = layer.self_attn(
                layer.input_layernorm(h), cos, sin, batch, kv, i,
                (("all" if all_positions else "last") if want_probs and is_tap else None),
            )
            h = h + attn_out
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if is_tap:
                tap_hidden = h if all_positions or tap_all else h[:, -1:]
                if probs is not None:
                    tap_probs = probs if all_positions else probs[:, :, -1:]
        hn = self.norm(h if all_positions else h[:, -1:])
        logits = self.lm_head(hn).float()  # (B, T_out, V)
        if not all_positions:
            logits = logits[:, -1]
        return ForwardOut(logits=logits, tap_hidden=tap_hidden, tap_probs=tap_probs)


    @torch.inference_mode()
    def forward_step(self, ids: torch.Tensor, step: StepBatch, kv, tap_layer: int) -> "StepOut":
        """One engine step: ids (1, N) int64 laid out as ``step`` says. Linear layers see all N
        tokens at once; attention is per part (``Attention.forward_step``). Logits and the tap
        hidden state are returned only for ``step.sample_index`` (M rows), so chunks that do not
        end a prompt cost no lm_head. A step of decode rows only runs its layers in one C++ call
        where the engine turned that on (``sfcl.model.decode_stack``; same results, float32 bit
        for bit)."""
        h = self.embed_tokens(ids[0])  # (N, H): 2-D activations, so no linear layer reshapes
        cos, sin = self.rope(step.positions, h.dtype)  # (N, 1, hd)
        fused = decode_stack.run(self, h, cos[:, 0], sin[:, 0], step, kv, tap_layer) \
            if decode_stack.applies(step, kv) else None
        if fused is not None:
            h, tap_hidden, tap_p = fused  # (N, H), (N, H), (N, nh, 1, S)
            tap_probs = [tap_p]
        else:
            h, tap_hidden, tap_probs = self._layers_step(h, cos[None], sin[None], step, kv, tap_layer)
        hs = h[step.sample_index]  # (M, H)
        logits = self.lm_head(self.norm(hs)).float()  # (M, V)
        return StepOut(logits=logits, tap_hidden=tap_hidden[step.sample_index], tap_probs=tap_probs,
                       tap_states=tap_hidden if step.keep_tap_states else None)

    def _layers_step(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: StepBatch, kv,
                     tap_layer: int) -> tuple[torch.Tensor, torch.Tensor, list]:
        """``forward_step``'s decoder layers in Python: h (N, H), cos / sin (1, N, 1, hd). Returns
        (h after the last layer (N, H), h after layer ``tap_layer`` (N, H), its attention weights
        per part, as ``Attention.forward_step`` gives them)."""
        # masks once per step, not per layer (none for SFCL's prefill attention kernels, which need none)
        bias = decode_bias(step.decode.mask) if step.n_decode > 1 else None
        masks = (None if native_prefill_attention(h, self.a.head_dim)
                 else [chunk_mask(c.length, c.start, h.device) for c in step.chunks])
        tap_hidden = tap_probs = None
        for i, layer in enumerate(self.layers):
            is_tap = i == tap_layer
            attn_out, probs = layer.self_attn.forward_step(layer.input_layernorm(h), cos, sin, step, kv, i, is_tap,
                                                           bias, masks)
            h = h + attn_out
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if is_tap:
                tap_hidden, tap_probs = h, probs  # (N, H)
        return h, tap_hidden, tap_probs


@dataclass(slots=True)
class StepOut:
    """Result of ``LlamaModel.forward_step`` (tensors stay on the model's device)."""

    logits: torch.Tensor  # (M, V) float32, rows = StepBatch.sample_index
    tap_hidden: torch.Tensor  # (M, H) residual stream after the snapshot layer, same rows
    tap_probs: list  # per part (decode batch first, then chunks): float32 (B, nh, 1, S) or None
    tap_states: torch.Tensor | None  # (N, H) tap states of every token, when StepBatch.keep_tap_states


def load_weights(model: LlamaModel, state: dict[str, torch.Tensor]) -> None:
    """Copy a transformers-style state dict (``model.layers.N.self_attn.q_proj.weight`` ...) into
    ``model``, fusing q/k/v and gate/up. Raises KeyError naming a missing tensor."""
    a = model.a

    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        return state[name]

    with torch.no_grad():
        model.embed_tokens.weight.copy_(get("model.embed_tokens.weight"))
        model.norm.weight.copy_(get("model.norm.weight"))
        lm = state.get("lm_head.weight")
        if a.tie_word_embeddings or lm is None:
            model.lm_head.weight = model.embed_tokens.weight  # tied: one tensor, not two copies
        else:
            model.lm_head.weight.copy_(lm)
        for i, blk in enumerate(model.layers):
            p = f"model.layers.{i}."
            at = blk.self_attn
            at.qkv_proj.weight.copy_(torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"], 0))
            if a.attention_bias:
                at.qkv_proj.bias.copy_(torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"], 0))
            at.o_proj.weight.copy_(get(p + "self_attn.o_proj.weight"))
            if a.qk_norm:
                at.q_norm.weight.copy_(get(p + "self_attn.q_norm.weight"))
                at.k_norm.weight.copy_(get(p + "self_attn.k_norm.weight"))
            blk.mlp.gate_up_proj.weight.copy_(torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")], 0))
            blk.mlp.down_proj.weight.copy_(get(p + "mlp.down_proj.weight"))
            blk.input_layernorm.weight.copy_(get(p + "input_layernorm.weight"))
            blk.post_attention_layernorm.weight.copy_(get(p + "post_attention_layernorm.weight"))
