"""Anchor search on the model's device, for the fused lookup (one host transfer per step).

``sfcl.library.index.AnchorIndex`` searches on the CPU, which needs the looked-up rows' hidden
states on the host first: a second device->host transfer in a step whose packed results already
went over. On a GPU it is cheaper to search *every* sampled row on the device (a (N, H) x (H, A)
matmul is nothing next to the forward) and send the top-k ids, scores and confidences along with
the step's other per-row results; the host keeps only the rows whose trigger fired
(``sfcl.engine.fused_lookup``).

The algorithm mirrors ``AnchorIndex``'s dense search exactly so both paths return the same
anchors: with a 16-bit search copy, candidates (``sfcl.library.index.candidates``: 12 for k = 3)
by a 16-bit matmul, re-scored in float32 against the stored float16 vectors; with float32, exact
outright. (A CPU ``AnchorIndex`` over a large library may use IVF candidates instead; the
snapshotter builds a dense one wherever the fused lookup is the default, on CUDA.) Confidences are
``sfcl.snapshot.triggers.anchor_confidence_each`` of the library's weights and decays.

Memory on the device: the search copy (N x D x 2 bytes in bf16) plus the stored float16 vectors
for re-scoring (N x D x 2 more; none extra when the search dtype is float16): 128 MiB for
32,768 x 1,024 anchors. On a CPU device nothing is copied (the snapshotter's index tensors are
reused). Built lazily per library version by ``Snapshotter.device_index`` and dropped with it.
"""

from __future__ import annotations

import torch

from sfcl.library.index import candidates, unit_rows

MAX_EXACT_ID = 1 << 24  # ids travel as float32 in the packed transfer: exact below 2**24


class DeviceAnchorIndex:
    """Device copy of an ``AnchorIndex`` plus per-anchor weights and decays.

    index: the snapshotter's ``AnchorIndex`` (its dtype and vectors); weights, decay: (N,) float32.
    Raises ValueError when the library has 2**24 anchors or more (ids must stay exact in float32).
    """

    def __init__(self, index, weights: torch.Tensor, decay: torch.Tensor, device: str | torch.device):
        self.device = torch.device(device)
        if index.n >= MAX_EXACT_ID:
            raise ValueError(f"fused lookup supports fewer than {MAX_EXACT_ID} anchors, library has {index.n}")
        self.dtype, self.n, self.dim = index.dtype, index.n, index.dim
        dense = index.vectors if index.vectors is not None else index.stored.to(index.dtype)  # an IVF index has none
        self.vectors = dense.to(self.device)  # (N, D) search copy; no copy on the CPU
        self.stored = None if self.dtype == torch.float32 else (  # (N, D) f16 for re-scoring 16-bit candidates
            self.vectors if index.stored is dense else index.stored.to(self.device))
        self.weights = weights.to(self.device, torch.float32)  # (N,)
        self.decay = decay.to(self.device, torch.float32)  # (N,)

    def search(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Top-k anchors of every row, on the device, without a host sync.

        hidden: (n, D) any float dtype on this device. Returns (scores (n, k') float32 cosine,
        ids (n, k') int64, confidence (n, k') float32), best first, k' = min(k, N).
        Raises ValueError for a wrong shape or k < 1.
        """
        from sfcl.snapshot.triggers import anchor_confidence_each

        if hidden.dim() != 2 or hidden.shape[1] != self.dim:
            raise ValueError(f"hidden must have shape (n, {self.dim}), got {tuple(hidden.shape)}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        k = min(k, self.n)
        q = unit_rows(hidden, self.device)  # (n, D) float32
        if self.dtype == torch.float32:
            scores, ids = torch.topk(q @ self.vectors.T, k, dim=1)  # (n, k)
        else:
            c = candidates(k, self.n)
            _, cand = torch.topk(q.to(self.dtype) @ self.vectors.T, c, dim=1)  # (n, c)
            exact = torch.bmm(self.stored[cand].float(), q.unsqueeze(2)).squeeze(2)  # (n, c)
            scores, pos = torch.topk(exact, k, dim=1)
            ids = torch.gather(cand, 1, pos)  # (n, k)
        conf = anchor_confidence_each(scores, self.weights[ids], self.decay[ids])  # (n, k)
        return scores, ids, conf
