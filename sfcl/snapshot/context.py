"""Context anchors: the request's own prompt as a per-request anchor set (issue 4, item 2).

During prefill the model already computes the snapshot layer's hidden state at every prompt
position. ``ContextAnchors.add`` keeps them (CPU, float16, unit-norm) so that a snapshot can also
search the prompt: a context anchor at prompt position p carries the one-hot "next-token
distribution" of the prompt token at p + 1, which is what pulls a shaky entity toward what the
document actually says. The last prompt position has no next prompt token and is never kept.

Capture is incremental (chunked prefill calls ``add`` once per chunk) and bounded per request:
at most ``max_positions`` positions; a longer prompt keeps every ``stride``-th position,
stride = ceil((L - 1) / max_positions), decided from the full prompt length L so every chunk of
one prompt uses the same grid. Captured chunks also go to a small LRU keyed by the hash of the
token prefix up to each chunk's end, so a later request sharing a prefix (prefix-cache hit, no
recompute) restores them with ``restore`` instead of losing them, up to where the prompts diverge.
(A chunk captured as the *end* of an earlier prompt lacks that prompt's last position; a restore
leaves that one gap.)

Engine thread only; all tensors here live on the CPU.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass, field

import torch


def prefix_hash(token_ids, end: int, stride: int = 1) -> str:
    """Hex digest identifying token_ids[:end] (and the capture stride)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(stride.to_bytes(4, "little"))
    h.update(torch.as_tensor(list(token_ids[:end]), dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()


@dataclass(slots=True)
class _Chunk:
    start: int  # first prompt position this chunk covered
    end: int  # one past its last covered position
    positions: torch.Tensor  # (m,) int64 kept positions in [start, end)
    vectors: torch.Tensor  # (m, H) float16 unit-norm
    next_ids: torch.Tensor  # (m,) int64 prompt token at position + 1
    prefix: torch.Tensor  # (end,) int64 prompt tokens [0, end) the states depend on
    stride: int  # capture grid of the prompt it was taken from


@dataclass(slots=True)
class _RequestAnchors:
    token_ids: list[int]
    stride: int
    chunks: list[_Chunk] = field(default_factory=list)
    covered: int = 0  # prompt positions [0, covered) captured or restored
    _cat: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # concatenated view

    def cat(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._cat is None:
            cs = [c for c in self.chunks if len(c.positions)]
            if cs:
                self._cat = (torch.cat([c.vectors for c in cs]), torch.cat([c.positions for c in cs]),
                             torch.cat([c.next_ids for c in cs]))
            else:
                self._cat = (torch.zeros(0, 0, dtype=torch.float16), torch.zeros(0, dtype=torch.int64),
                             torch.zeros(0, dtype=torch.int64))
        return self._cat


class ContextAnchors:
    """Per-request prompt anchors with a prefix-keyed LRU of captured chunks.

    max_positions: kept positions per request (memory: max_positions * H * 2 bytes, 4.7 MB for
    4,096 x 576). lru_chunks: captured chunks kept for reuse across requests.
    """

    def __init__(self, max_positions: int = 4096, lru_chunks: int = 64):
        if max_positions < 1 or lru_chunks < 0:
            raise ValueError("max_positions must be >= 1 and lru_chunks >= 0")
        self.max_positions = max_positions
        self.lru_chunks = lru_chunks
        self.requests: dict[str, _RequestAnchors] = {}
        self.lru: OrderedDict[str, _Chunk] = OrderedDict()

    def _stride(self, n_prompt: int) -> int:
        return max(1, math.ceil((n_prompt - 1) / self.max_positions))

    def _entry(self, request_id: str, token_ids) -> _RequestAnchors:
        e = self.requests.get(request_id)
        if e is None:
            ids = list(token_ids)
            e = self.requests[request_id] = _RequestAnchors(token_ids=ids, stride=self._stride(len(ids)))
        return e

    def add(self, request_id: str, start_pos: int, tap_hidden: torch.Tensor, token_ids) -> None:
        """Capture one prefill forward's snapshot-layer states.

        start_pos: prompt position of tap_hidden's first row. tap_hidden: (T, H) (any float dtype,
        any device) for positions [start_pos, start_pos + T). token_ids: the *whole* prompt (list
        of int, length L); it gives each position's next token and the prefix hash. When start_pos
        lies past what this request captured so far (a prefix-cache hit), the skipped positions
        are first restored from the LRU where it holds them (``restore``).
        Raises ValueError if the chunk runs past the prompt.
        """
        e = self._entry(request_id, token_ids)
        if start_pos > e.covered:  # a prefix-cache hit skipped [covered, start_pos): reuse its capture
            self.restore(request_id, token_ids, start_pos)
        T = int(tap_hidden.shape[0])
        L = len(e.token_ids)
        if start_pos < 0 or start_pos + T > L:
            raise ValueError(f"chunk [{start_pos}, {start_pos + T}) is outside the prompt of {L} tokens")
        end = start_pos + T
        # positions on the request's grid that have a next prompt token (p <= L - 2)
        first = -(-start_pos // e.stride) * e.stride
        pos = torch.arange(first, min(end, L - 1), e.stride, dtype=torch.int64)  # (m,)
        rows = tap_hidden[(pos - start_pos).to(tap_hidden.device)].float()  # (m, H)
        vec = (rows / rows.norm(dim=1, keepdim=True).clamp_min(1e-12)).to("cpu", torch.float16)
        ids = torch.as_tensor(e.token_ids, dtype=torch.int64)
        ch = _Chunk(start=start_pos, end=end, positions=pos, vectors=vec, next_ids=ids[pos + 1],
                    prefix=ids[:end], stride=e.stride)
        e.chunks.append(ch)
        e.covered = max(e.covered, end)
        e._cat = None
        if self.lru_chunks:
            key = prefix_hash(e.token_ids, end, e.stride)
            self.lru[key] = ch
            self.lru.move_to_end(key)
            while len(self.lru) > self.lru_chunks:
                self.lru.popitem(last=False)

    def restore(self, request_id: str, token_ids, upto: int) -> int:
        """Reuse captured chunks for the prompt prefix [0, upto) (e.g. a prefix-cache hit that
        skips recomputing those positions). A captured state at position p is valid for any prompt
        that shares tokens [0, p] (causal attention), so a chunk also serves a prompt that diverges
        inside it, up to the divergence. Returns the number of positions restored from where this
        request's capture ended (contiguous; 0 when the LRU holds nothing for this prefix)."""
        e = self._entry(request_id, token_ids)
        ids = torch.as_tensor(e.token_ids, dtype=torch.int64)
        covered = start = e.covered
        while covered < upto:
            best = None  # (reach, key, chunk)
            for key, ch in self.lru.items():
                if ch.stride != e.stride or not ch.start <= covered < ch.end:
                    continue
                n = min(ch.end, len(ids))
                diff = (ch.prefix[:n] != ids[:n]).nonzero()
                reach = min(n if len(diff) == 0 else int(diff[0, 0]), upto)  # states valid below it
                if reach > covered and (best is None or reach > best[0]):
                    best = (reach, key, ch)
            if best is None:
                break
            reach, key, ch = best
            keep = (ch.positions >= covered) & (ch.positions < reach) & (ch.positions < len(ids) - 1)
            pos = ch.positions[keep]
            # next tokens come from this prompt: a chunk's last position looks past its own prefix
            e.chunks.append(_Chunk(start=covered, end=reach, positions=pos, vectors=ch.vectors[keep],
                                   next_ids=ids[pos + 1], prefix=ids[:reach], stride=e.stride))
            self.lru.move_to_end(key)
            covered = reach
        e.covered, e._cat = covered, None
        return covered - start

    def has(self, request_id: str) -> bool:
        e = self.requests.get(request_id)
        return e is not None and any(len(c.positions) for c in e.chunks)

    def count(self, request_id: str) -> int:
        e = self.requests.get(request_id)
        return 0 if e is None else int(e.cat()[1].numel())

    def search(self, request_id: str, query: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Top-k prompt positions for one query.

        query: (H,) float (CPU). Returns (scores (k',) float32 cosine, positions (k',) int64,
        next_ids (k',) int64), best first, k' = min(k, kept positions) (0 when none).
        """
        e = self.requests.get(request_id)
        if e is None:
            z = torch.zeros(0)
            return z, z.long(), z.long()
        vec, pos, nxt = e.cat()
        if not len(pos):
            z = torch.zeros(0)
            return z, z.long(), z.long()
        q = query.detach().to("cpu", torch.float32)
        q = q / q.norm().clamp_min(1e-12)
        s = vec.float() @ q  # (m,)
        sc, j = torch.topk(s, min(k, len(pos)))
        return sc, pos[j], nxt[j]

    def span_text(self, request_id: str, position: int, tokenizer, before: int = 12, after: int = 2) -> str:
        """Decoded prompt text around ``position`` (tokens [p - before, p + after))."""
        e = self.requests.get(request_id)
        if e is None:
            return ""
        return tokenizer.decode(e.token_ids[max(0, position - before):position + after], skip_special_tokens=True)

    def release(self, request_id: str) -> None:
        """Drop a finished request's anchors (LRU entries stay for later requests)."""
        self.requests.pop(request_id, None)
