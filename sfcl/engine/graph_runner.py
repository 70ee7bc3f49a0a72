"""The engine's decode forward on static buffers, captured as CUDA graphs per (batch, KV-length)
bucket, with the snapshot tap inside the graph.

Called by ``sfcl.engine.model_runner.ModelRunner`` for pure-decode steps (steps with prompt chunks
run eagerly). Lives in the engine thread; buffers on the model's device. It returns what the
runner's eager decode returns: the logits, the snapshot layer's hidden state of each row and that
layer's attention dispersion already reduced on the device
(``sfcl.snapshot.triggers.attention_dispersion``), so the tap costs nothing extra outside the graph.

Shapes are padded to buckets so few graphs serve every step:

- batch: B decode rows (KV rows [0, B), the scheduler's layout) padded to Bp from
  ``batch_sizes`` (default 1, 2, 4, 8, then multiples of 8, and ``n_slots``). Padded rows compute
  garbage that is never read: their KV write goes to the cache's scratch row (``n_slots``; free
  during the forward: the scheduler uses it only for swaps, which run before it) at position 0,
  and their KV *read* is of rows [B, Bp), which are other sequences' or free rows, read only.
- KV length: the forward attends S = max(positions) + 1 positions; it runs with Sp >= S, the
  next multiple of ``kv_bucket`` (256) up to 2,048, beyond that the next multiple of 1/8 of the
  power of two below S (at most 12.5% extra KV read), capped at the cache's ``max_len``. The mask
  (position <= own position) is computed inside the graph from the positions, so positions past
  a row's length get exactly zero attention weight; ``KVCache.ensure_initialized(Bp, Sp)`` zeroes
  every never-written position up to Sp first, since 0 x NaN would still be NaN.

Inputs (token ids, positions, KV-write slots) reach the device as one pinned, non-blocking copy
of a (3, Bp) int64 tensor into the key's static buffer: no host sync. With ``capture=False`` (or on
a CPU) the very same padded function runs eagerly on the same buffers: the CPU tests compare it
with the runner's exact-shape eager decode. The INT8 KV cache runs through the same function; its
capture is exercised only by ``tests/gpu`` (a capture failure falls back to eager, see
``sfcl.model.cuda_graph``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sfcl.model.cuda_graph import Buffers, GraphCache
from sfcl.model.kv_cache import KVCache
from sfcl.model.llama import AttnBatch, LlamaModel
from sfcl.snapshot.triggers import attention_dispersion

FINE_KV_LIMIT = 2048  # up to this KV length, buckets are multiples of kv_bucket
KV_OCTAVE_STEPS = 8  # beyond it, 8 buckets per power of two (<= 12.5% padding)


@dataclass(slots=True)
class DecodeOut:
    """One decode forward (tensors on the model's device, owned by the caller)."""

    logits: torch.Tensor  # (B, V) float32, next-token logits of each row
    hidden: torch.Tensor  # (B, H) model dtype, residual stream after the snapshot layer
    dispersion: torch.Tensor  # (B,) float32, snapshot-layer normalised attention entropy


def default_batch_sizes(n_slots: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... (multiples of 8) up to n_slots, and n_slots itself."""
    sizes = {b for b in (1, 2, 4) if b <= n_slots} | set(range(8, n_slots + 1, 8)) | {n_slots}
    return sorted(sizes)


class DecodeGraphRunner:
    """Batched decode step with the snapshot tap on static, bucketed buffers.

    model / kv / tap_layer: as the runner's. capture: record CUDA graphs (ignored off CUDA).
    batch_sizes: padded batch sizes (ascending, each <= kv.n_slots; default
    ``default_batch_sizes``). kv_bucket: KV-length granularity up to 2,048 positions.
    max_graphs: captured keys at most (further keys run eagerly on static buffers).
    Raises ValueError for a bad bucket list or tap layer.
    """

    def __init__(self, model: LlamaModel, kv: KVCache, tap_layer: int, *, capture: bool = True,
                 batch_sizes: list[int] | None = None, kv_bucket: int = 256, max_graphs: int = 256,
                 warmup: int = 2):
        if not 0 <= tap_layer < model.a.n_layers:
            raise ValueError(f"snapshot layer {tap_layer} is outside 0..{model.a.n_layers - 1}")
        sizes = sorted(set(batch_sizes)) if batch_sizes else default_batch_sizes(kv.n_slots)
        if sizes[0] < 1 or sizes[-1] > kv.n_slots:
            raise ValueError(f"batch sizes must be in 1..{kv.n_slots}, got {sizes}")
        if sizes[-1] != kv.n_slots:
            sizes.append(kv.n_slots)  # every batch the scheduler can form has a bucket
        if kv_bucket < 1:
            raise ValueError("kv_bucket must be >= 1")
        self.model, self.kv, self.tap_layer = model, kv, tap_layer
        self.device = next(model.parameters()).device
        self.batch_sizes, self.kv_bucket = sizes, int(kv_bucket)
        self.graphs = GraphCache(self.device, capture=capture, warmup=warmup, max_graphs=max_graphs)
        self._pin = self.device.type == "cuda"

    @property
    def capture(self) -> bool:
        """True while steps are (or will be) served by captured graphs."""
        return self.graphs.capture

    def batch_bucket(self, B: int) -> int:
        """Smallest padded batch size >= B. Raises ValueError if B exceeds the cache's slots."""
        for b in self.batch_sizes:
            if b >= B:
                return b
        raise ValueError(f"decode batch {B} exceeds the {self.kv.n_slots} cache slots")

    def kv_len_bucket(self, S: int) -> int:
        """Padded attended length Sp >= S (see the module docstring), <= the cache's max_len."""
        if S <= FINE_KV_LIMIT:
            g = self.kv_bucket
        else:
            g = max(self.kv_bucket, (1 << ((S - 1).bit_length() - 1)) // KV_OCTAVE_STEPS)
        return min(self.kv.max_len, -(-S // g) * g)

    def run(self, tokens: list[int] | torch.Tensor, positions: list[int]) -> DecodeOut:
        """Decode one token for each of the rows in KV slots [0, B).

        tokens: the last token of each row: B host ints, or a (B,) int64 tensor on the model's
        device (e.g. last step's device-side argmax: copied on the device, no host sync).
        positions: B host ints, that token's position (the row holds KV for [0, position)).
        Returns a ``DecodeOut`` of B rows.
        Raises ValueError on mismatched lengths, B outside 1..n_slots or a position past max_len.
        """
        on_device = isinstance(tokens, torch.Tensor)
        B = len(tokens)
        if B != len(positions) or B < 1:
            raise ValueError("tokens and positions must be non-empty lists of the same length")
        S = max(positions) + 1
        if min(positions) < 0 or S > self.kv.max_len:
            raise ValueError(f"positions must be in 0..{self.kv.max_len - 1}")
        Bp, Sp = self.batch_bucket(B), self.kv_len_bucket(S)
        self.kv.ensure_initialized(Bp, Sp)  # masked positions must hold finite values
        scratch = self.kv.n_slots
        pad = Bp - B
        host = torch.tensor([([0] * B if on_device else list(tokens)) + [0] * pad, list(positions) + [0] * pad,
                             list(range(B)) + [scratch] * pad], dtype=torch.long)  # (3, Bp)
        if self._pin:
            host = host.pin_memory()  # the caching host allocator keeps it alive until the copy ran

        def make_inputs() -> Buffers:  # harmless: ids 0 at position 0, every KV write to scratch
            io = torch.zeros(3, Bp, dtype=torch.long, device=self.device)
            io[2] = scratch
            return {"io": io}

        def fill(inp: Buffers) -> None:
            inp["io"].copy_(host, non_blocking=True)
            if on_device:
                inp["io"][0, :B].copy_(tokens)

        def fn(inp: Buffers) -> Buffers:
            return self._forward(inp["io"], Bp, Sp)

        out, replayed = self.graphs.run((Bp, Sp), make_inputs, fill, fn)
        res = DecodeOut(logits=out["logits"][:B], hidden=out["hidden"][:B], dispersion=out["dispersion"][:B])
        if replayed:  # static buffers: the next replay of this key overwrites them
            res = DecodeOut(res.logits.clone(), res.hidden.clone(), res.dispersion.clone())
        return res

    def _forward(self, io: torch.Tensor, Bp: int, Sp: int) -> Buffers:
        """The captured computation: io (3, Bp) int64 rows = token ids, positions, KV-write slots."""
        ids, pos, slots = io[0], io[1], io[2]  # (Bp,) each
        mask = torch.arange(Sp, device=io.device)[None, :] <= pos[:, None]  # (Bp, Sp)
        batch = AttnBatch(is_prefill=False, slots=slots, positions=pos, kv_len=Sp,
                          mask=mask.view(Bp, 1, 1, Sp), slot_range=(0, Bp))
        fo = self.model(ids[:, None], batch, self.kv, self.tap_layer)
        return {"logits": fo.logits,  # (Bp, V) float32
                "hidden": fo.tap_hidden[:, -1],  # (Bp, H)
                "dispersion": attention_dispersion(fo.tap_probs[:, :, -1], pos + 1)}  # (Bp,)
