"""CUDA-graph capture of the decode step, applied from outside the model, with an eager switch.

Why: at small batch a decode step is hundreds of tiny kernels; on a fast GPU the CPU cannot launch
them as fast as the GPU runs them, so the step is launch-bound. Recording the step once as a
``torch.cuda.CUDAGraph`` and replaying it removes the per-kernel launch cost (the approach of
vLLM's ``CUDAGraphRunner`` and gpt-fast's ``decode_one_token`` under ``torch.compile(mode=
"reduce-overhead")``). The model code is not changed: this module calls ``LlamaModel.forward``
with static tensors.

A graph replays fixed shapes and fixed memory addresses, so:
- inputs are copied into static buffers before each replay (ids, positions) and the output is a
  static buffer overwritten by the next replay (consume or clone it first);
- the attended KV length S is rounded up to a bucket (``bucket`` positions, capped at the cache's
  ``max_len``) and one graph is captured per (batch size B, S bucket), lazily, sharing one memory
  pool. The mask (position <= own position) is computed inside the graph from the positions, so
  cache positions between a sequence's length and the bucket end are masked out. They must hold
  finite values (a masked -inf score times a NaN value is still NaN): zero the cache once
  (``KVCache`` uses ``torch.empty``);
- decode runs over slots [0, B) (the scheduler's compaction keeps running sequences there).
- Capturing writes K/V at the capture positions (the last position of the bucket), which is
  either unused or overwritten by the real token before it is attended.

``DecodeGraphs(model, kv, enabled=False)`` (or any non-CUDA device) runs the same step eagerly with
the exact S, which is the reference the graph is tested against (tests/gpu/test_cuda.py).
"""

from __future__ import annotations

import torch

from sfcl.model.llama import AttnBatch, LlamaModel


class DecodeGraphs:
    """Batched greedy-free decode step ``step(ids, positions, kv_len) -> logits``.

    ids: (B,) int64 on the model's device, the last token of each sequence in slots [0, B).
    positions: (B,) int64, the absolute position of each of those tokens.
    kv_len: host int, max(positions) + 1 (the engine knows it without a device sync).
    Returns logits (B, V) float32. With graphs on, this tensor is a static buffer that the next
    ``step`` with the same (B, bucket) overwrites.
    Raises ValueError when B exceeds the cache's slots or kv_len exceeds its ``max_len``.
    """

    def __init__(self, model: LlamaModel, kv, *, enabled: bool = True, bucket: int = 256, warmup: int = 2):
        self.model, self.kv = model, kv
        self.device = next(model.parameters()).device
        self.enabled = bool(enabled) and self.device.type == "cuda"
        self.bucket, self.warmup = max(1, bucket), warmup
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]] = {}
        self._pool = None

    @property
    def captured(self) -> list[tuple[int, int]]:
        """(B, S bucket) pairs captured so far."""
        return sorted(self._graphs)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, S: int) -> torch.Tensor:
        B = ids.shape[0]
        mask = torch.arange(S, device=ids.device)[None, :] <= positions[:, None]  # (B, S)
        batch = AttnBatch(is_prefill=False, slots=torch.arange(B, device=ids.device), positions=positions,
                          kv_len=S, mask=mask.view(B, 1, 1, S), slot_range=(0, B))
        return self.model(ids[:, None], batch, self.kv, tap_layer=-1, want_probs=False).logits  # (B, V)

    def _check(self, B: int, kv_len: int) -> None:
        if not 1 <= B <= self.kv.n_slots:
            raise ValueError(f"batch {B} outside 1..{self.kv.n_slots} cache slots")
        if not 1 <= kv_len <= self.kv.max_len:
            raise ValueError(f"kv_len {kv_len} outside 1..{self.kv.max_len}")

    def step(self, ids: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        B = ids.shape[0]
        self._check(B, kv_len)
        if not self.enabled:
            return self._forward(ids, positions, kv_len)
        S = min(self.kv.max_len, -(-kv_len // self.bucket) * self.bucket)
        key = (B, S)
        if key not in self._graphs:
            self._graphs[key] = self._capture(B, S)
        graph, st = self._graphs[key]
        st["ids"].copy_(ids)
        st["positions"].copy_(positions)
        graph.replay()
        return st["logits"]

    def _capture(self, B: int, S: int):
        st = {"ids": torch.zeros(B, dtype=torch.long, device=self.device),
              "positions": torch.full((B,), S - 1, dtype=torch.long, device=self.device)}
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up off the capture stream (cuBLAS handles, allocator)
            for _ in range(self.warmup):
                self._forward(st["ids"], st["positions"], S)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            st["logits"] = self._forward(st["ids"], st["positions"], S)
        if self._pool is None:
            self._pool = graph.pool()
        return graph, st
