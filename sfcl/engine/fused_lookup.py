"""Fused lookup: the step's anchor searches done on the device and sent to the host in the same
single transfer as the per-row results (issue 3, item 4: one device->host synchronisation per
step).

Called by ``sfcl.engine.model_runner.ModelRunner.execute`` when ``fused_lookup`` is on (the
default on CUDA). Without it the runner transfers the packed per-row results, and then, when some
row's trigger fired, the looked-up rows' hidden states for a CPU search: two waits on the device
in such a step. Fused, every sampled row is searched on the device (which rows fired is not known
on the host before the transfer, and the search of all N rows costs about what the search of the
fired ones does on a GPU), and one flat float32 tensor carries:

    [ per-row results (N, C) | per library version: scores (N, k), ids (N, k), confidences (N, k)
      | steering candidates: hidden (n_s, H) and logits (n_s, V) ]

float32 is lossless here: every value is a float32 on the device already, and token and anchor ids
are exact below 2**24 (checked). Steering candidates are rows of requests that asked for steering
with snapshots on: whether their trigger fires is unknown before the transfer, and a steered
re-sample needs their logits (kNN-LM mixture) and hidden state (context-anchor search) on the host,
so they ride along on every step for those requests only (V x 4 bytes per row: 0.5 MB for a 128k
vocabulary, tens of microseconds over PCIe/NVLink) instead of costing a second transfer.

On the CPU (no device, no sync) the unfused path is cheaper; the fused one stays selectable
(``ModelRunner(fused_lookup=True)``) so the tests can check that both give the same hits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sfcl.snapshot.device_search import MAX_EXACT_ID

Found = tuple[list[list[float]], list[list[int]], list[list[float]]]  # per row: scores, anchor ids, confidences


@dataclass(slots=True)
class FusedTransfer:
    """Host side of one fused step transfer (plain lists and CPU tensors)."""

    rows: list[list[float]]  # (N, C) the per-row results, as the unfused path's packed ``.tolist()``
    found: dict[int, Found] = field(default_factory=dict)  # id(Snapshotter) -> search results of all N rows
    search_ms: dict[int, float] = field(default_factory=dict)  # id(Snapshotter) -> device search time, ms
    steer_hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # row -> (H,) float32, CPU
    steer_logits: dict[int, torch.Tensor] = field(default_factory=dict)  # row -> (V,) float32, CPU

    def found_for(self, snap, rows: list[int]) -> Found:
        """``Snapshotter.lookup``'s ``found`` argument for ``rows`` (step row indices)."""
        s, i, c = self.found[id(snap)]
        return [s[r] for r in rows], [i[r] for r in rows], [c[r] for r in rows]

    def hidden_logits(self, rows: list[int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(hidden (n, H), logits (n, V)) float32 CPU tensors for ``rows``, or (None, None) when
        none of them is a steering candidate. Rows that are not hold zeros (never read)."""
        have = [j for j, r in enumerate(rows) if r in self.steer_hidden]
        if not have:
            return None, None
        h0, l0 = self.steer_hidden[rows[have[0]]], self.steer_logits[rows[have[0]]]
        h = torch.zeros(len(rows), h0.numel())
        lg = torch.zeros(len(rows), l0.numel())
        for j in have:
            h[j], lg[j] = self.steer_hidden[rows[j]], self.steer_logits[rows[j]]
        return h, lg


def _rows(x: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """x[idx] by slicing (no index tensor to upload, so no host->device copy)."""
    return torch.cat([x[i:i + 1] for i in idx])


def transfer(to_host: Callable[[torch.Tensor], torch.Tensor], packed: torch.Tensor, hidden: torch.Tensor,
             logits: torch.Tensor, snaps: list, steer_rows: list[int]) -> FusedTransfer:
    """Search every row on the device for each library version in ``snaps``, pack everything into
    one tensor, bring it over with one ``to_host`` call, and unpack it.

    packed: (N, C) per-row results (any float dtype; values exact in float32). hidden: (N, H)
    snapshot-layer states. logits: (N, V) float32. snaps: the ``Snapshotter``s rows are bound to.
    steer_rows: rows whose hidden state and logits the host needs (steering candidates).
    Raises ValueError when V >= 2**24 (token ids would not be exact in float32).
    """
    if logits.shape[1] >= MAX_EXACT_ID:
        raise ValueError(f"fused lookup needs a vocabulary below {MAX_EXACT_ID} tokens")
    N, C = packed.shape
    dev = hidden.device
    cuda = dev.type == "cuda"
    parts = [packed.float().reshape(-1)]
    ks, timers = [], []
    for snap in snaps:
        di = snap.device_index(dev)
        if cuda:
            t = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            t[0].record()
        else:
            t = time.perf_counter()
        s, i, c = di.search(hidden, snap.top_k)  # (N, k) each
        if cuda:
            t[1].record()
            timers.append(t)
        else:
            timers.append((time.perf_counter() - t) * 1e3)
        ks.append(s.shape[1])
        parts.append(torch.cat([s, i.float(), c], 1).reshape(-1))  # (N, 3k)
    H, V = hidden.shape[1], logits.shape[1]
    if steer_rows:
        parts.append(torch.cat([_rows(hidden, steer_rows).float(), _rows(logits, steer_rows).float()], 1).reshape(-1))
    host = to_host(torch.cat(parts))  # the step's one device->host transfer
    out = FusedTransfer(rows=host[:N * C].view(N, C).tolist())
    off = N * C
    for snap, k, t in zip(snaps, ks, timers):
        block = host[off:off + N * 3 * k].view(N, 3 * k)
        off += N * 3 * k
        ids = [[int(x) for x in r] for r in block[:, k:2 * k].tolist()]
        out.found[id(snap)] = (block[:, :k].tolist(), ids, block[:, 2 * k:].tolist())
        out.search_ms[id(snap)] = t[0].elapsed_time(t[1]) if cuda else t  # events completed: no wait
    if steer_rows:
        block = host[off:off + len(steer_rows) * (H + V)].view(len(steer_rows), H + V)
        for j, r in enumerate(steer_rows):
            out.steer_hidden[r], out.steer_logits[r] = block[j, :H], block[j, H:]
    return out
