"""The decoder layers of a decode-only step in one C++ call (``torch.ops.sfcl.decode_layers``).

``LlamaModel.forward_step`` hands a step here when it holds only decode rows and the engine turned
the fused kernels on (``KVCache.fused_layers``): ``csrc/decode_layers.cpp`` runs every layer
(RMSNorm, q/k/v projection, rotary embedding, ``decode_attention``, output projection, residual,
RMSNorm, gate/up projection, SiLU * up, down projection, residual) without returning to Python,
with torch's own GEMM / packed GEMV kernels for the projections; the embedding, the final norm and
``lm_head`` stay in ``llama.py``. Why: at one stream the Python forward is ~2,000 small operators
per step, whose fixed costs matched the weights' GEMVs (``docs/performance-journal.md``).

The projections are the ones ``QuantLinear.forward`` would take for this step's row count
(``QuantLinear.path``), so a step computes with the same weights either way. Not used (the Python
forward runs) for: prompt chunks in the step, shared-prefix row groups, rows outside one slot
range, per-head q/k norms (Qwen3), ``Fp16Linear`` or ``dense="fp16"/"dequant"`` projections on
the path the step takes, and under ``torch.compile``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from sfcl.model import quant
from sfcl.model.quant import QuantLinear

# csrc/decode_layers.cpp's kDense, kInt8, kInt4, kInt4Q8, kInt8Q8
KIND_DENSE, KIND_INT8, KIND_INT4, KIND_INT4_Q8, KIND_INT8_Q8 = 0, 1, 2, 3, 4
_EMPTY = torch.empty(0)
# model -> {(rows, dense only): LayerArgs} for the model's current weights: a weight swap drops them
_cache: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()
quant.on_new_weights(lambda model: _cache.pop(model, None))  # the replaced weights are freed with the entries


@dataclass(slots=True)
class LayerArgs:
    """The per-layer tensors ``decode_layers`` takes, for one projection path (packed or dense):
    ``norms`` 2 per layer (input, post-attention), and 4 per layer (qkv, o, gate_up, down) of
    ``weights``, ``scales`` (empty for dense), ``biases`` (None where there is none) and ``kinds``."""

    norms: list[torch.Tensor]
    weights: list[torch.Tensor]
    scales: list[torch.Tensor]
    biases: list[torch.Tensor | None]
    kinds: list[int]


def _projection(lin: nn.Module, rows: int) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """(kind, weight, scales, bias) of the path ``lin`` takes for ``rows`` input rows, or None when
    that path is not one ``decode_layers`` runs."""
    if isinstance(lin, QuantLinear):
        path = lin.path(rows)
        if path == "packed":
            if lin.mode == "int8":  # SFCL's int8 x int8 GEMV (quant.int8_kernel) or the bf16-activation one
                return KIND_INT8_Q8 if lin.kernel == "q8" else KIND_INT8, lin.qweight, lin.scales, lin.bias
            if lin.kernel == "sfcl":  # SFCL's int4 x int8 GEMV and layout (quant.int4_kernel)
                return KIND_INT4_Q8, lin.q4codes, lin.q4sz, lin.bias
            return KIND_INT4, lin.qweight, lin.scales_and_zeros, lin.bias
        if path == "dense":
            return KIND_DENSE, lin.dense_weight, _EMPTY, lin.bias
        return None  # fp16 / dequant dense paths
    if type(lin) is nn.Linear or isinstance(lin, quant.PackedLinear):  # plain, or packed for oneDNN
        return KIND_DENSE, lin.weight, _EMPTY, lin.bias
    return None  # Fp16Linear and anything else


def layer_args(model, rows: int) -> LayerArgs | None:
    """The arguments for a step of ``rows`` decode rows, or None when some layer cannot run in
    ``decode_layers``. Cached per model, row count and dense mode until ``quantize_weights`` or
    ``pack_dense_weights`` swap the model's weights, which drops the model's entries
    (``quant.on_new_weights``): kept, they would be stale and keep the replaced tensors alive. A first ``sfcl serve`` calibrates the default library
    on the plain weights and then quantizes and packs them; the plain ones stayed resident (+~330 MiB
    RSS for the life of that server on the AMD EPYC, 2026-12-07, until this dropped them).
    Weak on the model: a copied model (deepcopy) starts without entries."""
    cache, key = _cache.setdefault(model, {}), (rows, quant.in_prompt_rows())
    if key in cache:
        return cache[key]
    out: LayerArgs | None = None
    if not model.a.qk_norm:
        out = LayerArgs([], [], [], [], [])
        for blk in model.layers:
            out.norms += [blk.input_layernorm.weight, blk.post_attention_layernorm.weight]
            for lin in (blk.self_attn.qkv_proj, blk.self_attn.o_proj, blk.mlp.gate_up_proj, blk.mlp.down_proj):
                p = _projection(lin, rows)
                if p is None:
                    out = None
                    break
                out.kinds.append(p[0])
                out.weights.append(p[1])
                out.scales.append(p[2])
                out.biases.append(p[3])
            if out is None:
                break
    cache[key] = out
    return out


def applies(step, kv) -> bool:
    """Whether ``step`` (a ``StepBatch``) can run through ``decode_layers`` with this KV cache."""
    d = step.decode
    return (kv.fused_layers and not step.chunks and d is not None and d.slot_range is not None and not d.groups
            and not torch.compiler.is_compiling())


def run(model, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step, kv, tap_layer: int
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """All decoder layers of a decode-only step.

    h: (B, H) embeddings of the rows' new tokens, model dtype; cos / sin: (B, hd) rotary factors
    (``LlamaModel.rope``, sin signed), model dtype. Returns (h (B, H) after the last layer, the
    residual stream after layer ``tap_layer`` (B, H), its attention weights float32 (B, nh, 1, S)),
    or None when ``layer_args`` says the model's projections cannot run there (the caller then
    runs the Python forward). Raises RuntimeError (from the operator) on inconsistent shapes."""
    la = layer_args(model, h.shape[0])
    if la is None:
        return None
    d, a = step.decode, model.a
    S = d.mask.shape[-1]
    return torch.ops.sfcl.decode_layers(h, cos, sin, la.norms, la.weights, la.scales, la.biases, la.kinds,
                                        kv.k, kv.v, d.positions, d.slot_range[0], S, a.head_dim ** -0.5,
                                        a.rms_norm_eps, a.n_heads, tap_layer, True)
